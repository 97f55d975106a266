"""PPO / GRPO / REINFORCE++ / RLOO algorithm core: advantages, losses, KL.

The advantage estimators register under their `algorithm.adv_estimator` names (registry.py); the
four here, the others in advantage_estimators.py; `compute_advantage` calls the registered one.

veRL's import path holds here too: `register_policy_loss`, `get_policy_loss_fn`, `register_adv_est`,
`get_adv_estimator_fn` (registry.py's), `agg_loss` (veRL's keywords) and `kl_penalty` import from
this module, so a custom-loss file written for veRL loads unchanged (custom_algorithms.path).

Names and signatures follow veRL (DESIGN §3.5). One departure from the
original Search-R1: every function here honours `response_mask` as THE mask
(1 = token the policy sampled). In particular GAE runs over policy tokens
only -- an observation span (retrieved passage, invalid-action notice) between
two policy tokens is not a step of the trajectory, so the next value and the
running advantage carry across it unchanged.

Shapes: B = rows, R = response length, V = vocabulary.
"""

from __future__ import annotations

import inspect
import logging
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf

from verl.trainer.ppo import policy_losses  # registers the built-in policy losses
from verl.trainer.ppo.policy_losses import DEFAULT_CLIP_RATIO_C, LOG_RATIO_CLAMP  # noqa: F401  (re-exported)
from verl.trainer.ppo.registry import (  # noqa: F401  (re-exported: veRL's import path, module docstring)
    get_adv_estimator_fn,
    get_policy_loss_fn,
    register_adv_est,
    register_policy_loss,
)
from verl.utils import torch_functional as tf

logger = logging.getLogger(__name__)

# today's four, registered below; every registered name: registry.adv_estimator_names()
ADV_ESTIMATORS = ("gae", "grpo", "reinforce_plus_plus", "rloo")
KL_PENALTY_TYPES = ("kl", "abs", "mse", "low_var_kl")
KL_LOG_RATIO_CLAMP = 20.0   # low_var_kl: |log q - log p| bound before the exp (veRL's)


