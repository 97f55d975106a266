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

from omegaconf import DictConfig, OmegaConf

logger = logging.getLogger(__name__)

ADV_ESTIMATORS = ("gae", "grpo", "reinforce_plus_plus", "rloo")
ROLLOUT_NAMES = ("hf", "vllm")
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
    ws = world_size(cfg)
    ws_key = "trainer.nnodes*trainer.n_gpus_per_node"
    n_agent = int(cfg.actor_rollout_ref.rollout.n_agent)
    if n_agent < 1:
        errors.append(f"actor_rollout_ref.rollout.n_agent={n_agent} must be >= 1")
        return
    if ws < 1:
        errors.append(f"{ws_key}={ws} must be >= 1")
        return
    batch = int(cfg.data.train_batch_size)
    rollouts = batch * n_agent
    _divides(errors, "rollouts per step", rollouts, "data.train_batch_size*rollout.n_agent", ws, ws_key)

    actor = cfg.actor_rollout_ref.actor
    mini = int(actor.ppo_mini_batch_size)
    if mini > batch or batch % max(mini, 1) != 0:
        errors.append(
            f"data.train_batch_size={batch} must be a multiple of actor_rollout_ref.actor.ppo_mini_batch_size={mini} "
            f"(train_batch_size*n_agent={rollouts} is split into mini-batches of ppo_mini_batch_size*n_agent={mini * n_agent})"
        )
    _divides(errors, "actor mini-batch per worker", mini * n_agent,
             "actor_rollout_ref.actor.ppo_mini_batch_size*rollout.n_agent", ws, ws_key)
    if not actor.use_dynamic_bsz:
        _check_micro_batch(errors, "actor", "actor_rollout_ref.actor", mini * n_agent,
                           int(actor.ppo_micro_batch_size), ws, ws_key)
        for key in ("actor_rollout_ref.rollout.log_prob_micro_batch_size", "actor_rollout_ref.ref.log_prob_micro_batch_size"):
            _divides(errors, "log-prob micro-batch per worker", int(OmegaConf.select(cfg, key)), key, ws, ws_key)

    if need_critic(cfg):
        critic = cfg.critic
        cmini = int(critic.ppo_mini_batch_size)
        if cmini > batch or batch % max(cmini, 1) != 0:
            errors.append(f"data.train_batch_size={batch} must be a multiple of critic.ppo_mini_batch_size={cmini}")
        _divides(errors, "critic mini-batch per worker", cmini * n_agent, "critic.ppo_mini_batch_size*rollout.n_agent", ws, ws_key)
        if not critic.use_dynamic_bsz:
            _check_micro_batch(errors, "critic", "critic", cmini * n_agent, int(critic.ppo_micro_batch_size), ws, ws_key)


def _check_micro_batch(errors: list[str], who: str, prefix: str, mini_rollouts: int, micro: int,
                       ws: int, ws_key: str) -> None:
    """`{prefix}.ppo_micro_batch_size` fits in the mini-batch and splits evenly over the workers."""
    mini_key, micro_key = f"{prefix}.ppo_mini_batch_size", f"{prefix}.ppo_micro_batch_size"
    if micro > mini_rollouts:
        errors.append(f"{micro_key}={micro} is larger than the mini-batch {mini_key}*rollout.n_agent={mini_rollouts}")
    _divides(errors, f"{who} micro-batch per worker", micro, micro_key, ws, ws_key)
    if micro <= mini_rollouts and micro % ws == 0 and mini_rollouts % ws == 0:
        _divides(errors, f"{who} mini-batch per worker", mini_rollouts // ws,
                 f"{mini_key}*rollout.n_agent/world_size", micro // ws, f"{micro_key}/world_size")


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
    if actor.loss_agg_mode not in LOSS_AGG_MODES:
        errors.append(f"actor_rollout_ref.actor.loss_agg_mode={actor.loss_agg_mode!r} is unknown; choose one of {list(LOSS_AGG_MODES)}")
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
    if cfg.actor_rollout_ref.rollout.name == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError(
                "actor_rollout_ref.rollout.name=vllm but the vllm package is not installed "
                "(pip install vllm on a GPU machine, or set actor_rollout_ref.rollout.name=hf)"
            )
        if not has_gpu:
            raise ConfigError("actor_rollout_ref.rollout.name=vllm needs a GPU; on CPU set actor_rollout_ref.rollout.name=hf")
    if cfg.trainer.device == "cuda" and not has_gpu:
        raise ConfigError("trainer.device=cuda but no CUDA GPU is visible")
