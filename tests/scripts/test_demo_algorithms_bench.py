"""scripts/bench/demo_algorithms.py: every row of the algorithm table is a demo the config check
accepts (a bad row would fail only after the rows before it, an hour into a run), and the table is
rendered from the rows' results and metrics logs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts.bench.demo_algorithms import ROWS, markdown, validation_curve
from scripts.demo.build import split_args
from scripts.demo.run_demo import planned_config, split_algorithm
from verl.trainer.config_check import config_errors
from verl.trainer.ppo.registry import ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY


@pytest.mark.parametrize("name", list(ROWS))
def test_every_row_is_a_demo_the_config_check_accepts(name: str) -> None:
    algorithm, rest = split_algorithm(list(ROWS[name]))
    settings, overrides = split_args(rest)
    assert config_errors(planned_config(algorithm, settings, overrides)) == []


def test_the_rows_cover_every_built_in_loss_and_every_critic_free_estimator() -> None:
    from scripts.demo.recipes import RECIPE_OVERRIDES
    from verl.trainer.ppo import core_algos  # noqa: F401  (registers the built-ins)

    args = []
    for row in ROWS.values():
        for arg in row:
            recipe = arg.removeprefix("demo.recipe=")
            args.extend(RECIPE_OVERRIDES[recipe] if recipe != arg else [arg])
    losses = {a.split("=", 1)[1] for a in args if a.startswith("actor_rollout_ref.actor.policy_loss.loss_mode=")}
    estimators = {a.split("=", 1)[1] for a in args if a.startswith("algorithm.adv_estimator=")} | {"grpo"}

    def built_in(registry: dict) -> set[str]:   # other tests may have registered their own
        return {name for name, fn in registry.items() if fn.__module__.startswith("verl.trainer.ppo.")}

    assert len(built_in(POLICY_LOSS_REGISTRY)) == 8 and len(built_in(ADV_ESTIMATOR_REGISTRY)) == 11
    assert built_in(POLICY_LOSS_REGISTRY) - {"vanilla"} <= losses, built_in(POLICY_LOSS_REGISTRY) - losses
    # gae is the PPO demo's (demo.algorithm=ppo, docs/demo.md "GRPO and PPO")
    assert built_in(ADV_ESTIMATOR_REGISTRY) - {"gae"} <= estimators, built_in(ADV_ESTIMATOR_REGISTRY) - estimators


def test_the_table_reads_the_results_and_the_validation_curve(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    records = [{"step": 0, "val/test_score/a": 0.5, "val/test_score/b": 0.0},
               {"step": 1, "critic/score/mean": 0.25},
               {"step": 4, "val/test_score/a": 0.75, "val/test_score/b": 0.5},
               {"step": 8, "critic/score/mean": 0.5, "val/test_score/a": 1.0, "val/test_score/b": 0.5}]
    metrics.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    weights = {"a": 2 / 3, "b": 1 / 3}
    assert validation_curve(metrics, weights) == [(0, pytest.approx(1 / 3)), (4, pytest.approx(2 / 3)),
                                                  (8, pytest.approx(5 / 6))]
    row = {"row": "grpo", "args": [], "returncode": 0, "val_em_before": 1 / 3, "val_em_after": 5 / 6,
           "onehop_after": 1.0, "twohop_after": 0.5, "rl_minutes": 4.2, "load_mean": 2.5,
           "searches_per_rollout_last_step": 1.25, "metrics_path": str(metrics)}
    failed = {"row": "dapo", "args": ["demo.recipe=dapo"], "returncode": 1}
    table = markdown([{**row, "val_em_after": 0.1}, row, failed], weights).splitlines()
    assert table[2] == ("| dapo | `demo.recipe=dapo` | failed (returncode 1) | | | | |")
    assert table[3] == ("| grpo | (the GRPO demo) | 0.333 → **0.833** | 0.667 (step 4) | 1.000 / 0.500 | "
                        "0.500, 1.25 | 4.2 (2.5) |")


def test_the_documented_lora_demo_command_is_the_lora_row_and_composes_with_lora_on() -> None:
    """docs/demo.md "With a LoRA adapter": its command is the bench's lora_r32 row, and the config it
    composes trains an adapter (rank, alpha, lr) on the GRPO demo's settings."""
    import re
    import shlex

    doc = (Path(__file__).resolve().parents[2] / "docs" / "demo.md").read_text()
    section = doc.split("### With a LoRA adapter", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL).group(1).replace("\\\n", " ")
    argv = shlex.split(block)
    assert argv[:3] == ["python", "-m", "scripts.demo.run_demo"] and tuple(argv[3:]) == ROWS["lora_r32"]
    algorithm, rest = split_algorithm(argv[3:])
    settings, overrides = split_args(rest)
    cfg = planned_config(algorithm, settings, overrides)
    assert config_errors(cfg) == []
    model = cfg.actor_rollout_ref.model
    assert (model.lora_rank, model.lora_alpha, cfg.actor_rollout_ref.actor.optim.lr) == (32, 64, 1e-3)
    assert (cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n_agent) == (32, 5)
