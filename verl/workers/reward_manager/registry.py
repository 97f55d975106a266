"""The reward-manager registry and the reward settings' checks (torch-free): `register`, the
registered classes, the refused names, `reward_config_errors`. The built-in managers register
themselves when verl.workers.reward_manager.managers is imported."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

REWARD_MANAGER_REGISTRY: dict[str, type] = {}

REFUSED = {
    "prime": "veRL's prime manager runs math/code verifiers in a process pool with per-item timeouts "
             "(PRIME's recipe); the QA rewards here are string matches or judge calls, which `naive` runs "
             "(`batch` for a user's batched compute_score)",
    "dapo": "DAPO's manager is naive + overlong-length shaping; use reward_model.reward_manager=naive "
            "and DAPO's overlong-buffer settings (docs/algorithms.md, DAPO), which apply on top of the manager",
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


def registered_class(name: str) -> type:
    """The class registered as `name`; ValueError naming reward_model.reward_manager otherwise."""
    if name in REWARD_MANAGER_REGISTRY:
        return REWARD_MANAGER_REGISTRY[name]
    if name in REFUSED:
        raise ValueError(f"reward_model.reward_manager={name!r} is not supported: {REFUSED[name]}")
    raise ValueError(f"reward_model.reward_manager={name!r} is not a registered reward manager; "
                     f"known: {sorted(REWARD_MANAGER_REGISTRY)}")


METRICS = ("em", "subem", "f1", "judge")


def reward_config_errors(cfg: Any) -> list[str]:
    """The reward settings' problems (config check, before anything starts), each naming its key."""
    from pathlib import Path

    from verl.utils.reward_score.llm_judge import JudgeConfig

    errors: list[str] = []
    rm_cfg = cfg.get("reward_model", {})
    custom = cfg.get("custom_reward_function", None) or {}
    name = str(rm_cfg.get("reward_manager", "naive"))
    if name in REFUSED:
        errors.append(f"reward_model.reward_manager={name!r} is not supported: {REFUSED[name]}")
    elif name not in {"naive", "batch"} | set(REWARD_MANAGER_REGISTRY):
        errors.append(f"reward_model.reward_manager={name!r} is not a registered reward manager; "
                      f"known: {sorted({'naive', 'batch'} | set(REWARD_MANAGER_REGISTRY))}")
    path = custom.get("path")
    if path and not Path(str(path)).expanduser().is_file():
        errors.append(f"custom_reward_function.path: no file {str(path)!r}")
    if name == "batch" and not path:
        errors.append("reward_model.reward_manager=batch needs custom_reward_function.path (a batched compute_score)")
    metric = str(rm_cfg.get("metric", "em"))
    if metric not in METRICS:
        errors.append(f"reward_model.metric={metric!r} must be one of {list(METRICS)}")
    try:
        judge = JudgeConfig.from_config(rm_cfg.get("judge", None))
    except ValueError as exc:
        errors.append(str(exc))
    else:
        if metric == "judge" and judge is None and not path:
            errors.append("reward_model.metric=judge needs reward_model.judge.url and .model")
    weights = [float(rm_cfg.get(key, 0) or 0) for key in ("structure_format_score", "final_format_score",
                                                          "retrieval_score")]
    if metric != "em" and not path and any(weights):
        errors.append(f"reward_model.metric={metric!r} cannot be combined with the format reward "
                      "(reward_model.structure_format_score/final_format_score/retrieval_score), defined on EM")
    return errors
