"""Preflight keeps room beyond the plan (issue 43 item 5): `trainer.gpu_memory_reserve_gib` for what the
plan does not count (the allocator's slack, the CUDA context, NCCL and cuBLAS workspaces), measured on an
H200, and an "80 GB" card read as the GiB it exposes. A plan that fits to the last GiB is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from verl.trainer.main_ppo import compose_config
from verl.trainer.preflight_memory import check_memory_and_disk
from verl.trainer.preflight_report import PreflightReport
from verl.utils.memory_plan import (
    ALLOCATOR_SLACK_GIB,
    DEFAULT_GPU_RESERVE_GIB,
    EXPOSED_GIB,
    GIB,
    OUTSIDE_ALLOCATOR_GIB,
    RESERVE_KEY,
    plan_memory,
)

REPO = Path(__file__).resolve().parents[2]
MEASUREMENTS = REPO / "tests" / "utils" / "gpu_measurements"
QWEN_7B = str(REPO / "example" / "model_configs" / "qwen2.5-7b")
# 7B GRPO on 8 GPUs with a small vLLM pool: the actor's update is the largest phase at any GPU size here
RUN = ["trainer.n_gpus_per_node=8", "data.train_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=32",
       "actor_rollout_ref.actor.ppo_micro_batch_size=8", "algorithm.adv_estimator=grpo", "do_search=false",
       f"actor_rollout_ref.model.path={QWEN_7B}", "actor_rollout_ref.rollout.gpu_memory_utilization=0.05",
       "trainer.save_freq=-1", "trainer.logger=[console]"]


def _check(tmp_path: Path, *overrides: str) -> PreflightReport:
    cfg = compose_config([*RUN, f"trainer.default_local_dir={tmp_path}", *overrides])
    OmegaConf.resolve(cfg)
    report = PreflightReport()
    check_memory_and_disk(cfg, report)
    return report


def _update_gib() -> float:
    cfg = compose_config(RUN)
    OmegaConf.resolve(cfg)
    plan = plan_memory(cfg, device_gib=200)
    phase = max(plan.phases, key=lambda p: p.total)
    assert phase.name == "actor_update"
    return phase.total / GIB


def test_the_default_reserve_covers_the_measured_allocator_slack_and_the_memory_outside_it() -> None:
    slack = 0.0
    for path in sorted(MEASUREMENTS.glob("memory_plan_*_h200.json")):
        for phase in json.loads(path.read_text())["phases"].values():
            slack = max(slack, (phase["peak_reserved_bytes"] - phase["measured_peak_bytes"]) / GIB)
    assert slack > 1.0                                            # the files hold the figure we quote
    assert ALLOCATOR_SLACK_GIB == pytest.approx(slack, abs=0.01)
    assert DEFAULT_GPU_RESERVE_GIB >= ALLOCATOR_SLACK_GIB + OUTSIDE_ALLOCATOR_GIB
    yaml_default = compose_config([]).trainer.gpu_memory_reserve_gib
    assert yaml_default == DEFAULT_GPU_RESERVE_GIB


def test_a_plan_that_fits_with_nothing_to_spare_is_refused_naming_the_reserve(tmp_path: Path) -> None:
    exact = _update_gib()                   # the GPU exactly as large as the largest phase
    report = _check(tmp_path, f"trainer.gpu_memory_gib={exact!r}")
    assert report.fits is False and not report.passed, report.fit_message
    assert RESERVE_KEY in report.fit_message and f"+ reserve {DEFAULT_GPU_RESERVE_GIB:g} GiB" in report.fit_message
    assert report.gpu_reserve_gib == DEFAULT_GPU_RESERVE_GIB
    # the reserve's worth more: fits; a reserve of 0 restores the bare comparison
    assert _check(tmp_path, f"trainer.gpu_memory_gib={exact + DEFAULT_GPU_RESERVE_GIB + 0.01!r}").fits is True
    assert _check(tmp_path, f"trainer.gpu_memory_gib={exact!r}", f"{RESERVE_KEY}=0").fits is True


def test_an_80_gb_card_is_read_as_the_gib_it_exposes(tmp_path: Path) -> None:
    report = _check(tmp_path, "trainer.gpu_memory_gib=80")
    assert EXPOSED_GIB[80] < 80
    assert f"<= {EXPOSED_GIB[80]:.1f} GiB" in report.fit_message or f"> {EXPOSED_GIB[80]:.1f} GiB" in report.fit_message
    assert "an '80 GB' card exposes 79.1 GiB" in report.fit_message
    # another size is taken as given
    assert "<= 96.0 GiB (trainer.gpu_memory_gib)" in _check(tmp_path, "trainer.gpu_memory_gib=96").fit_message


@pytest.mark.parametrize("value", ["-1", "lots", "true"])
def test_a_bad_reserve_is_an_error_naming_the_key(tmp_path: Path, value: str) -> None:
    report = _check(tmp_path, "trainer.gpu_memory_gib=96", f"{RESERVE_KEY}={value}")
    assert [e["key"] for e in report.errors] == [RESERVE_KEY] and not report.passed
