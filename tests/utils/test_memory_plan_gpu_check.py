"""scripts/gpu_checks/memory_plan_vs_allocated.py on CPU (`--device cpu --tiny`): the GPU check's whole
path (plan, FSDP2 actor, log-prob pass, update) runs here, so on a lent GPU only the allocator's numbers
are new. Run once, as the documented command would, offline; its one JSON object is checked below."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from verl.trainer.main_ppo import compose_config
from verl.utils.memory_plan import plan_memory

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_checks" / "memory_plan_vs_allocated.py"
ROWS, MICRO, PROMPT, RESPONSE = 4, 2, 16, 8


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--rows", str(ROWS), "--micro", str(MICRO),
         "--prompt-length", str(PROMPT), "--response-length", str(RESPONSE)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


def test_reported_plan_is_plan_memory_of_the_composed_config(report: dict[str, Any]) -> None:
    cfg = compose_config(report["overrides"])
    plan = plan_memory(cfg, model_config=report["model"]["config"])
    first = plan_memory(cfg, model_config=report["model"]["config"], first_update=True)
    assert report["plan_phases"] == [p.name for p in plan.phases]
    # the update measured twice: the first against the first-update plan, the second against the steady state
    assert set(report["phases"]) == {"actor_update_first", "actor_update", "actor_log_prob"}
    planned = {p.name: p for p in plan.phases}
    planned["actor_update_first"] = next(p for p in first.phases if p.name == "actor_update")
    for name, got in report["phases"].items():
        phase = planned[name]
        assert got["plan_certain"] == phase.certain and got["plan_estimated"] == phase.estimated
        assert got["plan_bytes"] == phase.total == got["plan_certain_bytes"] + got["plan_estimated_bytes"]
        assert got["plan_moments_bytes"] == {k: m.total for k, m in phase.moments.items()}
        assert got["plan_binding"] == (phase.binding or None)
    update, first_update = report["phases"]["actor_update"], report["phases"]["actor_update_first"]
    assert set(update["plan_moments_bytes"]) == {"backward", "optimizer step"}
    # the first backward holds no AdamW state; the step is the same
    held = report["held_bytes"]["actor AdamW state (shard)"]
    assert update["plan_moments_bytes"]["backward"] - first_update["plan_moments_bytes"]["backward"] == held
    assert update["plan_moments_bytes"]["optimizer step"] == first_update["plan_moments_bytes"]["optimizer step"]
    assert report["shape"]["sequence_length"] == PROMPT + RESPONSE
    vocab = report["model"]["config"]["vocab_size"]
    # the fused head runs on the response positions only: MICRO x RESPONSE of them, one chunk here
    head = report["phases"]["actor_log_prob"]["plan_certain"]
    assert head[f"log-prob head chunk ({MICRO * RESPONSE} rows x vocab)"] == 2 * 4 * MICRO * RESPONSE * vocab
    assert head["log-prob head per response token"] == 16 * MICRO * RESPONSE


def test_plan_parameter_and_adamw_bytes_equal_what_the_built_actor_holds(report: dict[str, Any]) -> None:
    model = report["model"]
    assert model["parameters"] == model["plan_parameters"] > 0
    assert model["parameter_tensors"] == model["plan_parameter_tensors"]
    plan_update = report["phases"]["actor_update"]["plan_certain"]
    held = report["held_bytes"]
    assert held["actor params (fp32 shard)"] == plan_update["actor params (fp32 shard)"] == 4 * model["parameters"]
    assert held["actor AdamW state (shard)"] == plan_update["actor AdamW state (shard)"]


def test_log_prob_pass_scores_every_response_token_near_uniform(report: dict[str, Any]) -> None:
    log_prob = report["log_prob"]
    assert log_prob["shape"] == [ROWS, RESPONSE] and log_prob["finite"]
    # Random init (std 0.02): logits near 0, so each token's log-prob is close to -log(vocab).
    assert abs(log_prob["mean"] + math.log(report["model"]["config"]["vocab_size"])) < 0.5


def test_actor_update_takes_one_step_that_changes_the_parameters(report: dict[str, Any]) -> None:
    update = report["update"]
    assert len(update["pg_loss"]) == ROWS // MICRO and all(math.isfinite(x) for x in update["pg_loss"])
    assert len(update["grad_norm"]) == 1 and update["grad_norm"][0] > 0 and update["grad_nonfinite"] == [0.0]
    assert update["response_tokens"] == ROWS * RESPONSE
    assert update["parameter_tensors_changed"] > update["parameter_tensors"] // 2
    second = report["second_update"]
    assert len(second["grad_norm"]) == 1 and second["grad_norm"][0] > 0 and second["grad_nonfinite"] == [0.0]


def test_measured_values_are_null_on_cpu(report: dict[str, Any]) -> None:
    assert report["device"] == "cpu"
    for phase in report["phases"].values():
        assert phase["measured_peak_bytes"] is None and phase["measured_over_plan"] is None
        assert phase["plan_bytes"] > 0
