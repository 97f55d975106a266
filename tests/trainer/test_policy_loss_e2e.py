"""A policy loss of the user's own (custom_algorithms.path) through `run_ppo`: real Ray actor workers,
which import the file themselves (they are processes of their own), train one GRPO step with it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.trainer.test_main_ppo import _run

EXAMPLE = Path(__file__).resolve().parents[2] / "example" / "custom_algorithms.py"


@pytest.mark.slow   # one run_ppo step on Ray: 115 s with the Ray start on the busy 2-core machine
def test_one_grpo_step_trains_with_a_custom_policy_loss_in_the_ray_workers(
        ray_cluster, tiny_model_dir: str, tmp_path: Path) -> None:
    history, _ = _run(tiny_model_dir, tmp_path, "grpo",
                      [f"custom_algorithms.path={EXAMPLE}",
                       "actor_rollout_ref.actor.policy_loss.loss_mode=reinforce_clipped_weight"])
    (step,) = history
    assert step["step"] == 1
    # the example loss reports actor/ppo_kl only: the built-in losses' clip fractions are absent
    assert math.isfinite(step["actor/pg_loss"]) and math.isfinite(step["actor/ppo_kl"])
    assert "actor/pg_clipfrac" not in step and "actor/pg_clipfrac_lower" not in step
    assert math.isfinite(step["actor/grad_norm"]) and step["actor/grad_norm"] > 0
