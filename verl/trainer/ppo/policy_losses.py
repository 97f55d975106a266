"""The policy losses, registered under their `actor_rollout_ref.actor.policy_loss.loss_mode` names.

Each is called as veRL calls it (verl/trainer/ppo/registry.py):

    loss, metrics = fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                       rollout_is_weights=None)

with `config` the actor config node (clip_ratio, clip_ratio_low / _high, clip_ratio_c, tau_pos /
tau_neg, loss_scale_factor, policy_loss.*), tensors (B, R), `metrics` a dict of floats under
veRL's names (`actor/pg_clipfrac`, `actor/ppo_kl`, `actor/pg_clipfrac_lower`).

Where this differs from veRL on purpose (docs/algorithms.md, "Policy losses"):
- every loss reads its inputs through `response_mask` first: a NaN / inf log-prob, advantage or
  weight on a masked position (padding, a retrieved passage) reaches neither the loss, nor the
  metrics, nor the gradient of any other position;
- every token ratio is exp of the log-ratio clamped to +-20 (veRL does so in vanilla, sapo and
  cispo, not in clip_cov / kl_cov / geo_mean);
- geo_mean averages over the rows with at least one policy token (veRL: over all rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from verl.trainer.ppo.registry import register_policy_loss
from verl.utils import torch_functional as tf

LOG_RATIO_CLAMP = 20.0         # |log pi_theta - log pi_old| bound in every token ratio
GSPO_LOG_RATIO_MAX = 10.0      # GSPO's sequence log-ratio bound (veRL's)
DEFAULT_CLIP_RATIO_C = 3.0     # actor.clip_ratio_c: the dual-clip bound (veRL's default)
# actor.policy_loss defaults (veRL's actor.yaml)
POLICY_LOSS_DEFAULTS = {"clip_cov_ratio": 0.0002, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0,
                        "kl_cov_ratio": 0.0002, "ppo_kl_coef": 0.1}
SAPO_DEFAULTS = {"tau_pos": 1.0, "tau_neg": 1.05}   # actor.tau_pos / actor.tau_neg (veRL's)


# --------------------------------------------------------------------------- config and inputs
def _get(config: Any, key: str, default: Any = None) -> Any:
    if config is None:
        return default
    value = config.get(key, default) if hasattr(config, "get") else getattr(config, key, default)
    return default if value is None else value


def policy_loss_option(config: Any, key: str) -> float:
    """actor.policy_loss.<key>, veRL's default when absent or null."""
    node = _get(config, "policy_loss", None)
    return float(_get(node, key, POLICY_LOSS_DEFAULTS[key]))


def clip_ratios(config: Any) -> tuple[float, float]:
    """(low, high): actor.clip_ratio_low / clip_ratio_high, each actor.clip_ratio when null (veRL's rule)."""
    base = _get(config, "clip_ratio", None)
    low, high = _get(config, "clip_ratio_low", base), _get(config, "clip_ratio_high", base)
    if low is None or high is None:
        raise ValueError("actor_rollout_ref.actor.clip_ratio (or clip_ratio_low and clip_ratio_high) must be set")
    return float(low), float(high)