# --------------------------------------------------------------------------- KL controllers
class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt; kept so both controllers share one interface."""


class AdaptiveKLController:
    """Ziegler et al. (2019) proportional controller: moves beta so the KL tracks `target_kl`."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if horizon <= 0:
            raise ValueError(f"algorithm.kl_ctrl.horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """beta *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon."""
        proportional_error = float(np.clip(float(current_kl) / self.target - 1.0, -0.2, 0.2))
        self.value *= 1.0 + proportional_error * n_steps / self.horizon


def get_kl_controller(kl_ctrl_config: Any) -> FixedKLController | AdaptiveKLController:
    """Build the controller described by the `algorithm.kl_ctrl` config node."""
    kind = kl_ctrl_config.get("type", "fixed")
    if kind == "fixed":
        return FixedKLController(kl_coef=kl_ctrl_config.get("kl_coef"))
    if kind == "adaptive":
        return AdaptiveKLController(
            init_kl_coef=kl_ctrl_config.get("kl_coef"),
            target_kl=kl_ctrl_config.get("target_kl"),
            horizon=kl_ctrl_config.get("horizon"),
        )
    raise ValueError(f"unknown algorithm.kl_ctrl.type {kind!r}; expected 'fixed' or 'adaptive'")


# --------------------------------------------------------------------------- advantages
def _gae_unwhitened(token_level_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor,
                    gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw GAE advantages and returns, (B, R) each, zero where the mask is 0.

    Backward recursion over policy tokens only; at a masked-out position the
    carried `next_value` and `last_gae` pass through untouched, so the result
    equals GAE over the sequence with every observation span removed. Rewards
    sitting on masked-out positions are ignored (the reward manager and the KL
    penalty only ever write onto policy tokens).
    """
    batch, length = token_level_rewards.shape
    mask = response_mask.bool()
    advantages = torch.zeros_like(token_level_rewards)
    next_value = torch.zeros(batch, dtype=values.dtype, device=values.device)
    last_gae = torch.zeros(batch, dtype=values.dtype, device=values.device)
    for t in reversed(range(length)):
        on_policy = mask[:, t]
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * last_gae
        last_gae = torch.where(on_policy, gae, last_gae)
        next_value = torch.where(on_policy, values[:, t], next_value)
        advantages[:, t] = torch.where(on_policy, gae, torch.zeros_like(gae))
    returns = (advantages + values) * mask.to(values.dtype)
    return advantages, returns


def _kept(response_mask: torch.Tensor, kept_mask: torch.Tensor | None) -> torch.Tensor:
    """The tokens the losses keep (response_mask after rollout-correction rejection and the
    cut-context mask), as a float mask; None: all of `response_mask`."""
    return (response_mask if kept_mask is None else kept_mask).float()


@register_adv_est("gae")
def compute_gae_advantage_return(token_level_rewards: torch.Tensor, values: torch.Tensor,
                                 response_mask: torch.Tensor, gamma: float, lam: float,
                                 kept_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over policy tokens, whitened over the kept tokens.  -> (advantages_BR, returns_BR)

    The recursion runs over `response_mask`, the trajectory as sampled, so a rejected token is
    still a step and an outcome reward on it still reaches the tokens before it; the whitening
    statistics come from `kept_mask` (None: `response_mask`) only, so a token out of the loss
    does not move the advantages of the kept ones. Both outputs are 0 outside `kept_mask`."""
    with torch.no_grad():
        advantages, returns = _gae_unwhitened(token_level_rewards, values, response_mask, gamma, lam)
        kept = _kept(response_mask, kept_mask).to(advantages.dtype)
        advantages = tf.masked_whiten(advantages, kept) * kept
    return advantages, returns * kept


def _group_rows(index: np.ndarray, rows_kept: torch.Tensor) -> dict[Any, list[int]]:
    """Rows per uid, the rows with a kept token only."""
    groups: dict[Any, list[int]] = defaultdict(list)
    for row, uid in enumerate(index):
        if bool(rows_kept[row]):
            groups[uid].append(row)
    return groups


def _check_index(index: np.ndarray, batch: int) -> None:
    if len(index) != batch:
        raise ValueError(f"non-tensor key 'uid' (GRPO/RLOO group index) has {len(index)} rows, batch has {batch}")


@register_adv_est("grpo")
def compute_grpo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                   index: np.ndarray, epsilon: float = 1e-6,
                                   norm_adv_by_std_in_grpo: bool = True,
                                   kept_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-normalised outcome advantage: (score - group mean) / (group std + eps) on every kept token.

    `index` holds a per-prompt uid for each row, so rows sampled from the same
    prompt form one group. A group of one has mean 0 and std 1 (its advantage
    is its raw score). std is the unbiased sample std, as in veRL / DeepSeekMath.
    A row with no token in `kept_mask` (None: `response_mask`; a row rejected whole by the
    rollout correction) is not a member of its group: its score moves no other row's advantage.
    """
    scores = token_level_rewards.sum(dim=-1)
    _check_index(index, scores.shape[0])
    kept = _kept(response_mask, kept_mask).to(scores.dtype)
    with torch.no_grad():
        normalised = torch.zeros_like(scores)
        for rows in _group_rows(index, kept.sum(-1) > 0).values():
            group = scores[rows]
            if len(rows) == 1:
                mean, std = 0.0, 1.0
            else:
                mean, std = group.mean(), group.std()
            centred = group - mean
            normalised[rows] = centred / (std + epsilon) if norm_adv_by_std_in_grpo else centred
        advantages = normalised.unsqueeze(-1) * kept
    return advantages, advantages


@register_adv_est("rloo")
def compute_rloo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                   index: np.ndarray,
                                   kept_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Leave-one-out baseline: score_i - mean of the other scores in its group (a group of one: score_i).
    Group members are the rows with a token in `kept_mask` (None: `response_mask`), as in GRPO."""
    scores = token_level_rewards.sum(dim=-1)
    _check_index(index, scores.shape[0])
    kept = _kept(response_mask, kept_mask).to(scores.dtype)
    with torch.no_grad():
        baselined = scores.clone()
        for rows in _group_rows(index, kept.sum(-1) > 0).values():
            n = len(rows)
            if n > 1:
                group = scores[rows]
                baselined[rows] = group - (group.sum() - group) / (n - 1)
        advantages = baselined.unsqueeze(-1) * kept
    return advantages, advantages


@register_adv_est("reinforce_plus_plus")
def compute_reinforce_plus_plus_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                                  gamma: float | None = None, kept_mask: torch.Tensor | None = None,
                                                  config: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Discounted return-to-go over policy tokens (observation spans skipped), whitened over the kept
    tokens (`kept_mask`, None: `response_mask`; the recursion runs over `response_mask`, as GAE's).
    `gamma` None: the algorithm config's (veRL passes only `config`), else 1."""
    if gamma is None:
        gamma = float(config.get("gamma", 1.0)) if config is not None else 1.0
    with torch.no_grad():
        returns = torch.zeros_like(token_level_rewards)
        running = torch.zeros(token_level_rewards.shape[0], dtype=returns.dtype, device=returns.device)
        for t in reversed(range(token_level_rewards.shape[1])):
            on_policy = response_mask[:, t].bool()
            running = torch.where(on_policy, token_level_rewards[:, t] + gamma * running, running)
            returns[:, t] = torch.where(on_policy, running, torch.zeros_like(running))
        kept = _kept(response_mask, kept_mask).to(returns.dtype)
        advantages = tf.masked_whiten(returns, kept) * kept
    return advantages, returns * kept


def _parameters(fn: Callable[..., Any]) -> tuple[set[str], set[str], bool]:
    """(its parameter names, those without a default, whether it takes **kwargs)."""
    params = inspect.signature(fn).parameters.values()
    names = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    required = {p.name for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    return names, required, any(p.kind is p.VAR_KEYWORD for p in params)


_warned_no_kept_mask: set[str] = set()


def compute_advantage(adv_estimator: str, token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                      values: torch.Tensor | None = None, index: np.ndarray | None = None,
                      gamma: float = 1.0, lam: float = 1.0, norm_adv_by_std_in_grpo: bool = True,
                      kept_mask: torch.Tensor | None = None, config: Any = None, epsilon: float | None = None,
                      reward_baselines: torch.Tensor | None = None, **batch_keys: Any,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The estimator registered as `algorithm.adv_estimator` (registry.get_adv_estimator_fn), called with
    veRL's keyword arguments.  -> (advantages_BR, returns_BR)

    `response_mask`: the trajectory's tokens (the recursions run over them); `kept_mask`: those the
    losses keep after rejection (None: all), over which every statistic (whitening, group
    membership) is taken. `config`: the algorithm config node (None: one made of gamma, lam and
    norm_adv_by_std_in_grpo); `batch_keys`: further batch tensors by veRL's names (old_log_probs,
    sum_pi_squared, rollout_is_weights). An estimator gets the arguments it names, all of them if it
    takes **kwargs. One that does not name `kept_mask` (a veRL one) gets the kept tokens as its
    `response_mask`, as veRL's rejection leaves its response_mask, so its recursions skip rejected tokens."""
    fn = get_adv_estimator_fn(adv_estimator)
    if config is None:
        config = OmegaConf.create({"adv_estimator": str(adv_estimator), "gamma": gamma, "lam": lam,
                                   "norm_adv_by_std_in_grpo": norm_adv_by_std_in_grpo})
    names, required, takes_kwargs = _parameters(fn)
    offered: dict[str, Any] = {"token_level_rewards": token_level_rewards, "response_mask": response_mask,
                               "values": values, "index": index, "gamma": gamma, "lam": lam,
                               "norm_adv_by_std_in_grpo": norm_adv_by_std_in_grpo, "config": config,
                               "epsilon": epsilon, "reward_baselines": reward_baselines, **batch_keys}
    if "kept_mask" in names:
        offered["kept_mask"] = kept_mask
    elif kept_mask is not None:
        offered["response_mask"] = kept_mask
        if adv_estimator not in _warned_no_kept_mask and not torch.equal(kept_mask.bool(), response_mask.bool()):
            _warned_no_kept_mask.add(str(adv_estimator))
            logger.warning("algorithm.adv_estimator=%s takes no kept_mask: it gets the tokens the losses keep "
                           "(after rollout-correction rejection / the cut-context mask) as response_mask, as in "
                           "veRL, so its recursions skip the rejected tokens", adv_estimator)
    offered = {k: v for k, v in offered.items() if v is not None}
    missing = sorted(required - offered.keys())
    if missing:
        if "values" in missing:
            raise ValueError(f"algorithm.adv_estimator={adv_estimator} needs the batch key 'values' (a critic)")
        if "index" in missing:
            raise ValueError(f"algorithm.adv_estimator={adv_estimator} needs the non-tensor key 'uid' as index")
        raise ValueError(f"algorithm.adv_estimator={adv_estimator} needs {missing}, which the batch does not have")
    kwargs = offered if takes_kwargs else {k: v for k, v in offered.items() if k in names}
    return fn(**kwargs)


# --------------------------------------------------------------------------- KL
def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference (Schulman's k1 / k2 / k3).

    kl: logp - logq (k1); abs: |logp - logq|; mse: 0.5 (logp - logq)^2 (k2);
    low_var_kl: exp(logq - logp) - (logq - logp) - 1 (k3), its log-ratio clamped to +-KL_LOG_RATIO_CLAMP
    before the exp and the estimate to [-10, 10] (veRL's bounds).
    """
    return _kl_estimate(logprob, ref_logprob, kl_penalty)


def _kl_estimate(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    # Separate from kl_penalty() because veRL's parameter name shadows the function
    # inside apply_kl_penalty.
    diff = logprob - ref_logprob
    if kl_penalty == "kl":
        return diff
    if kl_penalty == "abs":
        return diff.abs()
    if kl_penalty == "mse":
        return 0.5 * diff.square()
    if kl_penalty == "low_var_kl":
        # Clamped before the exp: exp(89) is inf in fp32, and the backward of the outer clamp is then
        # 0 * inf = NaN, even where the mask later zeroes the token (padding): one such token made the
        # whole gradient NaN and the optimizer step was skipped.
        log_ratio = torch.clamp(ref_logprob - logprob, -KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
        return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, min=-10.0, max=10.0)
    raise ValueError(f"unknown kl penalty type {kl_penalty!r}; expected one of {KL_PENALTY_TYPES}")


def apply_kl_penalty(token_level_scores: torch.Tensor, old_log_probs: torch.Tensor, ref_log_prob: torch.Tensor,
                     response_mask: torch.Tensor, kl_ctrl: FixedKLController | AdaptiveKLController,
                     kl_penalty: str = "kl") -> tuple[torch.Tensor, dict[str, float]]:
    """rewards = scores - beta * kl on policy tokens; updates the controller with the masked mean KL."""
    mask = response_mask.to(token_level_scores.dtype)
    kld = _kl_estimate(old_log_probs, ref_log_prob, kl_penalty) * mask
    beta = kl_ctrl.value
    token_level_rewards = token_level_scores - beta * kld
    current_kl = tf.masked_mean(kld, mask, axis=-1).mean().item()
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
    return token_level_rewards, metrics


# --------------------------------------------------------------------------- losses
def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str, dp_size: int = 1,
             batch_num_tokens: int | float | torch.Tensor | None = None,
             global_batch_size: int | float | torch.Tensor | None = None,
             loss_scale_factor: float | None = None) -> torch.Tensor:
    """veRL's `agg_loss`, its keywords: a (B, R) per-token loss reduced by `loss_agg_mode` to a scalar.

    Without the global totals (`batch_num_tokens`, `global_batch_size` None: veRL's FSDP actor, whose
    `config.global_batch_info` is empty, and this project's actor) the micro-batch's own aggregation,
    `torch_functional.agg_loss` (the actor then weighs each micro-batch by its share of the
    mini-batch). With them, veRL's engine-path meaning: token-mean divides the masked sum by
    `batch_num_tokens`, the seq-mean modes the sum of the rows' values (rows with a masked token) by
    `global_batch_size`, both times `dp_size`. seq-mean-token-sum-norm stays a mean over rows of
    token-sum / `loss_scale_factor` here (docs/algorithms.md: veRL sums over the rows)."""
    loss = tf.agg_loss(loss_mat, loss_mask, loss_agg_mode, loss_scale_factor=loss_scale_factor)
    by_tokens = loss_agg_mode == "token-mean"
    total = batch_num_tokens if by_tokens else global_batch_size
    if total is None:
        return loss * dp_size
    if not float(total) > 0:
        name = "batch_num_tokens" if by_tokens else "global_batch_size"
        raise ValueError(f"agg_loss: {name} (the global batch's total) must be > 0, got {total!r}")
    # the local aggregation is a mean over this micro-batch's tokens / rows: rescaled to the global total
    local = float(loss_mask.sum()) if by_tokens else float(tf.rows_with_tokens(loss_mask))
    return loss * (local / float(total) * dp_size)


def compute_policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                        response_mask: torch.Tensor, cliprange: float,
                        loss_agg_mode: str = "token-mean", is_weights: torch.Tensor | None = None,
                        clip_ratio_c: float = DEFAULT_CLIP_RATIO_C, cliprange_low: float | None = None,
                        cliprange_high: float | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dual-clip PPO surrogate (veRL's).  -> (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower), all scalars.

    The `vanilla` policy loss with its metrics as tensors (`policy_losses.ppo_clip_loss`):
    per token max(-A r, -A clip(r, 1 - low, 1 + high)) (low / high: `cliprange` when None), and
    for A < 0 at most -A * clip_ratio_c (Ye et al. 2019, arXiv:1912.09729).
    `is_weights` (B, R): rollout correction's pi_old / pi_rollout weights, multiplying each token's
    clipped loss (verl/trainer/ppo/rollout_correction.py); None: all 1.
    Values outside `response_mask` never reach the loss or the metrics, NaN or inf included.
    """
    low = cliprange if cliprange_low is None else cliprange_low
    high = cliprange if cliprange_high is None else cliprange_high
    return policy_losses.ppo_clip_loss(old_log_prob, log_prob, advantages, response_mask, low, high, clip_ratio_c,
                                       loss_agg_mode, is_weights)


def compute_entropy_loss(logits: torch.Tensor, response_mask: torch.Tensor,
                         loss_agg_mode: str = "token-mean") -> torch.Tensor:
    """Aggregated entropy of the policy over policy tokens; logits (B, R, V)."""
    entropy = tf.entropy_from_logits(logits)
    return tf.agg_loss(entropy, response_mask.to(entropy.dtype), loss_agg_mode)


def compute_value_loss(vpreds: torch.Tensor, returns: torch.Tensor, values: torch.Tensor,
                       response_mask: torch.Tensor, cliprange_value: float,
                       loss_agg_mode: str = "token-mean",
                       loss_scale_factor: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss 0.5 * max((v - R)^2, (clip(v, v_old +- c) - R)^2).  -> (vf_loss, vf_clipfrac)
    `loss_scale_factor`: seq-mean-token-sum-norm's constant divisor (critic.loss_scale_factor)."""
    mask = response_mask.to(vpreds.dtype)
    vpred_clipped = tf.clip_by_value(vpreds, values - cliprange_value, values + cliprange_value)
    unclipped = (vpreds - returns).square()
    clipped = (vpred_clipped - returns).square()
    vf_loss = 0.5 * tf.agg_loss(torch.max(unclipped, clipped), mask, loss_agg_mode,
                                loss_scale_factor=loss_scale_factor)
    vf_clipfrac = tf.masked_mean(torch.gt(clipped, unclipped).to(mask.dtype), mask)
    return vf_loss, vf_clipfrac


# the other estimators register when this module loads
from verl.trainer.ppo import advantage_estimators as _advantage_estimators  # noqa: E402,F401
