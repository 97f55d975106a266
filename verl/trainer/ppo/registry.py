"""Registries of policy losses and advantage estimators, veRL's shape (DESIGN §3.5).

A policy loss is registered under its `actor_rollout_ref.actor.policy_loss.loss_mode` name and
called as veRL calls it:

    fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
       rollout_is_weights=None) -> (loss, metrics)

with `config` the actor config node. An advantage estimator is registered under its
`algorithm.adv_estimator` name and called with veRL's keyword arguments (`token_level_rewards`,
`response_mask`, `index`, `epsilon`, `norm_adv_by_std_in_grpo`, `config`, ...); it returns
`(advantages, returns)`.

The built-ins register themselves when `verl.trainer.ppo.core_algos` is imported (it imports
policy_losses and advantage_estimators); this module imports none of them, so it stays torch-free
and below them in the import graph. `verl.trainer.ppo.core_algos` re-exports the four functions below
under veRL's import path (with veRL's `agg_loss` and `kl_penalty`).

A user's own functions live in one file named by `custom_algorithms.path`; importing it runs its
`@register_policy_loss(...)` / `@register_adv_est(...)` decorators (`load_custom_algorithms`).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

from verl.utils.user_file import import_user_file

F = TypeVar("F", bound=Callable[..., Any])

POLICY_LOSS_REGISTRY: dict[str, Callable[..., Any]] = {}
ADV_ESTIMATOR_REGISTRY: dict[str, Callable[..., Any]] = {}

# the loss modes verl.trainer.ppo.policy_losses registers (named here so the config check needs no torch)
BUILTIN_POLICY_LOSSES = ("vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo")

POLICY_LOSS_KEY = "actor_rollout_ref.actor.policy_loss.loss_mode"
ADV_ESTIMATOR_KEY = "algorithm.adv_estimator"
CUSTOM_ALGORITHMS_KEY = "custom_algorithms.path"
# the key of the actor workers' config (actor_rollout_ref) that carries custom_algorithms.path to them
CUSTOM_ALGORITHMS_WORKER_KEY = "custom_algorithms_path"
# veRL's ActorConfig field a veRL loss spreads into agg_loss (`**config.global_batch_info`); empty, as
# on veRL's FSDP actor: each micro-batch aggregates locally and the actor weighs it by its share
GLOBAL_BATCH_INFO_KEY = "global_batch_info"


def _name(name: str | Enum) -> str:
    return str(name.value if isinstance(name, Enum) else name)


def _register(registry: dict[str, Callable[..., Any]], kind: str, name: str | Enum) -> Callable[[F], F]:
    key = _name(name)

    def decorate(fn: F) -> F:
        existing = registry.get(key)
        # the same function again (a module imported twice) is harmless; another one is a clash
        if existing is not None and getattr(existing, "__qualname__", None) != getattr(fn, "__qualname__", None):
            raise ValueError(f"{kind} {key!r} is already registered ({existing.__module__}.{existing.__qualname__}); "
                             f"pick another name for {fn.__module__}.{fn.__qualname__}")
        registry[key] = fn
        return fn

    return decorate


def register_policy_loss(name: str | Enum) -> Callable[[F], F]:
    """Decorator: register a policy loss under `name` (a value of actor.policy_loss.loss_mode)."""
    return _register(POLICY_LOSS_REGISTRY, "policy loss", name)


def register_adv_est(name: str | Enum) -> Callable[[F], F]:
    """Decorator: register an advantage estimator under `name` (a value of algorithm.adv_estimator)."""
    return _register(ADV_ESTIMATOR_REGISTRY, "advantage estimator", name)


def get_policy_loss_fn(name: str | Enum) -> Callable[..., Any]:
    """The policy loss registered as `name`; a ValueError naming the key and the choices otherwise."""
    return _lookup(POLICY_LOSS_REGISTRY, POLICY_LOSS_KEY, name)


def get_adv_estimator_fn(name: str | Enum) -> Callable[..., Any]:
    """The advantage estimator registered as `name`; a ValueError naming the key and the choices otherwise."""
    return _lookup(ADV_ESTIMATOR_REGISTRY, ADV_ESTIMATOR_KEY, name)


def _lookup(registry: dict[str, Callable[..., Any]], key: str, name: str | Enum) -> Callable[..., Any]:
    try:
        return registry[_name(name)]
    except KeyError:
        raise ValueError(f"unknown {key} {_name(name)!r}; registered: {sorted(registry)} "
                         f"(your own: register it in the file named by {CUSTOM_ALGORITHMS_KEY})") from None


def policy_loss_names() -> tuple[str, ...]:
    """Every registered loss_mode: the built-ins once verl.trainer.ppo.core_algos is imported, and custom ones."""
    return tuple(sorted(POLICY_LOSS_REGISTRY))


def adv_estimator_names() -> tuple[str, ...]:
    """Every registered adv_estimator: the built-ins once verl.trainer.ppo.core_algos is imported, and custom ones."""
    return tuple(sorted(ADV_ESTIMATOR_REGISTRY))


def load_custom_algorithms(path: str | None) -> None:
    """Import the user's file named by custom_algorithms.path (None: nothing), running its registrations.

    Called in the driver and in every worker before a lookup, so a custom loss reaches the actor
    and a custom estimator the driver. A missing file or one that fails to import is an error that
    names the key and the file."""
    if not path:
        return
    import_user_file(path, CUSTOM_ALGORITHMS_KEY, "search_r1_custom_algorithms_")


def worker_config_with_custom_algorithms(actor_rollout_ref: Any, path: str | None) -> Any:
    """The actor workers' config: `actor_rollout_ref` itself without a custom file, else a copy that
    carries the file's (absolute) path as `custom_algorithms_path`, which the worker imports (the
    workers are processes of their own: the driver's registrations do not reach them), and an empty
    `actor.global_batch_info`, which a loss written for veRL reads (`GLOBAL_BATCH_INFO_KEY`)."""
    if not path:
        return actor_rollout_ref
    import copy

    from omegaconf import open_dict

    config = copy.deepcopy(actor_rollout_ref)
    with open_dict(config):
        config[CUSTOM_ALGORITHMS_WORKER_KEY] = str(Path(path).expanduser().resolve())
        if GLOBAL_BATCH_INFO_KEY not in config.actor:
            config.actor[GLOBAL_BATCH_INFO_KEY] = {}
    return config
