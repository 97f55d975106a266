"""scripts/gpu_checks/memory_plan_vs_allocated.py's LoRA path on CPU (`--device cpu --tiny --lora-rank 8`):
the actor built as the worker builds it with PEFT's adapters, the update, the log-prob pass and the
reference pass (the actor with its adapter off) run here, so on a lent GPU only the allocator's numbers
are new. Also what --compose-only selects and what the check refuses (no model built)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from scripts.gpu_checks import memory_plan_vs_allocated as check
from verl.trainer.main_ppo import compose_config
from verl.utils.memory_plan import plan_memory

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_checks" / "memory_plan_vs_allocated.py"
ROWS, MICRO, PROMPT, RESPONSE, RANK = 4, 2, 16, 8, 8
TINY = ["--device", "cpu", "--tiny", "--rows", str(ROWS), "--micro", str(MICRO), "--prompt-length", str(PROMPT),
        "--response-length", str(RESPONSE)]


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--lora-rank", str(RANK)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


def test_lora_phases_are_the_plan_of_the_composed_config_with_the_reference_pass(report: dict[str, Any]) -> None:
    assert f"actor_rollout_ref.model.lora_rank={RANK}" in report["overrides"]
    assert f"actor_rollout_ref.model.lora_alpha={2 * RANK}" in report["overrides"]
    cfg = compose_config(report["overrides"])
    plan = plan_memory(cfg, model_config=report["model"]["config"])
    first = plan_memory(cfg, model_config=report["model"]["config"], first_update=True)
    assert set(report["phases"]) == {"actor_update_first", "actor_update", "actor_log_prob", "reference_log_prob"}
    planned = {p.name: p for p in plan.phases}
    planned["actor_update_first"] = next(p for p in first.phases if p.name == "actor_update")
    for name, got in report["phases"].items():
        phase = planned[name]
        assert got["plan_certain"] == phase.certain and got["plan_estimated"] == phase.estimated
        assert got["plan_bytes"] == phase.total == got["plan_certain_bytes"] + got["plan_estimated_bytes"]
    # no reference weights: the reference pass holds the actor's (base + adapter) and nothing else's
    ref = report["phases"]["reference_log_prob"]["plan_certain"]
    assert not any(k.startswith("reference") for k in ref)
    assert ref["actor params (fp32 shard)"] == report["phases"]["actor_update"]["plan_certain"]["actor params (fp32 shard)"]
    assert any(note.startswith(f"LoRA rank {RANK}:") for note in report["plan_notes"])


def test_built_adapter_and_its_adamw_state_are_what_the_plan_counts(report: dict[str, Any]) -> None:
    lora, model, held = report["lora"], report["model"], report["held_bytes"]
    assert (lora["rank"], lora["alpha"]) == (RANK, 2 * RANK)
    assert lora["parameters"] == lora["plan_parameters"] > 0
    assert lora["parameter_tensors"] == lora["plan_parameter_tensors"] == 7 * 2 * model["config"]["num_hidden_layers"]
    assert lora["trainable_only_adapter"] and lora["adapter_dtypes"] == ["torch.float32"]
    # the base model's parameters, the adapter counted apart
    assert model["parameters"] == model["plan_parameters"] > 0
    assert held["actor adapter params (shard)"] == 4 * lora["parameters"]
    update = report["phases"]["actor_update"]["plan_certain"]
    assert held["actor AdamW state (shard)"] == update["actor AdamW state (shard)"]   # the adapter's alone
    assert update["actor grads (fp32 shard)"] == 4 * lora["parameters"]
    # The plan keeps the frozen base in bf16 (as the worker does on CUDA); on CPU it stays fp32: 2 bytes more each.
    assert lora["frozen_dtypes"] == ["torch.float32"]
    assert held["actor frozen base params (shard)"] == 4 * model["parameters"]
    assert held["actor params (fp32 shard)"] - update["actor params (fp32 shard)"] == 2 * model["parameters"]


def test_updates_train_the_adapter_alone_and_the_reference_pass_turns_it_off(report: dict[str, Any]) -> None:
    update = report["update"]
    assert update["grad_nonfinite"] == [0.0] and update["grad_norm"][0] > 0
    assert update["frozen_tensors_changed"] == 0
    assert 0 < update["parameter_tensors_changed"] <= report["lora"]["parameter_tensors"]
    ref, log_prob = report["reference_log_prob"], report["log_prob"]
    assert ref["shape"] == log_prob["shape"] == [ROWS, RESPONSE] and ref["finite"]
    # two updates moved lora_B off zero: the adapter-on and adapter-off log-probs differ
    assert ref["max_abs_diff_from_actor"] > 1e-7
    for phase in report["phases"].values():
        assert phase["measured_peak_bytes"] is None and phase["plan_bytes"] > 0


def _compose(*argv: str) -> dict[str, Any]:
    return check.main([*TINY, "--compose-only", *argv])


def test_compose_only_measures_the_reference_pass_with_lora_only(capsys: pytest.CaptureFixture[str]) -> None:
    full = _compose()
    assert full["measured_phases"] == ["actor_update_first", "actor_update", "actor_log_prob"]
    assert full["lora_params"] == 0
    lora = _compose("--lora-rank", str(RANK))
    assert lora["measured_phases"] == ["actor_update_first", "actor_update", "actor_log_prob", "reference_log_prob"]
    shape = check.TINY   # PEFT's all-linear: q, o (h -> h), k, v (h -> kv), gate, up, down (h <-> i)
    kv = shape["num_key_value_heads"] * shape["hidden_size"] // shape["num_attention_heads"]
    h, i = shape["hidden_size"], shape["intermediate_size"]
    per_layer = RANK * (2 * (h + h) + 2 * (h + kv) + 3 * (h + i))
    assert lora["lora_params"] == per_layer * shape["num_hidden_layers"]
    # lora_rank given as an override (use_kl_loss left off): LoRA planned, no reference pass
    override = _compose(f"actor_rollout_ref.model.lora_rank={RANK}")
    assert override["lora_params"] == lora["lora_params"]
    assert override["measured_phases"] == full["measured_phases"]
    # each call printed its report, one JSON object
    printed = capsys.readouterr().out
    assert json.loads(printed[printed.rindex("\n{") + 1:]) == override


@pytest.mark.parametrize(("argv", "message"), [
    (["--lora-rank", "0"], "--lora-rank must be > 0"),
    (["--lora-rank", "8", "actor_rollout_ref.model.lora_rank=4"], "both set actor_rollout_ref.model.lora_rank"),
])
def test_lora_flag_refusals_name_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        _compose(*argv)


@pytest.mark.parametrize(("argv", "counted"), [
    # the full-parameter actor with a KL loss needs reference weights: not built here
    (["actor_rollout_ref.actor.use_kl_loss=true"], "reference params"),
    # LoRA does not remove the critic of GAE
    (["--lora-rank", "8", "algorithm.adv_estimator=gae"], "critic"),
])
def test_a_phase_counting_another_models_weights_is_refused(argv: list[str], counted: str) -> None:
    with pytest.raises(ValueError, match=f"counts .*{counted}.*builds the actor alone"):
        _compose(*argv)
