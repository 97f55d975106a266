"""verl/utils/host_memory_plan.py: the per-node host plan counts what each phase holds on the node of
global rank 0 (the loader's one tensor, offloaded shards of the node's ranks, the checkpoint staging),
and the HF export really stages no more than its file bound plus one tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from verl.trainer.main_ppo import compose_config
from verl.utils.host_memory_plan import (
    VLLM_RUNTIME_POOLS_ESTIMATE,
    _models,
    hf_max_shard_bytes,
    host_fit,
    meta_loader_init,
    old_loader_init,
    plan_host_memory,
    stored_bytes,
)
from verl.utils.memory_plan import GIB, ModelShape, adamw_state_bytes, plan_memory, read_model_config

REPO = Path(__file__).resolve().parents[2]
QWEN_7B = str(REPO / "example" / "model_configs" / "qwen2.5-7b")
# 2 nodes x 8 GPUs, PPO with everything offloaded
OFFLOADED = ["trainer.nnodes=2", "trainer.n_gpus_per_node=8", "data.train_batch_size=256",
             "actor_rollout_ref.actor.ppo_mini_batch_size=128", "actor_rollout_ref.actor.ppo_micro_batch_size=16",
             "critic.ppo_micro_batch_size=16", "do_search=false", f"actor_rollout_ref.model.path={QWEN_7B}",
             f"critic.model.path={QWEN_7B}", "algorithm.adv_estimator=gae",
             *(f"{m}.fsdp_config.{k}_offload=true" for m in ("actor_rollout_ref.actor", "critic.model")
               for k in ("param", "grad", "optimizer")),
             "actor_rollout_ref.ref.fsdp_config.param_offload=true"]


def _cfg(*overrides: str):
    cfg = compose_config(list(overrides))
    OmegaConf.resolve(cfg)
    return cfg


def _shape() -> ModelShape:
    return ModelShape.from_config(read_model_config(QWEN_7B)[0])


def test_the_reference_is_offloaded_in_the_dtype_it_is_built_in() -> None:
    """bf16 on GPU workers (half an fp32 copy: 7B over 16 ranks, 8 of them on the node), fp32 on CPU workers."""
    cfg = _cfg(*OFFLOADED)
    p, _ = _shape().causal_lm()
    gpu = {m.name: m.param_bytes for m in _models(cfg, None, None)}
    cpu = {m.name: m.param_bytes for m in _models(cfg, None, None, cpu_workers=True)}
    assert gpu == {"actor": 4, "reference": 2, "critic": 4} and cpu == {"actor": 4, "reference": 4, "critic": 4}
    training = {ph.name: ph for ph in plan_host_memory(cfg).phases}["training"].certain
    assert training["reference params offloaded (bf16 shard x 8 ranks)"] * 2 == \
        training["actor params offloaded (fp32 shard x 8 ranks)"] == 8 * -(-4 * p // 16)


def test_offloaded_shards_of_the_nodes_ranks_are_its_host_memory_and_gradients_never_are() -> None:
    plan = plan_host_memory(_cfg(*OFFLOADED))
    phases = {p.name: p for p in plan.phases}
    assert (plan.train_ranks, plan.rollout_ranks) == (8, 0)
    p, t = _shape().causal_lm()
    cp, ct = _shape().value_model()
    shard = -(-4 * p // 16)                                   # fp32 over the 16 ranks of 2 nodes
    training = phases["training"].certain
    assert training["actor params offloaded (fp32 shard x 8 ranks)"] == 8 * shard
    # the reference is built in bf16 on GPU workers (verl/utils/model.py frozen_weight_dtype): half the actor's
    assert training["reference params offloaded (bf16 shard x 8 ranks)"] == 8 * -(-2 * p // 16)
    assert training["actor AdamW state offloaded (shard x 8 ranks)"] == 8 * -(-adamw_state_bytes(p, t) // 16)
    assert training["critic AdamW state offloaded (shard x 8 ranks)"] == 8 * -(-adamw_state_bytes(cp, ct) // 16)
    # grad_offload=true moves nothing: every step ends with zero_grad(set_to_none=True)
    assert not any("grad" in k for k in training)
    # the vLLM engine of each rank sleeps at level 2: its buffers only (rotary table 131072 x 128 bf16, scales)
    sleep = next(v for k, v in training.items() if k.startswith("vLLM level-2 sleep"))
    assert sleep == 8 * (2 * 131072 * 128 + 4 * 4 * 28)
    # at init AdamW has no state yet; no offload at all: nothing but the loader's buffers
    assert not any("AdamW" in k for k in phases["model_init"].certain)
    bare = {p.name: p for p in plan_host_memory(_cfg(*OFFLOADED[:10])).phases}["training"]
    # and vLLM's runtime + cudagraph pools, backed up at every sleep level: a stated estimate
    assert list(bare.estimated.values()) == [8 * VLLM_RUNTIME_POOLS_ESTIMATE["cuda graphs"]]
    assert bare.total == sleep + 8 * VLLM_RUNTIME_POOLS_ESTIMATE["cuda graphs"]


def test_rank_0_reads_one_tensor_at_a_time_and_no_rank_holds_the_model() -> None:
    shape = _shape()
    init = {p.name: p for p in plan_host_memory(_cfg(*OFFLOADED[:10])).phases}["model_init"].certain
    embeddings = shape.vocab_size * shape.hidden_size          # the largest tensor of Qwen2.5-7B
    # the other ranks receive on their GPUs (NCCL): the node's host holds rank 0's read only
    assert init == {"rank 0: one tensor read (as stored, 2 B, mapped file pages)": 2 * embeddings}
    models = _models(_cfg(*OFFLOADED[:10]), None, None)
    on_cpu = meta_loader_init(models, 8, 8, cpu_workers=True).certain
    assert on_cpu["other ranks: one full broadcast buffer (as stored) x 7"] == 7 * 2 * embeddings
    # what the project did before: every rank from_pretrained(dtype=float32) on the host
    old = old_loader_init(_cfg(*OFFLOADED[:10]))
    assert old.total == 8 * 4 * shape.causal_lm()[0]
    assert sum(init.values()) < 4 * shape.causal_lm()[0]      # the whole node's buffers: less than one fp32 copy
    assert stored_bytes({"torch_dtype": "bfloat16"}) == 2 and stored_bytes({}) == 4


def test_checkpoint_save_stages_the_dcp_shards_and_rank_0s_hf_export_file() -> None:
    shape = _shape()
    phase = {p.name: p for p in plan_host_memory(_cfg(*OFFLOADED)).phases}["checkpoint_save"]
    # the actor's save, then the critic's: the phase is the larger (the critic's, beside the actor's
    # offloaded state and untied lm_head); each saver is onloaded (its host copy freed), the others stay offloaded
    assert set(phase.moments) == {"actor save", "critic save"} and phase.binding == "critic save"
    save = phase.moments["actor save"].certain
    assert not any(k.startswith("actor ") and "offloaded" in k for k in save)
    assert "critic AdamW state offloaded (shard x 8 ranks)" in save
    assert not any(k.startswith("critic ") and "offloaded" in k for k in phase.moments["critic save"].certain)
    assert save["actor DCP write staging (2 tensors of a shard x 8 ranks)"] == 8 * 2 * -(-4 * shape.vocab_size
                                                                                       * shape.hidden_size // 16)
    assert hf_max_shard_bytes() == 1024 * 2 ** 20
    import inspect

    from verl.utils.checkpoint import FSDPCheckpointManager

    # the bound the checkpoint manager exports with
    assert inspect.signature(FSDPCheckpointManager.__init__).parameters["hf_max_shard_mb"].default * 2 ** 20 \
        == hf_max_shard_bytes()
    export = "rank 0: HF export file staged (hf_max_shard_mb + one tensor)"
    assert save[export] == 1024 * 2 ** 20 + 2 * shape.vocab_size * shape.hidden_size
    no_export = plan_host_memory(_cfg(*OFFLOADED, "trainer.save_hf_model=false"))
    assert all(export not in m.certain for p in no_export.phases for m in (p, *p.moments.values()))


def test_the_hf_export_stages_at_most_its_file_bound_plus_one_tensor(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from verl.utils.checkpoint import hf_export

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2))
    staged: list[int] = []
    flush = hf_export._ShardWriter.flush

    def recording_flush(writer) -> None:
        staged.append(writer.pending_bytes)
        flush(writer)

    monkeypatch.setattr(hf_export._ShardWriter, "flush", recording_flush)
    bound_mb = 0.1
    hf_export.export_hf_model(model, None, str(tmp_path), dtype=torch.bfloat16, max_shard_mb=bound_mb)
    largest = 2 * 512 * 64                                           # the embeddings in bf16
    assert len(staged) > 2 and max(staged) <= bound_mb * 2 ** 20 + largest
    assert json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]


def test_a_pipelined_rollout_pool_holds_no_policy_copy_on_the_host() -> None:
    plan = plan_host_memory(_cfg(*OFFLOADED[2:10], "trainer.n_gpus_per_node=8", "trainer.pipeline=one_step_off",
                                 "trainer.rollout_pool=2", "algorithm.adv_estimator=grpo", "data.train_batch_size=12",
                                 "actor_rollout_ref.actor.ppo_mini_batch_size=12",
                                 "actor_rollout_ref.actor.ppo_micro_batch_size=6",
                                 "actor_rollout_ref.actor.fsdp_config.param_offload=true"))
    assert (plan.train_ranks, plan.rollout_ranks) == (6, 2)
    training = {p.name: p for p in plan.phases}["training"].certain
    p, _ = _shape().causal_lm()
    assert training["actor params offloaded (fp32 shard x 6 ranks)"] == 6 * -(-4 * p // 6)
    # the engines run on the 2 rollout ranks only, with no FSDP copy of the policy
    assert [k for k in training if "vLLM" in k] == ["vLLM level-2 sleep: its buffers backed up (rotary table, scales) "
                                                    "x 2 ranks"]


def test_cpu_workers_hold_their_training_state_on_the_host() -> None:
    cfg = _cfg(*OFFLOADED[2:10], "trainer.n_gpus_per_node=2", "trainer.device=cpu")
    device = plan_memory(cfg)
    plan = plan_host_memory(cfg, cpu_workers=True, device_plan=device)
    per_rank = max(p.total for p in device.phases)
    for phase in plan.phases:
        assert phase.certain[f"CPU workers: each rank's {device.largest()[0]} x 2 ranks"] == 2 * per_rank
    with pytest.raises(ValueError, match="needs the device plan"):
        plan_host_memory(cfg, cpu_workers=True)


def test_the_verdict_names_the_phase_and_the_key() -> None:
    phases = plan_host_memory(_cfg(*OFFLOADED)).phases
    need = max(p.total for p in phases) / GIB
    assert host_fit(phases, None)[0] is None and "set trainer.host_memory_gib" in host_fit(phases, None)[1]
    assert host_fit(phases, need + 1)[0] is True
    fits, message = host_fit(phases, need - 1)
    assert fits is False and "phase training needs" in message and "trainer.host_memory_gib=" in message
