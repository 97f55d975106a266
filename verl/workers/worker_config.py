"""A worker's config checked and normalised when the worker is built (verl/workers/fsdp_workers.py).

Batch sizes in the config are global (per training step); each worker turns them into per-rank
sizes in its __init__, veRL style (`normalize_actor_batch_sizes`, `normalize_critic_batch_sizes`).
Settings this FSDP2 build does not implement are refused by name (`check_supported`,
`check_fsdp_size`). Preflight runs the same functions on the driver (verl/trainer/preflight.py).
"""

from __future__ import annotations

from typing import Any

from omegaconf import open_dict

from verl.trainer.run_config import default_micro_per_worker
from verl.workers.sp_groups import check_sequence_parallel, sp_size


def _per_rank(node: Any, key: str, world_size: int, where: str, multiplier: int = 1) -> None:
    """node[key] = node[key] * multiplier // world_size, refusing sizes that do not divide."""
    total = int(node[key]) * multiplier
    if total % world_size != 0 or total < world_size:
        raise ValueError(f"{where}.{key}={node[key]} (x{multiplier}) is not divisible by the "
                         f"{world_size} data-parallel workers")
    with open_dict(node):
        node[key] = total // world_size


def _micro_per_rank(node: Any, key: str, world_size: int, where: str, default: int) -> None:
    """A micro-batch size, given over all workers (`key`, Search-R1) or per worker (`key`_per_gpu, veRL),
    becomes rows per worker in both keys (in place). Both null: `default` rows per worker."""
    per_gpu_key = f"{key}_per_gpu"
    total, per_gpu = node.get(key), node.get(per_gpu_key)
    if total is not None and per_gpu is not None:
        raise ValueError(f"{where}.{key}={total} and {where}.{per_gpu_key}={per_gpu} are both set: {key} counts "
                         f"rows over all workers, {per_gpu_key} rows per worker; set one of them")
    if per_gpu is not None:
        if isinstance(per_gpu, bool) or not isinstance(per_gpu, int) or per_gpu < 1:
            raise ValueError(f"{where}.{per_gpu_key}={per_gpu!r} must be an int >= 1")
        rows = per_gpu
    elif total is None:
        rows = default
    else:
        _per_rank(node, key, world_size, where)
        rows = int(node[key])
    with open_dict(node):
        node[key] = rows
        node[per_gpu_key] = rows


def _check_micro_divides_mini(node: Any, mini_key: str, micro_key: str, where: str) -> None:
    if node.get("use_dynamic_bsz", False):
        return
    if int(node[mini_key]) % int(node[micro_key]) != 0:
        raise ValueError(f"{where}.{mini_key}={node[mini_key]} per worker is not a multiple of "
                         f"{where}.{micro_key}={node[micro_key]} per worker")


def normalize_actor_batch_sizes(config: Any, role: str, world_size: int) -> None:
    """Global -> per-rank batch sizes for an ActorRolloutRefWorker config (in place).

    `ppo_mini_batch_size` counts rollouts (rows after the driver's n_agent repetition), times
    `rollout.n` (veRL's key, default 1), as in the original Search-R1; `rollout.n_agent` does
    not scale it. Micro-batch sizes count rows: `<key>` over all workers, or veRL's `<key>_per_gpu`
    per worker (one of the two; both null: run_config.default_micro_per_worker); afterwards both
    hold the rows per worker. Call once per config copy: it divides in place.
    """
    if role in ("actor", "actor_ref", "actor_rollout", "actor_rollout_ref"):
        actor = config.actor
        n = int(config.rollout.get("n", 1))
        _per_rank(actor, "ppo_mini_batch_size", world_size, "actor_rollout_ref.actor", multiplier=n)
        _micro_per_rank(actor, "ppo_micro_batch_size", world_size, "actor_rollout_ref.actor",
                        default_micro_per_worker("actor_rollout_ref.actor.ppo_micro_batch_size", world_size))
        _check_micro_divides_mini(actor, "ppo_mini_batch_size", "ppo_micro_batch_size", "actor_rollout_ref.actor")
    if role in ("actor", "actor_ref", "actor_rollout", "actor_rollout_ref"):   # the old log-probs (not a rollout pool's)
        _micro_per_rank(config.rollout, "log_prob_micro_batch_size", world_size, "actor_rollout_ref.rollout",
                        default_micro_per_worker("actor_rollout_ref.rollout.log_prob_micro_batch_size", world_size))
    if role in ("ref", "actor_ref", "actor_rollout_ref"):
        _micro_per_rank(config.ref, "log_prob_micro_batch_size", world_size, "actor_rollout_ref.ref",
                        default_micro_per_worker("actor_rollout_ref.ref.log_prob_micro_batch_size", world_size))


def normalize_critic_batch_sizes(config: Any, world_size: int) -> None:
    """Global -> per-rank batch sizes for a CriticWorker config (in place).

    Same semantics as the actor's: `ppo_mini_batch_size` counts rollouts, times `critic.rollout_n`
    (= `actor_rollout_ref.rollout.n`, default 1). The config must be resolved: an interpolation
    to the actor's mini-batch would read the actor's already divided value in a colocated worker.
    """
    n = int(config.get("rollout_n", 1))
    _per_rank(config, "ppo_mini_batch_size", world_size, "critic", multiplier=n)
    default = default_micro_per_worker("critic.ppo_micro_batch_size", world_size)
    _micro_per_rank(config, "ppo_micro_batch_size", world_size, "critic", default)
    if config.get("forward_micro_batch_size") is None and config.get("forward_micro_batch_size_per_gpu") is None:
        # Neither given (the YAML ties them to the update's pair): the update's micro-batch per worker.
        with open_dict(config):
            config.forward_micro_batch_size_per_gpu = config.ppo_micro_batch_size
    _micro_per_rank(config, "forward_micro_batch_size", world_size, "critic", default)
    _check_micro_divides_mini(config, "ppo_mini_batch_size", "ppo_micro_batch_size", "critic")


def check_supported(node: Any, where: str, world_size: int = 1, model_cfg: Any = None,
                    sequence_parallel: bool = True) -> int:
    """Refuse settings this FSDP2 build does not implement, naming the key, instead of ignoring them;
    returns the Ulysses SP size (verl/workers/sp_groups.py: packing on, divides the world and the
    model's head counts), 1 where the worker trains nothing (`sequence_parallel=False`: a rollout pool)."""
    if node.get("strategy", "fsdp") != "fsdp":
        raise ValueError(f"{where}.strategy={node.strategy!r}: only 'fsdp' (FSDP2) is supported")
    size = sp_size(node, where) if sequence_parallel else 1
    if size > 1:
        use_rmpad = bool(model_cfg.get("use_remove_padding", False)) if model_cfg is not None else False
        hf_config = None
        if model_cfg is not None and use_rmpad and world_size % size == 0:
            from transformers import AutoConfig

            hf_config = AutoConfig.from_pretrained(model_cfg.path)
            for key, value in (model_cfg.get("override_config") or {}).items():
                setattr(hf_config, key, value)
        check_sequence_parallel(size, world_size, use_rmpad, where, hf_config)
    return size


def check_fsdp_size(fsdp_cfg: Any, world_size: int, where: str) -> None:
    size = int(fsdp_cfg.get("fsdp_size", -1))
    if size not in (-1, world_size):
        raise NotImplementedError(f"{where}.fsdp_size={size}: hybrid sharding is not supported; "
                                  f"use -1 (shard over all {world_size} workers)")
