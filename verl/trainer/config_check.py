"""Start-up checks of the composed trainer config.

`validate_config(cfg)` runs once, before any worker is built, so a contradiction in
the command line fails in a second with a message naming the keys instead of an
hour later inside a worker. It also finds (without importing them) the optional packages
the run will import: the logger backends, vLLM, flash-attn. Those that depend on the host
(`rollout.name=auto` is vLLM on a GPU host; flash-attn only packs on CUDA) are checked when
`has_gpu` is known. `check_runtime(cfg, has_gpu)` checks what the machine offers once the
rollout engine is resolved (vLLM installed, GPUs present).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from verl.utils.attention import FLASH_ATTN_INSTALL

logger = logging.getLogger(__name__)

ADV_ESTIMATORS = ("gae", "grpo", "reinforce_plus_plus", "rloo")
ROLLOUT_NAMES = ("auto", "hf", "vllm")
# veRL's engines that this project does not ship (docs/rollout.md, "SGLang"): refused with the
# setting that gives the same rollout here.
SGLANG_NAMES = ("sglang", "sglang_async")
TRUNCATIONS = ("error", "left", "right", "middle")
SCHEMA_PATH = Path(__file__).parent / "config" / "ppo_trainer.yaml"

# One setting, two names: Search-R1's global micro-batch (rows over all workers) and veRL's
# `<key>_per_gpu` (rows per worker). Both default to null; set one. Both null: this many rows in all,
# split over the workers and rounded down, at least one per worker (default_micro_per_worker).
MICRO_BATCH_DEFAULTS: dict[str, int] = {
    "actor_rollout_ref.actor.ppo_micro_batch_size": 8,
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": 128,
    "actor_rollout_ref.ref.log_prob_micro_batch_size": 128,
    "critic.ppo_micro_batch_size": 8,
}

# veRL keys a user of its recipes may pass that have no meaning in this project; the reason is
# added to the "not a setting of this project" message (a prefix matches its sub-keys).
VERL_KEYS_WITHOUT_MEANING: dict[str, str] = {
    "actor_rollout_ref.rollout.multi_turn.interaction_config_path":
        "veRL's interactions (simulated user turns) are not implemented; tools answer through tool_config_path",
    "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template":
        "the rollout is the model's own ids plus the chat template's tool messages (token-exact), as veRL's False",
    "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode":
        "rollouts are token-exact by construction: the model's ids are kept, only tool messages are tokenized",
    "actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts":
        "samples per prompt are actor_rollout_ref.rollout.n (veRL) or rollout.n_agent (Search-R1)",
    "actor_rollout_ref.rollout.agent": "veRL's agent loop corresponds to actor_rollout_ref.rollout.mode=async",
    "actor_rollout_ref.rollout.calculate_log_probs":
        "the rollout's log-probs are compared with the actor's when the engine returns them (rollout/log_prob_gap)",
    "data.custom_cls": "the dataset is verl/utils/dataset/rl_dataset.py's RLHFDataset",
    "data.image_key": "text-only: no multi-modal inputs",
    "data.video_key": "text-only: no multi-modal inputs",
}
LOGGERS = ("console", "jsonl", "wandb", "tensorboard")
KL_TYPES = ("kl", "abs", "mse", "low_var_kl")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")

# Keys users append with `+trainer.<key>=...`; not declared in the YAML, read with these defaults.
# `preflight`: check the composed config and exit, without Ray, workers or weights (preflight.py).
OPTIONAL_TRAINER_KEYS: dict[str, Any] = {"val_only": False, "val_before_train": True, "preflight": False,
                                         # a pipelined rollout waits for the weights of the update just
                                         # made (staleness 0: the pipeline's steps equal sync's; tests)
                                         "pipeline_wait_for_sync": False}
PIPELINES = ("sync", "one_step_off", "async")

# Logger backends that need a package: backend -> (module to find, how to install it).
LOGGER_PACKAGES: dict[str, tuple[str, str]] = {
    "wandb": ("wandb", "pip install -e .[wandb]"),
    "tensorboard": ("tensorboard", "pip install tensorboard"),
}
ASYNC_TP_MESSAGE = ("the async rollout steps each rank's engine on its own; a TP group's ranks would diverge; "
                    "use mode=sync or tensor_model_parallel_size=1")


class ConfigError(ValueError):
    """A contradiction or an unsupported value in the trainer config."""


def trainer_flag(cfg: DictConfig, key: str) -> Any:
    """Read an optional `trainer.<key>` (see OPTIONAL_TRAINER_KEYS) with its default."""
    if key not in OPTIONAL_TRAINER_KEYS:
        raise KeyError(f"trainer.{key} is not an optional trainer key; known: {sorted(OPTIONAL_TRAINER_KEYS)}")
    return OmegaConf.select(cfg, f"trainer.{key}", default=OPTIONAL_TRAINER_KEYS[key])


def tool_protocol(cfg: DictConfig) -> bool:
    """Whether the run calls tools natively (veRL upstream's recipe): `actor_rollout_ref.rollout.multi_turn.enable`."""
    return bool(OmegaConf.select(cfg, "actor_rollout_ref.rollout.multi_turn.enable", default=False))


def prompt_bound(cfg: DictConfig) -> tuple[int, str]:
    """(tokens an initial prompt may have, the key that says so): `data.max_prompt_length` in the tool
    protocol (veRL's meaning), `data.max_start_length` in the tag protocol (the original's)."""
    key = "data.max_prompt_length" if tool_protocol(cfg) else "data.max_start_length"
    return int(OmegaConf.select(cfg, key)), key


def shuffle_train(cfg: DictConfig) -> bool:
    """Whether the training rows are shuffled each epoch: `data.shuffle_train_dataloader` (Search-R1)
    or its veRL name `data.shuffle`; both null means True (config_errors refuses two different values)."""
    for key in ("shuffle_train_dataloader", "shuffle"):
        value = cfg.data.get(key)
        if value is not None:
            return bool(value)
    return True


def default_micro_per_worker(key: str, workers: int) -> int:
    """Rows per worker of a MICRO_BATCH_DEFAULTS key when neither of its names is set: the default
    rows in all, split over the workers (rounded down, at least one), so any world size works."""
    return max(1, MICRO_BATCH_DEFAULTS[key] // max(workers, 1))


def micro_batch_rows(cfg: DictConfig, key: str) -> int:
    """Rows of one micro-batch over all workers for a MICRO_BATCH_DEFAULTS key (or
    `critic.forward_micro_batch_size`): `<key>_per_gpu` x workers when that is set, else `<key>`,
    else the default (the critic's forward pass: its update micro-batch)."""
    per_gpu = OmegaConf.select(cfg, f"{key}_per_gpu")
    if isinstance(per_gpu, int) and not isinstance(per_gpu, bool):   # a bad value is reported by _check_data
        return per_gpu * world_size(cfg)
    value = OmegaConf.select(cfg, key)
    if value is not None:
        return int(value)
    if key == "critic.forward_micro_batch_size":
        return micro_batch_rows(cfg, "critic.ppo_micro_batch_size")
    return default_micro_per_worker(key, world_size(cfg)) * world_size(cfg)


def micro_batch_key(cfg: DictConfig, key: str) -> str:
    """How the micro-batch of `key` was given, for messages: `<key>_per_gpu*world_size` or `<key>`."""
    return f"{key}_per_gpu*world_size" if OmegaConf.select(cfg, f"{key}_per_gpu") is not None else key


def total_workers(cfg: DictConfig) -> int:
    """Worker processes of the run: GPUs in total, or on a CPU-only machine the CPU workers."""
    return int(cfg.trainer.nnodes) * int(cfg.trainer.n_gpus_per_node)


def pipelined(cfg: DictConfig) -> bool:
    """`trainer.pipeline` is one_step_off or async: separate rollout and train pools."""
    return str(cfg.trainer.get("pipeline", "sync")) != "sync"


def rollout_pool_size(cfg: DictConfig) -> int:
    """Workers of a pipelined run's rollout pool (`trainer.rollout_pool`, null = half); 0 for sync."""
    if not pipelined(cfg):
        return 0
    size = cfg.trainer.get("rollout_pool")
    return max(1, total_workers(cfg) // 2) if size is None else int(size)


def world_size(cfg: DictConfig) -> int:
    """Worker processes that train (the FSDP world every batch size divides over): all of them,
    or with a pipeline the train pool's (total_workers - rollout_pool_size)."""
    return total_workers(cfg) - rollout_pool_size(cfg)


def rollout_world_size(cfg: DictConfig) -> int:
    """Worker processes that generate: every worker, or with a pipeline the rollout pool's."""
    return rollout_pool_size(cfg) if pipelined(cfg) else world_size(cfg)


def pool_layout(cfg: DictConfig) -> dict[str, list[int]]:
    """Workers per node of each pool: {"global_pool": ...}, or with a pipeline {"train_pool": ...,
    "rollout_pool": ...}: on one node both share it; on several the rollout pool takes whole nodes."""
    nnodes, per_node = int(cfg.trainer.nnodes), int(cfg.trainer.n_gpus_per_node)
    if not pipelined(cfg):
        return {"global_pool": [per_node] * nnodes}
    rollout = rollout_pool_size(cfg)
    if nnodes == 1:
        return {"train_pool": [per_node - rollout], "rollout_pool": [rollout]}
    return {"train_pool": [per_node] * (nnodes - rollout // per_node), "rollout_pool": [per_node] * (rollout // per_node)}


def _check_pipeline(cfg: DictConfig, errors: list[str]) -> None:
    trainer = cfg.trainer
    pipeline = str(trainer.get("pipeline", "sync"))
    if pipeline not in PIPELINES:
        errors.append(f"trainer.pipeline={pipeline!r} is unknown; choose one of {list(PIPELINES)}")
        return
    staleness = trainer.get("max_staleness", 1)
    if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 1:
        errors.append(f"trainer.max_staleness={staleness!r} must be an int >= 1")
    partial = bool(cfg.actor_rollout_ref.rollout.get("partial", False))
    if partial and pipeline == "sync":
        errors.append("actor_rollout_ref.rollout.partial=true needs trainer.pipeline=one_step_off or async "
                      "(weights change mid-rollout only when another pool trains them)")
    if partial and cfg.actor_rollout_ref.rollout.get("mode", "sync") == "async":
        errors.append("actor_rollout_ref.rollout.partial=true needs actor_rollout_ref.rollout.mode=sync: the async "
                      "rollout's trajectories run inside the workers, where no weights arrive between turns")
    if pipeline == "sync":
        return
    total, nnodes, per_node = total_workers(cfg), int(trainer.nnodes), int(trainer.n_gpus_per_node)
    size = trainer.get("rollout_pool")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int)):
        errors.append(f"trainer.rollout_pool={size!r} must be an int (workers) or null")
        return
    rollout = rollout_pool_size(cfg)
    if not 1 <= rollout < total:
        errors.append(f"trainer.pipeline={pipeline} needs trainer.rollout_pool in 1..{total - 1} (one worker at least "
                      f"for each pool out of trainer.nnodes*trainer.n_gpus_per_node={total}); got {rollout}")
    elif nnodes > 1 and rollout % per_node != 0:
        errors.append(f"trainer.rollout_pool={rollout} on trainer.nnodes={nnodes}: the rollout pool takes whole nodes, "
                      f"a multiple of trainer.n_gpus_per_node={per_node}")


def samples_per_prompt(cfg: DictConfig) -> int:
    """Rollouts per prompt: `rollout.n_agent` (Search-R1's key) times `rollout.n` (veRL's)."""
    rollout = cfg.actor_rollout_ref.rollout
    return int(rollout.n_agent) * int(rollout.get("n", 1))


def rollouts_per_step(cfg: DictConfig) -> int:
    """Rows one training step trains on: every prompt of the batch, repeated samples_per_prompt times."""
    return int(cfg.data.train_batch_size) * samples_per_prompt(cfg)


def mini_batch_rollouts(cfg: DictConfig, role: str = "actor") -> int:
    """Rows per optimizer step (all workers together) for role `actor` or `critic`.

    `ppo_mini_batch_size` counts rollouts (rows after the n_agent repetition), as in the original
    Search-R1, times `rollout.n` as in veRL: with n_agent it is a number of rollouts, with
    rollout.n a number of prompts.
    """
    if role == "actor":
        return int(cfg.actor_rollout_ref.actor.ppo_mini_batch_size) * int(cfg.actor_rollout_ref.rollout.get("n", 1))
    if role == "critic":
        return int(cfg.critic.ppo_mini_batch_size) * int(cfg.critic.get("rollout_n", 1))
    raise ValueError(f"role must be 'actor' or 'critic', got {role!r}")


def optimizer_steps_per_training_step(cfg: DictConfig, role: str = "actor") -> int:
    """Optimizer steps one training step takes for `role` (ppo_epochs x mini-batches)."""
    node = cfg.actor_rollout_ref.actor if role == "actor" else cfg.critic
    return int(node.ppo_epochs) * -(-rollouts_per_step(cfg) // mini_batch_rollouts(cfg, role))


def interpolations(node: Any, prefix: str = "") -> list[str]:
    """Dotted keys under `node` whose value is still an `${...}` interpolation (unresolved)."""
    found: list[str] = []
    if isinstance(node, DictConfig):
        items = [(str(k), k) for k in node.keys()]
    elif isinstance(node, ListConfig):
        items = [(str(i), i) for i in range(len(node))]
    else:
        return found
    for name, key in items:
        path = f"{prefix}.{name}" if prefix else name
        if OmegaConf.is_interpolation(node, key):
            found.append(path)
        else:
            found.extend(interpolations(node._get_node(key), path))
    return found


def use_kl_in_reward(cfg: DictConfig) -> bool:
    """In-reward KL penalty; null means "unless the actor already has a KL loss" (as Search-R1 does)."""
    value = cfg.algorithm.use_kl_in_reward
    if value is None:
        return not bool(cfg.actor_rollout_ref.actor.use_kl_loss)
    return bool(value)


def need_reference_policy(cfg: DictConfig) -> bool:
    return bool(cfg.actor_rollout_ref.actor.use_kl_loss) or use_kl_in_reward(cfg)


def need_critic(cfg: DictConfig) -> bool:
    return cfg.algorithm.adv_estimator == "gae"


def _divides(errors: list[str], what: str, big: int, big_key: str, small: int, small_key: str) -> None:
    if small <= 0 or big % small != 0:
        errors.append(f"{what}: {big_key}={big} is not divisible by {small_key}={small}")


def _check_batch_sizes(cfg: DictConfig, errors: list[str]) -> None:
    """Batch sizes in rollouts (see `mini_batch_rollouts`), split evenly over the workers."""
    ws = world_size(cfg)
    ws_key = ("the train pool trainer.nnodes*trainer.n_gpus_per_node-trainer.rollout_pool" if pipelined(cfg)
              else "trainer.nnodes*trainer.n_gpus_per_node")
    rollout = cfg.actor_rollout_ref.rollout
    for key in ("n_agent", "n"):
        if int(rollout.get(key, 1)) < 1:
            errors.append(f"actor_rollout_ref.rollout.{key}={rollout.get(key)} must be >= 1")
            return
    if ws < 1:
        errors.append(f"{ws_key}={ws} must be >= 1")
        return
    rollouts = rollouts_per_step(cfg)
    rollouts_key = "data.train_batch_size*rollout.n_agent*rollout.n"
    _divides(errors, "rollouts per step", rollouts, rollouts_key, ws, ws_key)

    actor = cfg.actor_rollout_ref.actor
    _check_mini_batch(errors, "actor", "actor_rollout_ref.actor", int(actor.ppo_mini_batch_size),
                      "actor_rollout_ref.rollout.n", int(rollout.get("n", 1)), rollouts, rollouts_key, ws, ws_key)
    # The workers divide every micro-batch key by the world size, also under use_dynamic_bsz (which
    # then packs by tokens instead), so each must divide it; only the micro-in-mini rules are skipped.
    key = "actor_rollout_ref.actor.ppo_micro_batch_size"
    _check_micro_batch(errors, "actor", micro_batch_key(cfg, key), mini_batch_rollouts(cfg, "actor"),
                       micro_batch_rows(cfg, key), ws, ws_key, bool(actor.use_dynamic_bsz))
    for key in ("actor_rollout_ref.rollout.log_prob_micro_batch_size", "actor_rollout_ref.ref.log_prob_micro_batch_size"):
        _divides(errors, "log-prob micro-batch per worker", micro_batch_rows(cfg, key), micro_batch_key(cfg, key),
                 ws, ws_key)

    if need_critic(cfg):
        critic = cfg.critic
        _check_mini_batch(errors, "critic", "critic", int(critic.ppo_mini_batch_size),
                          "critic.rollout_n", int(critic.get("rollout_n", 1)), rollouts, rollouts_key, ws, ws_key)
        key = "critic.ppo_micro_batch_size"
        _check_micro_batch(errors, "critic", micro_batch_key(cfg, key), mini_batch_rollouts(cfg, "critic"),
                           micro_batch_rows(cfg, key), ws, ws_key, bool(critic.use_dynamic_bsz))
        key = "critic.forward_micro_batch_size"
        _divides(errors, "critic forward micro-batch per worker", micro_batch_rows(cfg, key),
                 micro_batch_key(cfg, key), ws, ws_key)


def _check_mini_batch(errors: list[str], who: str, prefix: str, size: int, n_key: str, n: int, rollouts: int,
                      rollouts_key: str, ws: int, ws_key: str) -> None:
    """The mini-batch (size * n rollouts) fits in and divides the step's rollouts, and splits over the workers."""
    mini, mini_key = size * n, f"{prefix}.ppo_mini_batch_size*{n_key}"
    if mini < 1 or mini > rollouts or rollouts % mini != 0:
        errors.append(f"{prefix}.ppo_mini_batch_size={size} (x {n_key}={n}): a mini-batch of {mini} rollouts must "
                      f"divide {rollouts_key}={rollouts} (ppo_mini_batch_size counts rollouts, see docs/training.md)")
    _divides(errors, f"{who} mini-batch per worker", mini, mini_key, ws, ws_key)


def _check_micro_batch(errors: list[str], who: str, micro_key: str, mini_rollouts: int, micro: int,
                       ws: int, ws_key: str, dynamic_bsz: bool = False) -> None:
    """The micro-batch (`micro` rows in all, set by `micro_key`) splits evenly over the workers and,
    unless batches are packed by tokens (`dynamic_bsz`), fits in and divides the mini-batch."""
    _divides(errors, f"{who} micro-batch per worker", micro, micro_key, ws, ws_key)
    if dynamic_bsz:
        return
    if micro > mini_rollouts:
        errors.append(f"{micro_key}={micro} is larger than the mini-batch of {mini_rollouts} rollouts")
    if micro <= mini_rollouts and micro % ws == 0 and mini_rollouts % ws == 0:
        _divides(errors, f"{who} mini-batch per worker", mini_rollouts // ws,
                 f"{who} mini-batch rollouts/world_size", micro // ws, f"{micro_key}/world_size")


def _check_algorithm(cfg: DictConfig, errors: list[str]) -> None:
    algo = cfg.algorithm
    actor = cfg.actor_rollout_ref.actor
    if algo.adv_estimator not in ADV_ESTIMATORS:
        errors.append(f"algorithm.adv_estimator={algo.adv_estimator!r} is unknown; choose one of {list(ADV_ESTIMATORS)}")
    if need_critic(cfg) and not cfg.critic.model.path:
        errors.append("algorithm.adv_estimator=gae needs a critic: set critic.model.path")
    if algo.kl_penalty not in KL_TYPES:
        errors.append(f"algorithm.kl_penalty={algo.kl_penalty!r} is unknown; choose one of {list(KL_TYPES)}")
    if actor.kl_loss_type not in KL_TYPES:
        errors.append(f"actor_rollout_ref.actor.kl_loss_type={actor.kl_loss_type!r} is unknown; choose one of {list(KL_TYPES)}")
    for key in ("actor_rollout_ref.actor.loss_agg_mode", "critic.loss_agg_mode"):
        mode = OmegaConf.select(cfg, key)
        if mode not in LOSS_AGG_MODES:
            errors.append(f"{key}={mode!r} is unknown; choose one of {list(LOSS_AGG_MODES)}")
    if algo.kl_ctrl.type not in ("fixed", "adaptive"):
        errors.append(f"algorithm.kl_ctrl.type={algo.kl_ctrl.type!r} is unknown; choose fixed or adaptive")
    if actor.use_kl_loss and algo.use_kl_in_reward:
        logger.warning(
            "actor_rollout_ref.actor.use_kl_loss=True and algorithm.use_kl_in_reward=True: "
            "the KL to the reference is applied twice (as a loss and as a reward penalty)"
        )
    clip_ratio_c = actor.get("clip_ratio_c", 3.0)
    if isinstance(clip_ratio_c, bool) or not isinstance(clip_ratio_c, (int, float)) or not clip_ratio_c > 1:
        errors.append(f"actor_rollout_ref.actor.clip_ratio_c={clip_ratio_c!r} must be a number > 1 (the dual-clip "
                      "bound: for a negative advantage A a token's loss is at most -A * clip_ratio_c; veRL's default 3)")
    from verl.trainer.ppo.rollout_correction import bypass_mode
    from verl.trainer.ppo.rollout_correction import config_errors as rollout_correction_errors

    correction = algo.get("rollout_correction")
    correction_errors = rollout_correction_errors(correction)
    errors.extend(correction_errors)
    bypass = not correction_errors and bypass_mode(cfg)
    # the spelling the user wrote (veRL's newer bypass_mode, or bypass_old_logprob_for_rollout)
    bypass_key = "algorithm.rollout_correction." + (
        "bypass_mode" if (correction or {}).get("bypass_mode") else "bypass_old_logprob_for_rollout")
    if bypass and cfg.do_search and not actor.state_masking:
        errors.append(f"{bypass_key}=true (bypass mode) with actor_rollout_ref.actor.state_masking=false: the "
                      "observations are then in the loss, and the engine, which did not sample them, has no log-prob of them to anchor their PPO ratio; keep "
                      "state_masking=true or turn bypass mode off")
    rollout = cfg.actor_rollout_ref.rollout
    if bypass and rollout.name == "vllm":
        from verl.workers.rollout.vllm_rollout import log_probs_mode

        if not log_probs_mode(rollout)[1]:
            errors.append(f"{bypass_key}=true (bypass mode) with vLLM sampling "
                          f"top_p={rollout.get('top_p')} / top_k={rollout.get('top_k')} at temperature "
                          f"{rollout.get('temperature')}: vLLM's log-probs are then renormalised over the kept "
                          "tokens, not the distribution the actor trains; sample with top_p=1 and top_k=-1 (or at "
                          "temperature 1), or turn bypass mode off")
    if algo.no_think_rl:
        errors.append(
            "algorithm.no_think_rl=true is not supported: the generation manager keeps the model's "
            "<think> text (token-exact rollouts); set algorithm.no_think_rl=false"
        )


def sglang_message(name: str) -> str:
    """Why `rollout.name=sglang` / `sglang_async` is refused, and the setting that gives that rollout here."""
    return (f"rollout.name={name} is not available in this project (see docs/rollout.md, 'SGLang'): use "
            "rollout.name=vllm (or hf); veRL's async agent loop corresponds to rollout.mode=async")


def _check_rollout(cfg: DictConfig, errors: list[str]) -> None:
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.name in SGLANG_NAMES:
        errors.append(sglang_message(rollout.name))
    elif rollout.name not in ROLLOUT_NAMES:
        errors.append(f"actor_rollout_ref.rollout.name={rollout.name!r} is unknown; choose one of {list(ROLLOUT_NAMES)}")
    mode = rollout.get("mode", "sync")
    if mode not in ("sync", "async"):
        errors.append(f"actor_rollout_ref.rollout.mode={mode!r} is unknown; choose 'sync' or 'async'")
    elif mode == "async" and not cfg.do_search:
        errors.append("actor_rollout_ref.rollout.mode=async runs the multi-turn search loop; with do_search=false "
                      "every row is one generate call: use mode=sync")
    if not cfg.actor_rollout_ref.hybrid_engine:
        errors.append("actor_rollout_ref.hybrid_engine=False is not supported: actor, rollout and ref share one process")
    if cfg.actor_rollout_ref.actor.state_masking and not cfg.do_search:
        logger.info("actor_rollout_ref.actor.state_masking=True with do_search=False: no observations to mask")
    _check_max_model_len(cfg, errors)
    if cfg.do_search and not tool_protocol(cfg):
        if not cfg.retriever.url and not serve_retriever(cfg):
            errors.append("do_search=true needs retriever.url")
        if int(cfg.max_turns) < 0:
            errors.append(f"max_turns={cfg.max_turns} must be >= 0")
        if int(cfg.data.max_start_length) >= int(cfg.data.max_prompt_length):
            errors.append(
                f"do_search=true needs data.max_start_length={cfg.data.max_start_length} < "
                f"data.max_prompt_length={cfg.data.max_prompt_length} (the rolling context keeps the prompt "
                "plus recent turns)"
            )


def serve_retriever(cfg: DictConfig) -> bool:
    """Whether the driver runs the retrieval server as a Ray Serve application (`retriever.serve=ray`)."""
    return cfg.retriever.get("serve") == "ray"


def _check_retriever_serve(cfg: DictConfig, errors: list[str]) -> None:
    """`retriever.serve` and its settings (the server's own flags are checked by parsing them as it will)."""
    retriever = cfg.retriever
    serve = retriever.get("serve")
    if serve not in (None, "ray"):
        errors.append(f"retriever.serve={serve!r} is unknown; choose null (a server you run at retriever.url) or ray")
        return
    if serve is None:
        return
    if not cfg.do_search:
        errors.append("retriever.serve=ray with do_search=false: nothing would call the retrieval application")
    if not retriever.server_args or not retriever.server_args.get("index_path"):
        errors.append("retriever.serve=ray needs retriever.server_args.index_path and .corpus_path (the replicas load "
                      "them on every node), e.g. +retriever.server_args.index_path=index/bm25")
    replicas = retriever.get("replicas")
    if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1):
        errors.append(f"retriever.replicas={replicas!r} must be an int >= 1 or null (one per node)")
    if int(retriever.replica_max_ongoing_requests) < 1:
        errors.append(f"retriever.replica_max_ongoing_requests={retriever.replica_max_ongoing_requests} must be >= 1")
    from search_r1.search.ray_serve import check_server_args, import_serve

    server_args = OmegaConf.to_container(retriever.server_args, resolve=True) or {}
    try:
        check_server_args(server_args)
    except ValueError as err:
        errors.append(str(err))
        server_args = None   # not a command line the replicas would start with: nothing to size
    if server_args is not None and server_args.get("faiss_gpu") and float(retriever.replica_resources.num_gpus) <= 0:
        errors.append("retriever.server_args.faiss_gpu=true needs retriever.replica_resources.num_gpus > 0: a replica "
                      "without a GPU of its own sees none (and a node whose GPUs all train has none to give)")
    elif server_args is not None:
        _check_retriever_replica_sizes(cfg, server_args, errors)
    try:
        import_serve()
    except ImportError as err:
        errors.append(str(err))
    if cfg.actor_rollout_ref.rollout.get("mode", "sync") == "sync":
        logger.warning("retriever.serve=ray with rollout.mode=sync: the driver searches for every row, so only the "
                       "replica on the driver's node answers; rollout.mode=async spreads searches over the nodes")


def _check_retriever_replica_sizes(cfg: DictConfig, server_args: dict, errors: list[str]) -> None:
    """A replica's CPUs must answer a turn's searches over a dense Flat index within retriever.timeout;
    a local run's replicas must not ask for a GPU the workers take (search_r1/search/serve_checks.py;
    on a joined cluster the driver checks the GPUs against ray.nodes() before it deploys)."""
    from search_r1.search import serve_checks

    retriever = cfg.retriever
    rollouts = rollouts_per_step(cfg)
    if cfg.actor_rollout_ref.rollout.get("mode", "sync") == "sync":
        queries, why = rollouts, (f"rollout.mode=sync: the driver sends every row's search of a turn, "
                                  f"{rollouts} rollouts, to its own node's replica")
    else:
        replicas = int(retriever.replicas) if retriever.replicas is not None else int(cfg.trainer.nnodes)
        queries = -(-rollouts // max(1, replicas))
        why = f"rollout.mode=async: {rollouts} rollouts searching at once over {replicas} replica(s)"
    error = serve_checks.replica_cpu_error(server_args, float(retriever.replica_resources.num_cpus), queries,
                                           float(retriever.timeout), why)
    if error:
        errors.append(error)
    if cluster_address(cfg) is None and float(retriever.replica_resources.num_gpus) > 0:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        on_gpu = cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto" and gpus > 0)
        # a local Ray is this machine (custom resources are the deploy's to report: it has none)
        node = serve_checks.NodeGpus("this machine (a local Ray)", float(gpus), {})
        error = serve_checks.replica_gpu_error(float(retriever.replica_resources.num_gpus), {},
                                               float(cfg.trainer.n_gpus_per_node) if on_gpu else 0.0, [node])
        if error:
            errors.append(error)


def _check_max_model_len(cfg: DictConfig, errors: list[str]) -> None:
    """vLLM's context (`rollout.max_model_len`, veRL's key) must hold the prompt and the response budget."""
    rollout = cfg.actor_rollout_ref.rollout
    value = rollout.get("max_model_len")
    if value is None:
        return
    key = "actor_rollout_ref.rollout.max_model_len"
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        errors.append(f"{key}={value!r} must be an int >= 1 or null (= prompt_length + response_length)")
        return
    need = int(rollout.prompt_length) + int(rollout.response_length)
    if need > value:
        errors.append(f"{key}={value} is shorter than a rollout's context: actor_rollout_ref.rollout.prompt_length="
                      f"{rollout.prompt_length} + response_length={rollout.response_length} = {need} tokens "
                      f"(data.max_prompt_length + data.max_response_length); raise {key} to >= {need} or set it to null")


def load_tool_config(cfg: DictConfig) -> Any:
    """The tool config of a tool-protocol run (`multi_turn.tool_config_path`, veRL's YAML), read and checked."""
    from search_r1.llm_agent.tools import load_tool_config as load

    return load(str(cfg.actor_rollout_ref.rollout.multi_turn.tool_config_path))


def retrieval_endpoint(config: DictConfig) -> tuple[str, float, str, str]:
    """(url, timeout s, the setting's name, where it is set) of the retrieval server the rollouts query:
    `retriever.url` in the tag protocol; in the tool protocol the search tool's `retrieval_service_url`
    in the tool config (`multi_turn.tool_config_path`)."""
    if tool_protocol(config):
        path = config.actor_rollout_ref.rollout.multi_turn.tool_config_path
        search = load_tool_config(config).search or {}
        return (str(search["retrieval_service_url"]), float(search.get("timeout", config.retriever.timeout)),
                "retrieval_service_url", f"retrieval_service_url in {path}")
    return str(config.retriever.url), float(config.retriever.timeout), "retriever.url", "retriever.url"


def _check_multi_turn(cfg: DictConfig, errors: list[str]) -> None:
    """`actor_rollout_ref.rollout.multi_turn.*` (veRL's keys and defaults): the tool protocol's settings."""
    from search_r1.llm_agent.tools import TOOL_FORMATS, TRUNCATE_SIDES

    prefix = "actor_rollout_ref.rollout.multi_turn"
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    if mt.format not in TOOL_FORMATS:
        errors.append(f"{prefix}.format={mt.format!r} is not supported; supported: {list(TOOL_FORMATS)} "
                      "(hermes: <tool_call>{json}</tool_call>, as Qwen2.5 writes it; qwen is its older name)")
    for key in ("max_assistant_turns", "max_user_turns"):
        value = mt.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            errors.append(f"{prefix}.{key}={value!r} must be an int >= 1 or null (no bound)")
    for key in ("max_parallel_calls", "max_tool_response_length"):
        value = mt.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            errors.append(f"{prefix}.{key}={value!r} must be an int >= 1")
    if mt.tool_response_truncate_side not in TRUNCATE_SIDES:
        errors.append(f"{prefix}.tool_response_truncate_side={mt.tool_response_truncate_side!r} is unknown; "
                      f"choose one of {list(TRUNCATE_SIDES)}")
    if not mt.enable:
        return
    if not mt.tool_config_path:
        errors.append(f"{prefix}.enable=true needs {prefix}.tool_config_path (veRL's tool YAML, e.g. "
                      "example/tool_recipe/config/tool_config/search_tool_config.yaml)")
    else:
        try:
            tool_config = load_tool_config(cfg)
        except (OSError, ValueError) as exc:
            errors.append(f"{prefix}.tool_config_path: {exc}")
        else:
            if tool_config.search is None:
                errors.append(f"{prefix}.tool_config_path={mt.tool_config_path}: configures no search tool")
    if not cfg.do_search:
        errors.append(f"{prefix}.enable=true runs the tool loop against the retrieval server, but do_search=false "
                      f"turns the search loop off: set do_search=true or {prefix}.enable=false")


def _check_data(cfg: DictConfig, errors: list[str]) -> None:
    data = cfg.data
    if data.truncation not in TRUNCATIONS:
        errors.append(f"data.truncation={data.truncation!r} is unknown; choose one of {list(TRUNCATIONS)} "
                      "(a prompt longer than the bound when data.filter_overlong_prompts=False)")
    both = {key: data.get(key) for key in ("shuffle_train_dataloader", "shuffle")}
    if None not in both.values() and bool(both["shuffle"]) != bool(both["shuffle_train_dataloader"]):
        errors.append(f"data.shuffle={both['shuffle']} and data.shuffle_train_dataloader={both['shuffle_train_dataloader']} "
                      "are one setting (veRL's and Search-R1's names) with two values: set one of them")
    for key in (*MICRO_BATCH_DEFAULTS, "critic.forward_micro_batch_size"):
        value, per_gpu = OmegaConf.select(cfg, key), OmegaConf.select(cfg, f"{key}_per_gpu")
        if value is not None and per_gpu is not None:
            errors.append(f"{key}={value} and {key}_per_gpu={per_gpu} are both set: {key} counts rows over all "
                          f"workers (Search-R1), {key}_per_gpu rows per worker (veRL); set one of them")
        elif per_gpu is not None and (isinstance(per_gpu, bool) or not isinstance(per_gpu, int) or per_gpu < 1):
            errors.append(f"{key}_per_gpu={per_gpu!r} must be an int >= 1 or null")


def unknown_key_message(key: str) -> str:
    """Why `key` is refused: not a setting of this project, with the reason for a known veRL key."""
    message = (f"{key} is not a setting of this project (verl/trainer/config/ppo_trainer.yaml declares no such "
               "key), so it would have no meaning here: remove it")
    for known, reason in VERL_KEYS_WITHOUT_MEANING.items():
        if key == known or key.startswith(known + "."):
            return f"{message} ({reason})"
    return message


@functools.cache
def _schema() -> DictConfig:
    return OmegaConf.load(SCHEMA_PATH)


def is_declared(key: str) -> bool:
    """Whether the dotted `key` is a setting of ppo_trainer.yaml (inside a free-form mapping such as
    `model.override_config` any key is), or an optional `trainer.<key>` (OPTIONAL_TRAINER_KEYS)."""
    if key.startswith("trainer.") and key.split(".", 1)[1] in OPTIONAL_TRAINER_KEYS:
        return True
    node: Any = _schema()
    for part in key.split("."):
        if isinstance(node, DictConfig) and len(node) == 0:
            return True
        if not isinstance(node, DictConfig) or part not in node:
            return False
        node = node._get_node(part)
    return True


def undeclared_keys(cfg: DictConfig) -> list[str]:
    """Dotted keys of `cfg` that ppo_trainer.yaml does not declare: appended with `+key=...`, or added
    by a recipe YAML (e.g. `--config-name` of a file whose defaults list holds ppo_trainer)."""
    found: list[str] = []

    def walk(node: DictConfig, prefix: str) -> None:
        for name in node.keys():
            key = f"{prefix}{name}"
            if not is_declared(key):
                found.append(key)
            elif isinstance(node._get_node(name), DictConfig) and not OmegaConf.is_interpolation(node, name):
                walk(node._get_node(name), key + ".")

    walk(cfg, "")
    return found


_OVERRIDE = re.compile(r"^(?P<prefix>\+{0,2})(?P<key>[A-Za-z_][\w-]*(?:\.[\w-]+)*)=(?P<value>.*)$", re.DOTALL)


def normalize_overrides(overrides: Sequence[str]) -> list[str]:
    """Command-line overrides as Hydra composes them here.

    The optional trainer keys (OPTIONAL_TRAINER_KEYS) are not declared in the YAML (DESIGN 3.4),
    so the original's `+trainer.val_before_train=...` appends them; veRL's recipes write
    `trainer.val_before_train=...` without `+`. Both forms (and `++`) become one `++trainer.<key>=`
    (add or override), the last value winning as for any other key. Everything else is unchanged.
    """
    out: list[str] = []
    last: dict[str, int] = {}
    for arg in overrides:
        match = _OVERRIDE.match(arg)
        key = match["key"] if match else ""
        if key.startswith("trainer.") and key.split(".", 1)[1] in OPTIONAL_TRAINER_KEYS:
            if key in last:
                out[last[key]] = ""
            last[key] = len(out)
            out.append(f"++{key}={match['value']}")
        else:
            out.append(arg)
    return [arg for arg in out if arg != ""]


def check_override_keys(overrides: Sequence[str]) -> None:
    """Refuse a plain `key=value` override of a key ppo_trainer.yaml does not declare, with a message
    saying it has no meaning here (Hydra's own would suggest appending it with `+`, which would then be
    refused by `config_errors` anyway). Hydra's own keys (`hydra.*`) pass."""
    errors = []
    for arg in overrides:
        match = _OVERRIDE.match(arg)
        if match and not match["prefix"] and not match["key"].startswith("hydra.") and not is_declared(match["key"]):
            errors.append(unknown_key_message(match["key"]))
    if errors:
        raise ConfigError("invalid trainer config:\n  - " + "\n  - ".join(errors))


def _check_tensor_parallel(cfg: DictConfig, errors: list[str], has_gpu: bool | None) -> None:
    """vLLM tensor parallelism: a TP group is TP consecutive workers of one node, inside one engine.

    The rollout then splits rows over world_size / TP data-parallel groups.
    """
    rollout = cfg.actor_rollout_ref.rollout
    key = "actor_rollout_ref.rollout.tensor_model_parallel_size"
    tp = rollout.tensor_model_parallel_size
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        errors.append(f"{key}={tp!r} must be an int >= 1")
        return
    if tp == 1:
        return
    ws, per_node = rollout_world_size(cfg), int(cfg.trainer.n_gpus_per_node)
    if ws % tp != 0:
        where = "trainer.rollout_pool" if pipelined(cfg) else "the world size trainer.nnodes*trainer.n_gpus_per_node"
        errors.append(f"{key}={tp} must divide {where}={ws}")
    if per_node % tp != 0:
        errors.append(f"{key}={tp} must divide trainer.n_gpus_per_node={per_node} (a TP group must not span nodes)")
    if rollout.name == "hf":
        errors.append(f"{key}={tp} needs the vLLM rollout; actor_rollout_ref.rollout.name=hf runs one HF "
                      "generate loop per worker: set actor_rollout_ref.rollout.name=vllm or "
                      f"{key}=1")
    elif rollout.name == "auto" and runs_on_cuda(cfg, has_gpu) is False:
        errors.append(f"{key}={tp} needs the vLLM rollout, but actor_rollout_ref.rollout.name=auto is the HF "
                      f"loop on a run without GPUs: set actor_rollout_ref.rollout.name=vllm or {key}=1")
    if rollout.get("mode", "sync") == "async":
        errors.append(f"actor_rollout_ref.rollout.mode=async with {key}={tp}: {ASYNC_TP_MESSAGE}")


def _check_retriever(cfg: DictConfig, errors: list[str]) -> None:
    retriever = cfg.retriever
    fraction = retriever.max_failure_fraction
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 <= fraction <= 1:
        errors.append(f"retriever.max_failure_fraction={fraction!r} must be a number in [0, 1] "
                      "(the share of a rollout's searches that may fail; 1.0 never stops the run)")
    wait = retriever.health_wait_s
    if isinstance(wait, bool) or not isinstance(wait, int | float) or wait < 0:
        errors.append(f"retriever.health_wait_s={wait!r} must be a number of seconds >= 0")
    _check_retriever_serve(cfg, errors)


def logger_backends(cfg: DictConfig) -> list[str]:
    """`trainer.logger` as a list (a single name is accepted too)."""
    value = cfg.trainer.logger
    return [value] if isinstance(value, str) else [str(name) for name in value]


def runs_on_cuda(cfg: DictConfig, has_gpu: bool | None) -> bool | None:
    """Whether the workers train on CUDA: `trainer.device` decides, or with `auto` whether the
    workers' host has GPUs (`has_gpu`; None when not known, e.g. validating on another machine)."""
    device = cfg.trainer.device
    if device == "cuda":
        return True
    if device == "cpu":
        return False
    return has_gpu


def is_installed(module: str) -> bool:
    """Whether `module` can be imported, found without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _check_imports(cfg: DictConfig, errors: list[str], has_gpu: bool | None) -> None:
    """Optional packages the run will import, found now instead of after minutes of start-up."""
    for name in logger_backends(cfg):
        if name in LOGGER_PACKAGES:
            module, install = LOGGER_PACKAGES[name]
            if not is_installed(module):
                errors.append(f"trainer.logger contains {name!r} but the {module} package is not installed: "
                              f"`{install}`, or drop {name!r} from trainer.logger")
    name = cfg.actor_rollout_ref.rollout.name
    on_cuda = runs_on_cuda(cfg, has_gpu)
    if not is_installed("vllm"):
        if name == "vllm":
            from verl.workers.rollout.vllm_rollout import MISSING_VLLM

            errors.append(MISSING_VLLM)
        elif name == "auto" and on_cuda:
            errors.append("actor_rollout_ref.rollout.name=auto is the vLLM rollout on a GPU run, but vllm is not "
                          "installed: `pip install -e .[gpu]`, or set actor_rollout_ref.rollout.name=hf to roll "
                          "out with the (much slower) HF generate loop")
    if on_cuda and not is_installed("flash_attn"):
        keys = ["actor_rollout_ref.model.use_remove_padding"] + (["critic.model.use_remove_padding"]
                                                                 if need_critic(cfg) else [])
        for key in keys:
            if OmegaConf.select(cfg, key):
                errors.append(f"{key}=True on CUDA packs sequences with flash-attn, which is not installed: "
                              f"`{FLASH_ATTN_INSTALL}` (docs/training.md), or set {key}=False")


def _check_trainer(cfg: DictConfig, errors: list[str]) -> None:
    trainer = cfg.trainer
    for name in logger_backends(cfg):
        if name not in LOGGERS:
            errors.append(f"trainer.logger contains unknown backend {name!r}; choose from {list(LOGGERS)}")
    if trainer.device not in ("auto", "cuda", "cpu"):
        errors.append(f"trainer.device={trainer.device!r} is unknown; choose auto, cuda or cpu")
    if trainer.total_training_steps is not None and int(trainer.total_training_steps) < 1:
        errors.append(f"trainer.total_training_steps={trainer.total_training_steps} must be >= 1 or null")
    if int(trainer.max_ckpt_to_keep) < 1:
        errors.append(f"trainer.max_ckpt_to_keep={trainer.max_ckpt_to_keep} must be >= 1")
    if cfg.reward_model.enable:
        errors.append("reward_model.enable=True (a model-based reward) is not supported; the reward is rule-based")
    for key, default in OPTIONAL_TRAINER_KEYS.items():
        value = trainer_flag(cfg, key)
        if not isinstance(value, type(default)):
            errors.append(f"trainer.{key}={value!r} must be a {type(default).__name__}")


def validate_config(cfg: DictConfig, has_gpu: bool | None = None) -> None:
    """Raise ConfigError listing every contradiction found, each naming its keys, and every
    optional package the run needs that is not installed, with its pip command.

    `has_gpu`: whether the workers' host has GPUs (with `trainer.device=auto`); None when not
    known, which skips the checks that depend on it. Also switches struct mode on, so reading
    or setting an undeclared key fails.
    """
    errors = config_errors(cfg, has_gpu)
    if errors:
        raise ConfigError("invalid trainer config:\n  - " + "\n  - ".join(errors))


def config_errors(cfg: DictConfig, has_gpu: bool | None = None) -> list[str]:
    """What `validate_config` finds wrong, one message per problem (empty when the config is valid)."""
    OmegaConf.set_struct(cfg, True)
    errors: list[str] = [unknown_key_message(key) for key in undeclared_keys(cfg)]
    # The pools first: every later division reads their sizes.
    pipeline_errors: list[str] = []
    _check_pipeline(cfg, pipeline_errors)
    if pipeline_errors:
        return errors + pipeline_errors
    _check_data(cfg, errors)
    _check_algorithm(cfg, errors)
    _check_rollout(cfg, errors)
    _check_multi_turn(cfg, errors)
    _check_tensor_parallel(cfg, errors, has_gpu)
    _check_retriever(cfg, errors)
    _check_trainer(cfg, errors)
    _check_batch_sizes(cfg, errors)
    _check_imports(cfg, errors, has_gpu)
    return errors


def check_runtime(cfg: DictConfig, has_gpu: bool) -> None:
    """What this machine must offer for `cfg` once `rollout.name` is resolved; raises ConfigError
    naming the key."""
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.name == "vllm" and importlib.util.find_spec("vllm") is None:
        from verl.workers.rollout.vllm_rollout import MISSING_VLLM

        raise ConfigError(MISSING_VLLM)
    if int(rollout.tensor_model_parallel_size) > 1 and rollout.name != "vllm":
        raise ConfigError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={rollout.tensor_model_parallel_size} "
                          f"needs the vLLM rollout, but actor_rollout_ref.rollout.name resolved to {rollout.name!r}")
    if cfg.trainer.device == "cuda" and not has_gpu:
        raise ConfigError("trainer.device=cuda but no CUDA GPU is visible")


def cluster_address(config: DictConfig) -> str | None:
    """The Ray cluster to join: `trainer.ray_address` ("auto" or host:port), else `RAY_ADDRESS`,
    else None (start a local Ray)."""
    address = config.trainer.ray_address or os.environ.get("RAY_ADDRESS") or None
    return str(address) if address is not None else None


def check_cluster_settings(config: DictConfig) -> None:
    """Reject cluster settings that cannot work, naming the key, before anything starts."""
    wait = config.trainer.get("ray_wait_s")
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or wait < 0:
        raise ValueError(f"trainer.ray_wait_s must be a number of seconds >= 0, got {wait!r}")
    nnodes = config.trainer.nnodes
    if isinstance(nnodes, bool) or not isinstance(nnodes, int) or nnodes < 1:
        raise ValueError(f"trainer.nnodes must be an int >= 1, got {nnodes!r}")
    if nnodes > 1 and cluster_address(config) is None:
        raise ValueError(
            f"trainer.nnodes={nnodes} needs a Ray cluster of {nnodes} nodes, but trainer.ray_address is null "
            "and RAY_ADDRESS is unset (a local Ray is one node): start the cluster (docs/multinode.md) and "
            "pass trainer.ray_address=auto or host:port")
