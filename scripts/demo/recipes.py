"""`demo.recipe=<name>`: the demo's GRPO run (same warm start, world and scale) with the keys of
another algorithm recipe in place of GRPO's (docs/demo.md, "Recipes"; the paper-scale launchers are
example/recipes/). Each list replaces the demo's value of every key it sets.

    dapo                           clip-higher, dynamic sampling (48-prompt generation batches until 32
                                   prompts' groups vary), overlong shaping over the last 10 tokens of a
                                   turn, token-mean loss, no KL
    gspo                           sequence-level ratio clipped at 3e-4 / 4e-4, seq-mean-token-mean, no KL
    drgrpo                         no std normalisation, seq-mean-token-sum-norm, no KL
    reinforce_plus_plus_baseline   REINFORCE++ with the group mean as baseline (veRL's estimator)
    rloo                           leave-one-out baseline
"""

from __future__ import annotations

NO_KL = ("actor_rollout_ref.actor.use_kl_loss=false", "algorithm.use_kl_in_reward=false")

RECIPE_OVERRIDES: dict[str, tuple[str, ...]] = {
    "dapo": (
        *NO_KL,
        "actor_rollout_ref.actor.clip_ratio_low=0.2",
        "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.metric=acc",
        "algorithm.filter_groups.max_num_gen_batches=8",
        "data.gen_batch_size=48",
        "reward_model.overlong_buffer.enable=true",
        "reward_model.overlong_buffer.len=10",          # of data.max_response_length=40 tokens a turn
        "reward_model.overlong_buffer.penalty_factor=0.5",
        "reward_model.overlong_buffer.log=true",
    ),
    "gspo": (
        *NO_KL,
        "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
        "actor_rollout_ref.actor.clip_ratio_low=0.0003",
        "actor_rollout_ref.actor.clip_ratio_high=0.0004",
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
    ),
    "drgrpo": (
        *NO_KL,
        "algorithm.norm_adv_by_std_in_grpo=false",
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
    ),
    "reinforce_plus_plus_baseline": ("algorithm.adv_estimator=reinforce_plus_plus_baseline",),
    "rloo": ("algorithm.adv_estimator=rloo",),
}
RECIPES = tuple(RECIPE_OVERRIDES)


def _key(override: str) -> str:
    return override.lstrip("+").partition("=")[0]


def with_recipe(base: list[str], recipe: str) -> list[str]:
    """`base` with the recipe's overrides in place of the keys they set, and the experiment named demo-<recipe>."""
    extra = [*RECIPE_OVERRIDES[recipe], f"trainer.experiment_name=demo-{recipe}"]
    keys = {_key(o) for o in extra}
    return [o for o in base if _key(o) not in keys] + extra
