"""`demo.recipe=<name>`: the GRPO demo with another algorithm's keys (scripts/demo/recipes.py)."""

from __future__ import annotations

import pytest

from scripts.demo.build import split_args
from scripts.demo.recipes import RECIPES
from scripts.demo.run_demo import planned_config, split_algorithm
from verl.trainer.config_check import config_errors


def _planned(argv: list[str]):
    algorithm, rest = split_algorithm(argv)
    settings, overrides = split_args(rest)
    return algorithm, planned_config(algorithm, settings, overrides)


def test_a_recipe_name_is_the_algorithm_and_bad_names_or_ppo_are_refused() -> None:
    assert split_algorithm(["demo.recipe=dapo", "trainer.total_training_steps=3"]) == (
        "dapo", ["trainer.total_training_steps=3"])
    with pytest.raises(SystemExit, match="demo.recipe takes one of dapo, gspo"):
        split_algorithm(["demo.recipe=ppo2"])
    with pytest.raises(SystemExit, match="drop demo.algorithm=ppo"):
        split_algorithm(["demo.algorithm=ppo", "demo.recipe=rloo"])


def test_the_dapo_demo_keeps_the_demo_scale_and_turns_on_dynamic_sampling() -> None:
    algorithm, cfg = _planned(["demo.recipe=dapo", "trainer.total_training_steps=4"])
    assert algorithm == "dapo" and cfg.trainer.experiment_name == "demo-dapo"
    # the GRPO demo's scale and warm start
    assert (cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n_agent) == (32, 5)
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.trainer.total_training_steps == 4
    assert cfg.algorithm.filter_groups.enable and cfg.data.gen_batch_size == 48
    assert cfg.reward_model.overlong_buffer.enable and cfg.reward_model.overlong_buffer.len == 10
    assert not cfg.actor_rollout_ref.actor.use_kl_loss and cfg.algorithm.use_kl_in_reward is False


# dapo, gspo, drgrpo need the actor keys of the policy-loss work (clip_ratio_low/high, policy_loss.loss_mode,
# seq-mean-token-sum-norm); reinforce_plus_plus_baseline needs that estimator: they pass once those are merged.
@pytest.mark.parametrize("recipe", RECIPES)
def test_every_demo_recipe_composes_and_passes_the_config_check(recipe: str) -> None:
    algorithm, cfg = _planned([f"demo.recipe={recipe}"])
    assert algorithm == recipe
    assert config_errors(cfg) == []
