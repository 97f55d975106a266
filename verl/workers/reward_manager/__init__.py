"""Reward managers by name (`reward_model.reward_manager`), veRL's registry shape.

`register(name)` adds a class, `get_reward_manager_cls(name)` finds one. Built in:

- `naive`: one score per row (today's manager): the built-in rule chosen by `reward_model.metric`
  (em, subem, f1, judge) or the user's `custom_reward_function` called row by row;
- `batch`: the user's `custom_reward_function` called once with the whole batch
  (`compute_score(data_sources, solution_strs, ground_truths, extra_infos, **reward_kwargs)`).

veRL's `prime` and `dapo` are refused with the reason (see `REFUSED`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

REWARD_MANAGER_REGISTRY: dict[str, type] = {}

REFUSED = {
    "prime": "veRL's prime manager runs math/code verifiers in a process pool with per-item timeouts "
             "(PRIME's recipe); the QA rewards here are string matches or judge calls, which `naive` runs "
             "(`batch` for a user's batched compute_score)",
    "dapo": "DAPO's manager is naive + overlong-length shaping; use reward_model.reward_manager=naive "
            "and DAPO's overlong-buffer settings (docs/training.md, DAPO), which apply on top of the manager",
}


def register(name: str) -> Callable[[type], type]:
    """Class decorator: make a reward manager available as `reward_model.reward_manager=<name>`."""

    def decorator(cls: type) -> type:
        known = REWARD_MANAGER_REGISTRY.get(name)
        if known is not None and known is not cls:
            raise ValueError(f"reward manager {name!r} is already registered as {known.__qualname__}")
        REWARD_MANAGER_REGISTRY[name] = cls
        return cls

    return decorator


def get_reward_manager_cls(name: str) -> type:
    """The class registered as `name`; ValueError naming reward_model.reward_manager otherwise."""
    from verl.workers.reward_manager import managers  # noqa: F401  (registers the built-ins)

    if name in REWARD_MANAGER_REGISTRY:
        return REWARD_MANAGER_REGISTRY[name]
    if name in REFUSED:
        raise ValueError(f"reward_model.reward_manager={name!r} is not supported: {REFUSED[name]}")
    raise ValueError(f"reward_model.reward_manager={name!r} is not a registered reward manager; "
                     f"known: {sorted(REWARD_MANAGER_REGISTRY)}")


def build_reward_managers(config: Any, tokenizer: Any) -> tuple[Any, Any]:
    """(training reward, validation reward) per the config's reward_model and custom_reward_function."""
    from verl.workers.reward_manager.managers import build_reward_managers as build

    return build(config, tokenizer)


__all__ = ["REFUSED", "REWARD_MANAGER_REGISTRY", "build_reward_managers", "get_reward_manager_cls", "register"]
