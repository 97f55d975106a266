"""Config rules of the policy loss (actor_rollout_ref.actor.policy_loss, clip_ratio_low / _high,
tau_pos / tau_neg, loss_scale_factor) and the loader of custom_algorithms.path; part of
`verl.trainer.config_check`'s rules. Free of torch, as config_check is.

One rule also fills a default in place (as the loader makes its path absolute): a null
`actor.loss_scale_factor` under seq-mean-token-sum-norm becomes the run's response length bound
(`resolve_loss_scale_factor`), so Dr. GRPO's divisor is one constant for the whole run."""

from __future__ import annotations

import logging
import os

from omegaconf import DictConfig, OmegaConf

from verl.trainer.run_config import RunConfig

logger = logging.getLogger(__name__)

LOSS_MODE_KEY = "actor_rollout_ref.actor.policy_loss.loss_mode"
# loss modes whose value ignores actor.loss_agg_mode (veRL's), and the loss_agg_mode that aggregates
# as they do (geo_mean: a mean over rows of a per-row value, weighed by row share as seq-mean-token-mean)
FIXED_AGGREGATION = {"gspo": "seq-mean-token-mean", "sapo": "seq-mean-token-mean", "geo_mean": "seq-mean-token-mean"}
SUM_NORM = "seq-mean-token-sum-norm"


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def load_custom_algorithms(cfg: DictConfig) -> list[str]:
    """Import the file named by custom_algorithms.path (its path made absolute in `cfg`, so the
    workers read the file the driver read), registering its policy losses and advantage
    estimators before the rules check loss_mode / adv_estimator. -> the problems found."""
    from verl.trainer.ppo.registry import CUSTOM_ALGORITHMS_KEY
    from verl.trainer.ppo.registry import load_custom_algorithms as load

    path = OmegaConf.select(cfg, CUSTOM_ALGORITHMS_KEY)
    if not path:
        return []
    absolute = os.path.abspath(os.path.expanduser(str(path)))
    if absolute != path:
        OmegaConf.update(cfg, CUSTOM_ALGORITHMS_KEY, absolute, force_add=False)
    try:
        load(absolute)
    except (OSError, ImportError) as err:
        return [str(err)]
    return []


def resolve_loss_scale_factor(cfg: DictConfig) -> int | None:
    """With loss_agg_mode=seq-mean-token-sum-norm and loss_scale_factor null (the actor's, and the critic's
    value loss), set the factor (in `cfg`) to the widest padded response the run can produce
    (memory_plan.response_length_bound: data.max_response_length, or (max_turns + 1) turns and max_turns
    observations with <search> tags). The divisor must not move between steps: the padded width a
    micro-batch has is its step's longest row, so the fallback of agg_loss (loss_mask.shape[-1]) would
    rescale every row's gradient with one long row elsewhere in the batch. -> the value set, None when
    nothing was."""
    from verl.utils.memory_plan import response_length_bound

    bound = None
    for prefix in ("actor_rollout_ref.actor", "critic"):
        node = OmegaConf.select(cfg, prefix)
        if node is None or node.get("loss_agg_mode", "token-mean") != SUM_NORM \
                or node.get("loss_scale_factor") is not None:
            continue
        bound = response_length_bound(cfg)
        OmegaConf.update(cfg, f"{prefix}.loss_scale_factor", bound, force_add=True)
        logger.info("%s.loss_scale_factor=null with loss_agg_mode=%s: set to %d, the run's response length "
                    "bound (constant across steps)", prefix, SUM_NORM, bound)
    return bound


def check_policy_loss(cfg: DictConfig, run: RunConfig, has_gpu: bool | None) -> list[str]:
    from verl.trainer.ppo.registry import BUILTIN_POLICY_LOSSES, POLICY_LOSS_REGISTRY

    errors: list[str] = []
    actor = cfg.actor_rollout_ref.actor
    node = actor.get("policy_loss") or {}
    mode = node.get("loss_mode", "vanilla")
    choices = sorted(set(BUILTIN_POLICY_LOSSES) | set(POLICY_LOSS_REGISTRY))
    if mode not in choices:
        errors.append(f"{LOSS_MODE_KEY}={mode!r} is unknown; choose one of {choices} (or register your own "
                      "in the file named by custom_algorithms.path)")
    for key in ("clip_ratio_low", "clip_ratio_high"):
        value = actor.get(key)
        if value is not None and (not _number(value) or value < 0):
            errors.append(f"actor_rollout_ref.actor.{key}={value!r} must be a number >= 0 (null: clip_ratio)")
    for key in ("clip_cov_ratio", "kl_cov_ratio"):
        value = node.get(key)
        if value is not None and (not _number(value) or not 0 < value <= 1):
            errors.append(f"actor_rollout_ref.actor.policy_loss.{key}={value!r} must be in (0, 1] (a share of tokens)")
    low, high = node.get("clip_cov_lb"), node.get("clip_cov_ub")
    if _number(low) and _number(high) and not low < high:
        errors.append(f"actor_rollout_ref.actor.policy_loss.clip_cov_lb={low!r} must be < clip_cov_ub={high!r}")
    coef = node.get("ppo_kl_coef")
    if coef is not None and (not _number(coef) or coef < 0):
        errors.append(f"actor_rollout_ref.actor.policy_loss.ppo_kl_coef={coef!r} must be a number >= 0")
    for key in ("tau_pos", "tau_neg", "loss_scale_factor"):
        value = actor.get(key)
        if value is not None and (not _number(value) or not value > 0):
            errors.append(f"actor_rollout_ref.actor.{key}={value!r} must be a number > 0")
    if mode == "geo_mean" and cfg.algorithm.adv_estimator == "gae":
        errors.append(f"{LOSS_MODE_KEY}=geo_mean needs one advantage per sequence (GMPO averages a row's "
                      "advantages); algorithm.adv_estimator=gae gives per-token advantages: use an outcome "
                      "estimator (grpo, rloo, reinforce_plus_plus) or another loss_mode")
    agg_mode = actor.get("loss_agg_mode", "token-mean")
    if mode in FIXED_AGGREGATION and agg_mode != FIXED_AGGREGATION[mode]:
        # the default token-mean too: it is ignored by the policy term just as much as any other mode
        logger.warning("%s=%s aggregates its policy term as %s whatever loss_agg_mode says; "
                       "actor_rollout_ref.actor.loss_agg_mode=%s applies to the entropy and KL terms only "
                       "(set it to %s to aggregate every term alike)", LOSS_MODE_KEY, mode, FIXED_AGGREGATION[mode],
                       agg_mode, FIXED_AGGREGATION[mode])
    if not errors:
        resolve_loss_scale_factor(cfg)
    return errors