def _masked(response_mask: torch.Tensor, *tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Each tensor with its masked-out positions replaced by 0, selected not multiplied: no value
    there (NaN included) reaches the loss, and no gradient of the loss reaches it."""
    keep = response_mask.bool()
    out = []
    for t in tensors:
        out.append(None if t is None else torch.where(keep, t, torch.zeros((), dtype=t.dtype, device=t.device)))
    return out


def _log_ratio(old_log_prob: torch.Tensor, log_prob: torch.Tensor) -> torch.Tensor:
    return torch.clamp(log_prob - old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


@dataclass(frozen=True)
class _Inputs:
    """A loss's inputs read through `response_mask` (`_masked`: 0 at masked positions), (B, R) each."""

    mask: torch.Tensor                 # response_mask as the log-probs' float dtype
    old_log_prob: torch.Tensor
    log_prob: torch.Tensor
    advantages: torch.Tensor
    weights: torch.Tensor | None       # rollout correction's IS weights; None: all 1
    log_ratio: torch.Tensor            # log pi - log pi_old, clamped to +-LOG_RATIO_CLAMP

    @property
    def ratio(self) -> torch.Tensor:
        return torch.exp(self.log_ratio)

    @property
    def ppo_kl(self) -> torch.Tensor:
        """mean(-log r) over the policy tokens: every loss's actor/ppo_kl."""
        return tf.masked_mean(-self.log_ratio, self.mask)


def _inputs(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
            response_mask: torch.Tensor, rollout_is_weights: torch.Tensor | None) -> _Inputs:
    """The prelude every loss shares: the float mask, the masked inputs, the clamped log-ratio."""
    old_log_prob, log_prob, advantages, rollout_is_weights = _masked(
        response_mask, old_log_prob, log_prob, advantages, rollout_is_weights)
    return _Inputs(response_mask.to(log_prob.dtype), old_log_prob, log_prob, advantages, rollout_is_weights,
                   _log_ratio(old_log_prob, log_prob))


def _clip_terms(ratio: torch.Tensor, advantages: torch.Tensor, low: float,
                high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's two terms per token: (-A r, -A clip(r, 1 - low, 1 + high)); the clipped one is active where
    it is the larger (vanilla, clip_cov, and GSPO on its sequence ratio)."""
    return -advantages * ratio, -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)


def _agg(per_token: torch.Tensor, mask: torch.Tensor, loss_agg_mode: str, config: Any) -> torch.Tensor:
    return tf.agg_loss(per_token, mask, loss_agg_mode, loss_scale_factor=_get(config, "loss_scale_factor", None))


def _weighted(per_token: torch.Tensor, rollout_is_weights: torch.Tensor | None) -> torch.Tensor:
    return per_token if rollout_is_weights is None else per_token * rollout_is_weights.to(per_token.dtype)


def _metrics(ppo_kl: torch.Tensor, clipfrac: torch.Tensor | float | None = None,
             clipfrac_lower: torch.Tensor | float | None = None) -> dict[str, float]:
    def scalar(value: torch.Tensor | float) -> float:
        return float(value.detach()) if isinstance(value, torch.Tensor) else float(value)

    out = {"actor/ppo_kl": scalar(ppo_kl)}
    if clipfrac is not None:
        out["actor/pg_clipfrac"] = scalar(clipfrac)
    if clipfrac_lower is not None:
        out["actor/pg_clipfrac_lower"] = scalar(clipfrac_lower)
    return out


# --------------------------------------------------------------------------- vanilla (PPO, dual-clip, clip-higher)
def ppo_clip_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                  response_mask: torch.Tensor, clip_low: float, clip_high: float, clip_ratio_c: float,
                  loss_agg_mode: str = "token-mean", rollout_is_weights: torch.Tensor | None = None,
                  loss_scale_factor: float | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dual-clip PPO surrogate.  -> (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower), all scalars.

    Per token: max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) (clip-higher, DAPO
    arXiv:2503.14476, when clip_high > clip_low), and for A < 0 at most -A * clip_ratio_c (Ye et
    al. 2019, arXiv:1912.09729): past that bound the token's loss is constant, no gradient.
    pg_clipfrac: the fraction of policy tokens whose clipped term was the active one;
    pg_clipfrac_lower: the fraction held at the dual-clip bound."""
    if not clip_ratio_c > 1.0:
        raise ValueError(f"actor_rollout_ref.actor.clip_ratio_c must be > 1 (the dual-clip bound), got {clip_ratio_c}")
    x = _inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    unclipped, clipped = _clip_terms(x.ratio, x.advantages, clip_low, clip_high)
    clip_loss = torch.max(unclipped, clipped)
    dual_bound = -x.advantages * clip_ratio_c
    negative = x.advantages < 0
    per_token = _weighted(torch.where(negative, torch.min(clip_loss, dual_bound), clip_loss), x.weights)
    pg_loss = tf.agg_loss(per_token, x.mask, loss_agg_mode, loss_scale_factor=loss_scale_factor)
    pg_clipfrac = tf.masked_mean(torch.gt(clipped, unclipped).to(x.mask.dtype), x.mask)
    pg_clipfrac_lower = tf.masked_mean((torch.gt(clip_loss, dual_bound) & negative).to(x.mask.dtype), x.mask)
    return pg_loss, pg_clipfrac, x.ppo_kl, pg_clipfrac_lower


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                                response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                                rollout_is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """PPO's clipped surrogate (arXiv:1707.06347) with clip-higher and dual-clip: `ppo_clip_loss`."""
    low, high = clip_ratios(config)
    pg_loss, clipfrac, ppo_kl, lower = ppo_clip_loss(
        old_log_prob, log_prob, advantages, response_mask, low, high,
        float(_get(config, "clip_ratio_c", DEFAULT_CLIP_RATIO_C)), loss_agg_mode, rollout_is_weights,
        _get(config, "loss_scale_factor", None))
    return pg_loss, _metrics(ppo_kl, clipfrac, lower)


# --------------------------------------------------------------------------- GSPO, SAPO
@register_policy_loss("gspo")
def compute_policy_loss_gspo(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                             response_mask: torch.Tensor, loss_agg_mode: str = "seq-mean-token-mean",
                             config: Any = None, rollout_is_weights: torch.Tensor | None = None,
                             ) -> tuple[torch.Tensor, dict]:
    """GSPO (arXiv:2507.18071), the GSPO-token form: per token the ratio
    s_it = sg[s_i] * pi(y_it) / sg[pi(y_it)], where log s_i is the mean token log-ratio of row i,
    clipped to [1 - clip_low, 1 + clip_high]. Its value is the sequence ratio s_i, its gradient
    s_i * grad log pi(y_it). Aggregated seq-mean-token-mean whatever loss_agg_mode says (veRL)."""
    low, high = clip_ratios(config)
    x = _inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    token_log_ratio = x.log_prob - x.old_log_prob    # unclamped: the sequence mean is bounded below
    lengths = x.mask.sum(dim=-1).clamp(min=1)
    seq_log_ratio = (token_log_ratio * x.mask).sum(dim=-1) / lengths
    log_s = x.log_prob - x.log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    s = torch.exp(torch.clamp(log_s, max=GSPO_LOG_RATIO_MAX))
    unclipped, clipped = _clip_terms(s, x.advantages, low, high)
    per_token = _weighted(torch.max(unclipped, clipped), x.weights)
    pg_loss = tf.agg_loss(per_token, x.mask, "seq-mean-token-mean")
    clipfrac = tf.masked_mean(torch.gt(clipped, unclipped).to(x.mask.dtype), x.mask)
    return pg_loss, _metrics(x.ppo_kl, clipfrac, 0.0)


def sapo_gate(ratio: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """SAPO's soft gate f(r) = sigmoid(tau (r - 1)) * 4 / tau: value 2/tau, slope 1 at r = 1."""
    return torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)


@register_policy_loss("sapo")
def compute_policy_loss_sapo(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                             response_mask: torch.Tensor, loss_agg_mode: str = "seq-mean-token-mean",
                             config: Any = None, rollout_is_weights: torch.Tensor | None = None,
                             ) -> tuple[torch.Tensor, dict]:
    """SAPO (arXiv:2511.20347): per token -f(r) A with the soft gate `sapo_gate` in place of the
    hard clip, temperature actor.tau_pos where A > 0 and actor.tau_neg otherwise. Aggregated
    seq-mean-token-mean whatever loss_agg_mode says (veRL)."""
    tau_pos = float(_get(config, "tau_pos", SAPO_DEFAULTS["tau_pos"]))
    tau_neg = float(_get(config, "tau_neg", SAPO_DEFAULTS["tau_neg"]))
    x = _inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    adv = x.advantages
    taus = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
    per_token = _weighted(-sapo_gate(x.ratio, taus) * adv, x.weights)
    pg_loss = tf.agg_loss(per_token, x.mask, "seq-mean-token-mean")
    return pg_loss, _metrics(x.ppo_kl, 0.0, 0.0)


# --------------------------------------------------------------------------- GPG, CISPO
@register_policy_loss("gpg")
def compute_policy_loss_gpg(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                            response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                            rollout_is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """GPG (arXiv:2504.02546): plain policy gradient, per token -A log pi, no ratio, no clip."""
    x = _inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    per_token = _weighted(-x.advantages * x.log_prob, x.weights)
    return _agg(per_token, x.mask, loss_agg_mode, config), _metrics(x.ppo_kl)


@register_policy_loss("cispo")
def compute_policy_loss_cispo(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                              response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                              rollout_is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """CISPO (MiniMax-M1, arXiv:2506.13585): per token -sg[clip(r, 1 - clip_low, 1 + clip_high)] A log pi:
    the importance weight is clipped and detached, so every token keeps a gradient A w grad log pi."""
    low, high = clip_ratios(config)
    x = _inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    ratio = x.ratio
    weight = torch.clamp(ratio, 1.0 - low, 1.0 + high).detach()
    per_token = _weighted(-weight * x.advantages * x.log_prob, x.weights)
    clipfrac = tf.masked_mean(torch.ne(ratio, weight).to(x.mask.dtype), x.mask)
    return _agg(per_token, x.mask, loss_agg_mode, config), _metrics(x.ppo_kl, clipfrac, 0.0)


# --------------------------------------------------------------------------- Clip-Cov, KL-Cov
def _centered_cov(advantages: torch.Tensor, log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(A - mean A) (log pi - mean log pi) per token, means over the policy tokens, detached."""
    adv, lp = advantages.detach(), log_prob.detach()
    return (adv - tf.masked_mean(adv, mask)) * (lp - tf.masked_mean(lp, mask))


@register_policy_loss("clip_cov")
def compute_policy_loss_clip_cov(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                                 response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                                 rollout_is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Clip-Cov (Cui et al. 2025, arXiv:2505.22617): the clipped PPO surrogate, except that
    max(1, int(clip_cov_ratio * tokens)) tokens drawn at random (torch's global generator, as
    veRL) among those not already clipped whose centered covariance (A - mean A)(log pi - mean
    log pi) lies strictly in (clip_cov_lb, clip_cov_ub) lose their loss term, and with it their
    gradient. pg_clipfrac: the fraction so removed."""
    low, high = clip_ratios(config)
    ratio_share = policy_loss_option(config, "clip_cov_ratio")
    lb, ub = policy_loss_option(config, "clip_cov_lb"), policy_loss_option(config, "clip_cov_ub")
    if not ratio_share > 0:
        raise ValueError(f"actor_rollout_ref.actor.policy_loss.clip_cov_ratio must be > 0, got {ratio_share}")
    x = _inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    unclipped, clipped = _clip_terms(x.ratio, x.advantages, low, high)
    in_loss = response_mask.bool()
    cov = _centered_cov(x.advantages, x.log_prob, x.mask)
    candidates = torch.nonzero(in_loss & ~torch.gt(clipped, unclipped) & (cov > lb) & (cov < ub))
    keep = torch.ones_like(x.advantages)
    if len(candidates):
        n_clip = max(int(ratio_share * float(x.mask.sum())), 1)
        chosen = candidates[torch.randperm(len(candidates))[:n_clip].to(candidates.device)]
        keep[chosen[:, 0], chosen[:, 1]] = 0.0
    per_token = _weighted(torch.max(unclipped, clipped) * keep, x.weights)
    clipfrac = tf.masked_mean((keep == 0).to(x.mask.dtype), x.mask)
    return _agg(per_token, x.mask, loss_agg_mode, config), _metrics(x.ppo_kl, clipfrac)


@register_policy_loss("kl_cov")
def compute_policy_loss_kl_cov(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                               response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                               rollout_is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """KL-Cov (Cui et al. 2025, arXiv:2505.22617): the unclipped surrogate -A r, plus
    ppo_kl_coef * |log r| on the max(1, int(kl_cov_ratio * tokens)) policy tokens of largest
    centered covariance (A - mean A)(log pi - mean log pi)."""
    share, coef = policy_loss_option(config, "kl_cov_ratio"), policy_loss_option(config, "ppo_kl_coef")
    if not share > 0:
        raise ValueError(f"actor_rollout_ref.actor.policy_loss.kl_cov_ratio must be > 0, got {share}")
    x = _inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    per_token = -x.advantages * x.ratio
    in_loss = response_mask.bool()
    n_tokens = int(in_loss.sum())
    if n_tokens:
        cov = _centered_cov(x.advantages, x.log_prob, x.mask)
        cov = torch.where(in_loss, cov, torch.full_like(cov, -torch.inf))
        top = torch.topk(cov.reshape(-1), max(1, int(n_tokens * share))).indices
        penalised = torch.zeros(cov.numel(), dtype=torch.bool, device=cov.device)
        penalised[top] = True
        per_token = per_token + coef * x.log_ratio.abs() * penalised.reshape(cov.shape).to(per_token.dtype)
    per_token = _weighted(per_token, x.weights)
    return _agg(per_token, x.mask, loss_agg_mode, config), _metrics(x.ppo_kl)


# --------------------------------------------------------------------------- GMPO
@register_policy_loss("geo_mean")
def compute_policy_loss_geo_mean(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                                 response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                                 rollout_is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """GMPO (arXiv:2507.20673): per row -A_i * exp(mean_t of the token log-ratio clipped in log space
    to [-clip_low, clip_high] on the side the advantage's sign makes pessimistic), A_i the row's mean
    advantage; mean over the rows with policy tokens. loss_agg_mode is not used (veRL). GMPO's
    paper clips at log-ratio +-0.4: set clip_ratio=0.4."""
    low, high = clip_ratios(config)
    x = _inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    mask, advantages, log_ratio, rollout_is_weights = x.mask, x.advantages, x.log_ratio, x.weights
    sign = torch.sign(advantages)
    bounded = torch.clamp(log_ratio, -low, high)
    pessimistic = sign * torch.min(sign * log_ratio, sign * bounded)
    lengths = mask.sum(dim=-1)
    rows = lengths > 0
    denom = lengths.clamp(min=1)
    seq_ratio = torch.exp((pessimistic * mask).sum(dim=-1) / denom)
    seq_adv = (advantages * mask).sum(dim=-1) / denom
    per_row = -seq_adv * seq_ratio
    if rollout_is_weights is not None:
        log_w = torch.log(torch.where(response_mask.bool(), rollout_is_weights, torch.ones_like(rollout_is_weights)))
        per_row = per_row * torch.exp((log_w * mask).sum(dim=-1) / denom).to(per_row.dtype)
    pg_loss = tf.masked_sum(per_row, rows) / rows.sum().clamp(min=1)
    was_clipped = torch.ne(log_ratio, bounded)
    return pg_loss, _metrics(x.ppo_kl,
                             tf.masked_mean((was_clipped & (advantages > 0)).to(mask.dtype), mask),
                             tf.masked_mean((was_clipped & (advantages < 0)).to(mask.dtype), mask))


# the losses that aggregate on their own, whatever actor.loss_agg_mode says (veRL's): the actor
# weighs their micro-batches by that aggregation (a row share), not by loss_agg_mode's
compute_policy_loss_gspo.fixed_loss_agg_mode = "seq-mean-token-mean"
compute_policy_loss_sapo.fixed_loss_agg_mode = "seq-mean-token-mean"
compute_policy_loss_geo_mean.fixed_loss_agg_mode = "seq-mean-token-mean"   # a mean over rows
