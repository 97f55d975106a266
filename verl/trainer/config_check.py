"""Start-up checks of the composed trainer config.

`validate_config(cfg)` runs once, before any worker is built, so a contradiction in
the command line fails in a second with a message naming the keys instead of an
hour later inside a worker. `check_runtime(cfg)` checks what the machine offers
(vLLM installed, GPUs present); it is separate so configs written for a GPU cluster
can still be validated on a laptop.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

logger = logging.getLogger(__name__)

ADV_ESTIMATORS = ("gae", "grpo", "reinforce_plus_plus", "rloo")
ROLLOUT_NAMES = ("auto", "hf", "vllm")
LOGGERS = ("console", "jsonl", "wandb", "tensorboard")
KL_TYPES = ("kl", "abs", "mse", "low_var_kl")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")

# Keys users append with `+trainer.<key>=...`; not declared in the YAML, read with these defaults.
OPTIONAL_TRAINER_KEYS: dict[str, Any] = {"val_only": False, "val_before_train": True}


class ConfigError(ValueError):
    """A contradiction or an unsupported value in the trainer config."""


def trainer_flag(cfg: DictConfig, key: str) -> Any:
    """Read an optional `trainer.<key>` (see OPTIONAL_TRAINER_KEYS) with its default."""
    if key not in OPTIONAL_TRAINER_KEYS:
        raise KeyError(f"trainer.{key} is not an optional trainer key; known: {sorted(OPTIONAL_TRAINER_KEYS)}")
    return OmegaConf.select(cfg, f"trainer.{key}", default=OPTIONAL_TRAINER_KEYS[key])


def world_size(cfg: DictConfig) -> int:
    """Worker processes: GPUs in total, or on a CPU-only machine the number of CPU workers."""
    return int(cfg.trainer.nnodes) * int(cfg.trainer.n_gpus_per_node)


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
    ws_key = "trainer.nnodes*trainer.n_gpus_per_node"
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
    if not actor.use_dynamic_bsz:
        _check_micro_batch(errors, "actor", "actor_rollout_ref.actor", mini_batch_rollouts(cfg, "actor"),
                           int(actor.ppo_micro_batch_size), ws, ws_key)
        for key in ("actor_rollout_ref.rollout.log_prob_micro_batch_size", "actor_rollout_ref.ref.log_prob_micro_batch_size"):
            _divides(errors, "log-prob micro-batch per worker", int(OmegaConf.select(cfg, key)), key, ws, ws_key)

    if need_critic(cfg):
        critic = cfg.critic
        _check_mini_batch(errors, "critic", "critic", int(critic.ppo_mini_batch_size),
                          "critic.rollout_n", int(critic.get("rollout_n", 1)), rollouts, rollouts_key, ws, ws_key)
        if not critic.use_dynamic_bsz:
            _check_micro_batch(errors, "critic", "critic", mini_batch_rollouts(cfg, "critic"),
                               int(critic.ppo_micro_batch_size), ws, ws_key)
            _divides(errors, "critic forward micro-batch per worker", int(critic.forward_micro_batch_size),
                     "critic.forward_micro_batch_size", ws, ws_key)


def _check_mini_batch(errors: list[str], who: str, prefix: str, size: int, n_key: str, n: int, rollouts: int,
                      rollouts_key: str, ws: int, ws_key: str) -> None:
    """The mini-batch (size * n rollouts) fits in and divides the step's rollouts, and splits over the workers."""
    mini, mini_key = size * n, f"{prefix}.ppo_mini_batch_size*{n_key}"
    if mini < 1 or mini > rollouts or rollouts % mini != 0:
        errors.append(f"{prefix}.ppo_mini_batch_size={size} (x {n_key}={n}): a mini-batch of {mini} rollouts must "
                      f"divide {rollouts_key}={rollouts} (ppo_mini_batch_size counts rollouts, see docs/training.md)")
    _divides(errors, f"{who} mini-batch per worker", mini, mini_key, ws, ws_key)


def _check_micro_batch(errors: list[str], who: str, prefix: str, mini_rollouts: int, micro: int,
                       ws: int, ws_key: str) -> None:
    """`{prefix}.ppo_micro_batch_size` (rows) fits in the mini-batch and splits evenly over the workers."""
    micro_key = f"{prefix}.ppo_micro_batch_size"
    if micro > mini_rollouts:
        errors.append(f"{micro_key}={micro} is larger than the mini-batch of {mini_rollouts} rollouts")
    _divides(errors, f"{who} micro-batch per worker", micro, micro_key, ws, ws_key)
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
    if algo.no_think_rl:
        errors.append(
            "algorithm.no_think_rl=true is not supported: the generation manager keeps the model's "
            "<think> text (token-exact rollouts); set algorithm.no_think_rl=false"
        )


def _check_rollout(cfg: DictConfig, errors: list[str]) -> None:
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.name not in ROLLOUT_NAMES:
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
    if cfg.do_search:
        if not cfg.retriever.url:
            errors.append("do_search=true needs retriever.url")
        if int(cfg.max_turns) < 0:
            errors.append(f"max_turns={cfg.max_turns} must be >= 0")
        if int(cfg.data.max_start_length) >= int(cfg.data.max_prompt_length):
            errors.append(
                f"do_search=true needs data.max_start_length={cfg.data.max_start_length} < "
                f"data.max_prompt_length={cfg.data.max_prompt_length} (the rolling context keeps the prompt "
                "plus recent turns)"
            )


def _check_trainer(cfg: DictConfig, errors: list[str]) -> None:
    trainer = cfg.trainer
    loggers = [trainer.logger] if isinstance(trainer.logger, str) else list(trainer.logger)
    for name in loggers:
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


def validate_config(cfg: DictConfig) -> None:
    """Raise ConfigError listing every contradiction found, each naming its keys.

    Also switches struct mode on, so reading or setting an undeclared key fails.
    """
    OmegaConf.set_struct(cfg, True)
    errors: list[str] = []
    _check_algorithm(cfg, errors)
    _check_rollout(cfg, errors)
    _check_trainer(cfg, errors)
    _check_batch_sizes(cfg, errors)
    if errors:
        raise ConfigError("invalid trainer config:\n  - " + "\n  - ".join(errors))


def check_runtime(cfg: DictConfig, has_gpu: bool) -> None:
    """What this machine must offer for `cfg`; raises ConfigError naming the key."""
    if cfg.actor_rollout_ref.rollout.name == "vllm" and importlib.util.find_spec("vllm") is None:
        from verl.workers.rollout.vllm_rollout import MISSING_VLLM

        raise ConfigError(MISSING_VLLM)
    if cfg.trainer.device == "cuda" and not has_gpu:
        raise ConfigError("trainer.device=cuda but no CUDA GPU is visible")
