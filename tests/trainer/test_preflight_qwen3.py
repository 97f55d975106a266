"""Preflight verdicts for the Qwen3 launchers (example/qwen3/), from the shipped config.json files: the
launcher's exact overrides (recorded with a stand-in python3, tests/multinode/_launch_record.py), then
the real preflight in this process. Qwen3-8B (and 4B) on one node, Qwen3-32B with LoRA on one node and in
full on 4 nodes, Qwen3-30B-A3B (MoE) in full and with LoRA on one node of 8 x 80 GB GPUs: each fits, and
the phase that binds is the one named here."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multinode._launch_record import run_recorded
from tests.trainer._preflight_data import write_data
from verl.trainer.main_ppo import compose_config
from verl.trainer.preflight import run_preflight

CONFIGS = Path(__file__).resolve().parents[2] / "example" / "model_configs"


def _verdict(tmp_path: Path, script: str, model: str, *extra: str, env: dict[str, str] | None = None):
    run = run_recorded(script, tmp_path, {"BASE_MODEL": str(CONFIGS / model), **(env or {})}, ())
    assert run.returncode == 0 and run.overrides, run.output
    data = write_data(tmp_path / "data")
    cfg = compose_config([*run.overrides, *data, "do_search=false", "trainer.gpu_memory_gib=80", *extra])
    report = run_preflight(cfg)
    report.cfg = cfg   # for a test that reads the plan's itemised phases
    return report


@pytest.mark.parametrize(("script", "model", "env", "binding"), [
    ("example/qwen3/train_grpo_qwen3_8b.sh", "qwen3-8b", {}, "rollout"),
    ("example/qwen3/train_grpo_qwen3_8b.sh", "qwen3-4b", {}, "rollout"),
    ("example/qwen3/train_grpo_qwen3_32b_lora.sh", "qwen3-32b", {}, "rollout"),
    ("example/qwen3/train_grpo_qwen3_32b.sh", "qwen3-32b", {"RAY_ADDRESS": "auto"}, "rollout"),
    # full fine-tuning of the MoE on one node: all 30.5 B parameters' fp32 weights, gradients and AdamW
    # state (sharded over 8) at the optimizer step bind, not the rollout
    ("example/qwen3/train_grpo_qwen3_30b_a3b.sh", "qwen3-30b-a3b", {}, "actor_update"),
    ("example/qwen3/train_grpo_qwen3_30b_a3b_lora.sh", "qwen3-30b-a3b", {}, "rollout"),
])
def test_the_qwen3_launchers_fit_80gb_gpus_and_name_the_phase_that_binds(
        tmp_path: Path, script: str, model: str, env: dict[str, str], binding: str) -> None:
    report = _verdict(tmp_path, script, model, env=env)
    assert report.passed and report.fits is True, report.render()
    assert report.largest_phase == binding, report.render()
    text = report.render()
    if model == "qwen3-30b-a3b":
        from omegaconf import OmegaConf

        from verl.utils.memory_plan import GIB, plan_memory

        assert "30.53 B params, 3.35 B active" in text and "MoE: 30.53 B parameters, 3.35 B active" in text
        # the expert weights in the per-phase tables: FSDP2 gathers a layer with all its experts (bf16)
        cfg = OmegaConf.to_container(report.cfg, resolve=True)
        plan = plan_memory(OmegaConf.create(cfg), device_gib=79.1)
        log_prob = next(p for p in plan.phases if p.name == "actor_log_prob").certain
        assert round(log_prob["gathered layer (bf16, all 128 experts)"] / GIB, 2) >= 1.16   # 623 M params + LoRA


def test_the_moe_full_fine_tune_binds_at_its_optimizer_step_and_stops_fitting_with_less_memory(tmp_path: Path) -> None:
    report = _verdict(tmp_path, "example/qwen3/train_grpo_qwen3_30b_a3b.sh", "qwen3-30b-a3b")
    update = report.to_json()["memory_plan_gib"]["actor_update"]
    assert 60 < update < 79.1 - 2.6, update       # fits an 80 GB card with the reserve, with a few GiB spare
    assert "at its optimizer step" in report.render()
    smaller = _verdict(tmp_path / "b", "example/qwen3/train_grpo_qwen3_30b_a3b.sh", "qwen3-30b-a3b",
                       "trainer.gpu_memory_gib=64")
    assert smaller.fits is False and "actor_update" in smaller.render()


def test_lora_on_the_moes_experts_is_refused_naming_target_modules(tmp_path: Path) -> None:
    report = _verdict(tmp_path, "example/qwen3/train_grpo_qwen3_30b_a3b_lora.sh", "qwen3-30b-a3b",
                      "actor_rollout_ref.model.target_modules=all-linear")
    assert not report.passed, report.render()
    assert "actor_rollout_ref.model.target_modules" in [e["key"] for e in report.errors], report.render()
    assert "routed experts" in report.render()
