"""The recipes under example/recipes/ (DAPO, GSPO, Dr. GRPO on Search-R1 data, 8 GPUs) pass preflight
with the shipped Qwen2.5 model configs, through the real launch scripts; the DAPO one's keys reach the config."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer.test_preflight import _launch

# The recipes use h1's actor keys (clip_ratio_low/high, policy_loss.loss_mode, seq-mean-token-sum-norm).
RECIPES = {
    "dapo": ("example/recipes/dapo/train_dapo.sh",),
    "gspo": ("example/recipes/gspo/train_gspo.sh",),
    "drgrpo": ("example/recipes/drgrpo/train_drgrpo.sh",),
}


@pytest.mark.parametrize("model", ["qwen2.5-3b", "qwen2.5-7b"])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_the_recipes_pass_preflight_on_8_gpus(tmp_path: Path, recipe: str, model: str) -> None:
    (script,) = RECIPES[recipe]
    proc, report, _ = _launch(tmp_path, script, model, "do_search=false", env={"N_GPUS": "8"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report["ok"] is True and report["fits"] is True and report["world_size"] == 8, report
    assert report["memory_plan_gib"][report["largest_phase"]] <= 80


def _recipe_overrides(script: str) -> list[str]:
    """The Hydra overrides a recipe passes to train_grpo.sh (its `key=value \\` lines)."""
    text = (Path(__file__).resolve().parents[2] / script).read_text()
    return [line.strip().rstrip("\\").strip() for line in text.splitlines()
            if line.startswith("    ") and "=" in line and line.rstrip().endswith("\\")]


def test_the_dapo_recipe_turns_on_dynamic_sampling_and_overlong_shaping() -> None:
    from verl.trainer.main_ppo import compose_config
    from verl.trainer.ppo.dynamic_sampling import FilterGroups
    from verl.trainer.ppo.reward_shaping import OverlongBuffer

    overrides = [o for o in _recipe_overrides(RECIPES["dapo"][0]) if "clip_ratio_" not in o]   # h1's keys
    cfg = compose_config(overrides)
    assert FilterGroups.from_config(cfg) == FilterGroups(enable=True, metric="acc", max_num_gen_batches=10,
                                                         gen_batch_size=384)
    assert OverlongBuffer.from_config(cfg) == OverlongBuffer(enable=True, len=128, penalty_factor=1.0, log=True)
    assert cfg.actor_rollout_ref.actor.loss_agg_mode == "token-mean"
    assert not cfg.actor_rollout_ref.actor.use_kl_loss and cfg.algorithm.use_kl_in_reward is False


def test_preflight_reports_dynamic_sampling_and_overlong_shaping(tmp_path: Path) -> None:
    from tests.trainer._preflight_data import write_data
    from tests.trainer.test_preflight import SMALL
    from verl.trainer.main_ppo import compose_config
    from verl.trainer.preflight import run_preflight

    cfg = compose_config([*SMALL, *write_data(tmp_path / "data"), "algorithm.adv_estimator=grpo",
                          "actor_rollout_ref.rollout.n_agent=2", "data.train_batch_size=4", "data.gen_batch_size=6",
                          "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=5",
                          "reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=100",
                          "data.max_response_length=500"])
    report = run_preflight(cfg, has_gpu=False)
    text = report.render()
    assert report.ok, text
    assert ("dynamic sampling (algorithm.filter_groups): generation batches of data.gen_batch_size=6 prompts "
            "until 4 prompts' groups differ in acc, at most 5 a step") in text
    assert "overlong shaping (reward_model.overlong_buffer): penalty from 400 tokens, up to -1" in text


def test_the_drgrpo_recipe_divides_by_the_widest_response_train_grpo_can_produce() -> None:
    """Dr. GRPO's divisor is set explicitly, to the response length bound of train_grpo.sh's own lengths
    (which the start-up check would also give a null factor), not left to a step's padded width."""
    from verl.trainer.config_check import config_errors
    from verl.trainer.main_ppo import compose_config

    recipe = _recipe_overrides(RECIPES["drgrpo"][0])
    assert "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm" in recipe
    lengths = [o for o in _recipe_overrides("train_grpo.sh")
               if o.split("=")[0] in ("data.max_response_length", "data.max_obs_length", "max_turns")]
    assert len(lengths) == 3, lengths
    explicit = compose_config([*lengths, *recipe])
    default = compose_config([*lengths, *(o for o in recipe if "loss_scale_factor" not in o)])
    assert config_errors(explicit) == [] and config_errors(default) == []
    assert explicit.actor_rollout_ref.actor.loss_scale_factor == default.actor_rollout_ref.actor.loss_scale_factor \
        == 3 * 500 + 2 * 500


def test_the_gspo_recipe_aggregates_every_term_as_gspo_does_and_is_not_warned(caplog: pytest.LogCaptureFixture) -> None:
    """GSPO's policy term is seq-mean-token-mean whatever loss_agg_mode says: the recipe sets that mode, so
    the entropy / KL terms aggregate alike and nothing is warned; the default token-mean is ignored by the
    policy term just as much, so it is the one warned about."""
    import logging

    from verl.trainer.config_check import config_errors
    from verl.trainer.main_ppo import compose_config

    recipe = _recipe_overrides(RECIPES["gspo"][0])

    def warnings(*extra: str) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="verl.trainer.config_check_policy_loss"):
            assert config_errors(compose_config([*recipe, *extra])) == []
        return [r.getMessage() for r in caplog.records if "loss_agg_mode" in r.getMessage()]

    assert warnings() == []
    found = warnings("actor_rollout_ref.actor.loss_agg_mode=token-mean")
    assert len(found) == 1 and "loss_agg_mode=token-mean applies to the entropy and KL terms only" in found[0]
