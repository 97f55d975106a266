"""The KL reference of a LoRA actor is the base model, in the default suite (issue 43 item 12).

ActorRolloutRefWorker with `model.lora_rank > 0` builds no reference model: `compute_ref_log_prob`
runs the actor with its adapter bypassed (verl/workers/lora_role.py). The Ray test of this
(tests/workers/test_lora_actor.py) is slow; here one worker runs in this process (rank 0 of 1, gloo,
the HF rollout), its adapter set to a trained one (lora_B != 0: with PEFT's initial B = 0 the adapted
model is the base, and a reference computed with the adapter on would pass).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from tests.conftest import free_port
from tests.workers._batches import load_trainer_config, make_ppo_batch
from verl.protocol import DataProto
from verl.utils import batch_keys as K
from verl.workers.actor.dp_actor import DataParallelPPOActor

torch.set_num_threads(1)
MICRO_BATCH = 4


@pytest.fixture
def lora_worker(tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch):
    """A LoRA ActorRolloutRefWorker (role actor_rollout_ref), its model loaded, alone in its process group."""
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    assert not dist.is_initialized(), "a process group left initialised by an earlier test"
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    cfg = load_trainer_config(tiny_model_dir, **{
        "actor_rollout_ref.model.lora_rank": 4,
        "actor_rollout_ref.model.lora_alpha": 8,
        "actor_rollout_ref.model.use_remove_padding": True,
        "actor_rollout_ref.rollout.name": "hf",
        "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
        "actor_rollout_ref.actor.ppo_micro_batch_size": MICRO_BATCH,
        "actor_rollout_ref.ref.log_prob_micro_batch_size": MICRO_BATCH,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size": MICRO_BATCH,
        "actor_rollout_ref.rollout.micro_batch_size": 2,
        "data.max_response_length": 6,
    })
    OmegaConf.resolve(cfg)
    worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, role="actor_rollout_ref")
    try:
        worker.init_model()
        yield worker
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _batch(vocab_size: int) -> DataProto:
    return make_ppo_batch(vocab_size, batch_size=8, response_len=6, seed=7)


def _base_log_probs(model_dir: str, actor_cfg, vocab_size: int) -> torch.Tensor:
    """The plain base model's log-probs (no LoRA, no FSDP), through the same actor code."""
    module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    plain = DataParallelPPOActor(actor_cfg, module, None, use_remove_padding=True)
    data = _batch(vocab_size)
    data.meta_info = {K.META_TEMPERATURE: 1.0, K.META_MICRO_BATCH_SIZE: MICRO_BATCH, K.META_USE_DYNAMIC_BSZ: False}
    return plain.compute_log_prob(data)[0]


def test_the_lora_reference_is_the_base_model_not_the_adapted_one(lora_worker, tiny_model_dir):
    worker = lora_worker
    assert worker.ref_module is None          # no reference weights: the actor's base is the reference
    trained = torch.Generator().manual_seed(0)
    with torch.no_grad():
        b_weights = [p for name, p in worker.actor_module.named_parameters() if ".lora_B." in name]
        assert b_weights
        for p in b_weights:
            local = p.to_local()
            local.copy_(torch.randn(local.shape, generator=trained) * 0.1)
    vocab = worker.actor_module.config.vocab_size
    ref = worker.compute_ref_log_prob(_batch(vocab)).batch[K.REF_LOG_PROB]
    policy = worker.compute_log_prob(_batch(vocab)).batch[K.OLD_LOG_PROBS]
    base = _base_log_probs(tiny_model_dir, worker.config.actor, vocab)
    # FSDP2 over one rank vs the plain module, fp32 on one CPU: ~1e-7
    torch.testing.assert_close(ref, base, rtol=1e-5, atol=1e-5)
    response_mask = _batch(vocab).batch[K.ATTENTION_MASK][:, -6:].bool()
    assert float((policy - ref).abs()[response_mask].max()) > 1e-2, "the trained adapter changes nothing"
    # The adapter is back on after the reference pass.
    again = worker.compute_log_prob(_batch(vocab)).batch[K.OLD_LOG_PROBS]
    torch.testing.assert_close(again, policy, rtol=0, atol=0)
