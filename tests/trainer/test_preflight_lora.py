"""Preflight counts LoRA (verl/utils/memory_plan_lora.py): the frozen base in bf16, the adapter in fp32
with its grads and AdamW state, no reference weights; the example/lora launchers fit 80 GB GPUs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer.test_preflight import CONFIGS, _launch
from verl.trainer.main_ppo import compose_config
from verl.utils.memory_plan import (
    BF16,
    FP32,
    GIB,
    ModelShape,
    adamw_state_bytes,
    plan_memory,
    read_model_config,
)
from verl.utils.memory_plan_lora import lora_counts

QWEN_7B = str(CONFIGS / "qwen2.5-7b")
ONE_GPU = ["trainer.n_gpus_per_node=1", "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
           "actor_rollout_ref.actor.ppo_micro_batch_size=2", "actor_rollout_ref.rollout.log_prob_micro_batch_size=2",
           "actor_rollout_ref.ref.log_prob_micro_batch_size=2", "algorithm.adv_estimator=grpo",
           "actor_rollout_ref.actor.use_kl_loss=true", "trainer.logger=[console]", "do_search=false",
           f"actor_rollout_ref.model.path={QWEN_7B}"]


def test_lora_counts_the_adapter_of_qwen_7b_exactly() -> None:
    config, _ = read_model_config(QWEN_7B)
    shape = ModelShape.from_config(config)
    counts = lora_counts(shape, {"lora_rank": 64, "target_modules": "all-linear"})
    h, i, kv, layers = 3584, 18944, 512, 28   # Qwen2.5-7B: 28 heads of 128, 4 KV heads
    assert (shape.hidden_size, shape.intermediate_size, shape.num_hidden_layers) == (h, i, layers)
    per_layer = 64 * ((h + h) + 2 * (h + kv) + (h + h) + 2 * (h + i) + (i + h))
    assert counts.per_layer == per_layer and counts.params == layers * per_layer and counts.tensors == layers * 14
    only_qv = lora_counts(shape, {"lora_rank": 8, "target_modules": ["q_proj", "v_proj"]})
    assert only_qv.params == layers * 8 * ((h + h) + (h + kv))
    assert lora_counts(shape, {"lora_rank": 0}) is None
    without_mlp = lora_counts(shape, {"lora_rank": 64, "exclude_modules": ["gate_proj", "up_proj", "down_proj"]})
    assert without_mlp.params == layers * 64 * ((h + h) + 2 * (h + kv) + (h + h))


def test_the_plan_holds_a_bf16_base_the_adapters_state_and_no_reference(tmp_path: Path) -> None:
    full = plan_memory(compose_config(ONE_GPU))
    lora = plan_memory(compose_config([*ONE_GPU, "actor_rollout_ref.model.lora_rank=64"]))
    p = full.actor_params
    adapter = lora.lora_params
    assert adapter > 0 and lora.actor_params == p
    update = {ph.name: ph for ph in lora.phases}["actor_update"]
    items = {**update.certain}
    assert items["actor params (fp32 shard)"] == BF16 * p + FP32 * adapter
    assert items["actor grads (fp32 shard)"] == FP32 * adapter
    assert items.get("actor AdamW state (shard)", adamw_state_bytes(adapter, lora.lora_tensors)) == \
        adamw_state_bytes(adapter, lora.lora_tensors)
    assert not any(k.startswith("reference params") for ph in lora.phases for k in ph.certain)
    assert any(k.startswith("reference params") for ph in full.phases for k in ph.certain)
    assert items["reduce-scatter staging (bf16 + fp32)"] == (BF16 + FP32) * adapter // 28   # one layer's adapter
    assert "log-prob head lm_head grad" not in items   # the frozen head has no gradient
    # The same activations; the certain bytes: fp32 weights, grads, AdamW, a bf16 reference (> 135 GB) vs
    # the bf16 base and the adapter's state (< 25 GB).
    full_update = {ph.name: ph for ph in full.phases}["actor_update"]
    assert update.estimated == full_update.estimated
    assert sum(full_update.certain.values()) / GIB > 135 and sum(update.certain.values()) / GIB < 25
    assert any("LoRA rank 64" in note for note in lora.notes)
    # a checkpoint: the adapter, its AdamW state, and the export (the adapter again); the base is model.path's
    assert lora.checkpoint_bytes(True) == 2 * FP32 * adapter + adamw_state_bytes(adapter, lora.lora_tensors)


@pytest.mark.parametrize(("script", "model", "gpus"), [
    ("example/lora/train_grpo_lora_7b.sh", "qwen2.5-7b-instruct", 1),
    ("example/lora/train_grpo_lora_32b.sh", "qwen2.5-32b", 8),
    ("example/lora/train_grpo_lora_72b.sh", "qwen2.5-72b", 8),
])
def test_the_lora_launchers_fit_80gb_gpus(tmp_path: Path, script: str, model: str, gpus: int) -> None:
    proc, report, _ = _launch(tmp_path, script, model, "do_search=false")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report["ok"] is True and report["fits"] is True, report
    plan = report["memory_plan_gib"]
    print(script, report["largest_phase"], plan)
    assert plan[report["largest_phase"]] <= 80 and "reference_log_prob" in plan
    assert f"x trainer.n_gpus_per_node={gpus} = {gpus};" in proc.stdout + proc.stderr
