"""Reward managers by name (`reward_model.reward_manager`), veRL's registry shape.

`register(name)` adds a class, `get_reward_manager_cls(name)` finds one. Built in:

- `naive`: one score per row (today's manager): the built-in rule chosen by `reward_model.metric`
  (em, subem, f1, judge) or the user's `custom_reward_function` called row by row;
- `batch`: the user's `custom_reward_function` called once with the whole batch
  (`compute_score(data_sources, solution_strs, ground_truths, extra_infos, **reward_kwargs)`).

veRL's `prime` and `dapo` are refused with the reason (see `REFUSED`).
"""

from __future__ import annotations

from typing import Any

from verl.workers.reward_manager.registry import (
    METRICS,
    REFUSED,
    REWARD_MANAGER_REGISTRY,
    register,
    registered_class,
    reward_config_errors,
)


def get_reward_manager_cls(name: str) -> type:
    """The class registered as `name` (the built-ins loaded first); ValueError naming
    reward_model.reward_manager otherwise."""
    from verl.workers.reward_manager import managers  # noqa: F401  (registers the built-ins)

    return registered_class(name)


def build_reward_managers(config: Any, tokenizer: Any) -> tuple[Any, Any]:
    """(training reward, validation reward) per the config's reward_model and custom_reward_function."""
    from verl.workers.reward_manager.managers import build_reward_managers as build

    return build(config, tokenizer)


__all__ = ["METRICS", "REFUSED", "REWARD_MANAGER_REGISTRY", "reward_config_errors", "build_reward_managers",
           "get_reward_manager_cls", "register"]
