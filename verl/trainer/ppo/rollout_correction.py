"""Rollout correction: importance-sampling weights and rejection masks between the policy the
trainer recomputes (old log-probs, π_old) and the engine that sampled (rollout log-probs, π_rollout).

The engine and the trainer's forward differ (bf16 kernels, vLLM's own implementation, later a stale
policy), so the PPO ratio π_θ / π_old is not the importance ratio of the sampled tokens. veRL's
`algorithm.rollout_correction` (its docs/algo/rollout_corr.md) corrects that in "decoupled" mode;
the same keys and meanings here:

- `rollout_is` (null | token | sequence): weights ρ = π_old / π_rollout, per token, or per row as
  the product over its policy tokens (broadcast to them), truncated above at `rollout_is_threshold`
  (default 2.0); `rollout_is_batch_normalize` rescales them to mean 1 (over the policy tokens, or over
  the rows for sequence weights). The policy loss of each token is multiplied by its weight.
- `rollout_rs` (null | token | sequence | geometric): rejection. A token (token), or a whole row
  (sequence: the product of its ratios; geometric: their geometric mean), whose ratio is above
  `rollout_rs_threshold` (null: `rollout_is_threshold`) or below `rollout_rs_threshold_lower` (null:
  the reciprocal of the upper bound) leaves the loss: its response_mask is set to 0, so it is out of
  the loss's denominator as well.
- `rollout_token_veto_threshold` (null | float): a row with any token ratio below it is rejected.

Every ratio (a token's, a row's product or geometric mean of the unbounded token ratios) is bounded
to [exp(-20), exp(20)] (the veto reads the unbounded token ratio); weights are 0 outside the policy
tokens.

Bypass mode (`bypass_old_logprob_for_rollout=true`, veRL's two-policy mode): the engine's log-probs
are the PPO anchor (π_old = π_rollout), so the actor's old-log-prob forward is skipped; the PPO
ratio is then π_θ / π_rollout itself, clipped, and no separate weights or rejection apply (refused
with it: they would compare π_rollout with itself). veRL's pure-IS loss
(`use_pure_rollout_correction`) is not implemented and is refused by the config check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

IS_LEVELS = (None, "token", "sequence")
RS_LEVELS = (None, "token", "sequence", "geometric")
LOG_RATIO_BOUND = 20.0          # ratios are bounded to [exp(-20), exp(20)]
PREFIX = "algorithm.rollout_correction"


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    rollout_is: str | None = None
    rollout_is_threshold: float = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: float | None = None
    rollout_rs_threshold_lower: float | None = None
    rollout_token_veto_threshold: float | None = None
    bypass_old_logprob_for_rollout: bool = False

    @classmethod
    def from_config(cls, node: Any) -> RolloutCorrectionConfig:
        """From `algorithm.rollout_correction` (a mapping; None: everything off)."""
        if node is None:
            return cls()
        get = node.get
        return cls(rollout_is=get("rollout_is"), rollout_is_threshold=float(get("rollout_is_threshold", 2.0)),
                   rollout_is_batch_normalize=bool(get("rollout_is_batch_normalize", False)),
                   rollout_rs=get("rollout_rs"), rollout_rs_threshold=_opt_float(get("rollout_rs_threshold")),
                   rollout_rs_threshold_lower=_opt_float(get("rollout_rs_threshold_lower")),
                   rollout_token_veto_threshold=_opt_float(get("rollout_token_veto_threshold")),
                   bypass_old_logprob_for_rollout=bool(get("bypass_old_logprob_for_rollout", False)))

    @property
    def enabled(self) -> bool:
        return (self.rollout_is is not None or self.rollout_rs is not None
                or self.rollout_token_veto_threshold is not None)

    def rs_bounds(self) -> tuple[float, float]:
        upper = self.rollout_rs_threshold if self.rollout_rs_threshold is not None else self.rollout_is_threshold
        lower = self.rollout_rs_threshold_lower if self.rollout_rs_threshold_lower is not None else 1.0 / upper
        return lower, upper


def bypass_mode(config: Any) -> bool:
    """Whether the trainer config (the whole tree) asks for bypass mode: the engine's log-probs as
    the old log-probs, no old-log-prob pass."""
    node = config.get("algorithm", {}).get("rollout_correction")
    return RolloutCorrectionConfig.from_config(node).bypass_old_logprob_for_rollout


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def config_errors(node: Any) -> list[str]:
    """What is wrong with `algorithm.rollout_correction`, each message naming its key."""
    if node is None:
        return []
    errors = []
    for key, allowed in (("rollout_is", IS_LEVELS), ("rollout_rs", RS_LEVELS)):
        if node.get(key) not in allowed:
            errors.append(f"{PREFIX}.{key}={node.get(key)!r} is unknown; choose one of {list(allowed)}")
    for key in ("rollout_is_threshold", "rollout_rs_threshold", "rollout_rs_threshold_lower",
                "rollout_token_veto_threshold"):
        value = node.get(key)
        if value is None:
            if key == "rollout_is_threshold":
                errors.append(f"{PREFIX}.{key} must be a number > 0 (default 2.0)")
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            errors.append(f"{PREFIX}.{key}={value!r} must be a number > 0 or null")
    if not errors:
        lower, upper = RolloutCorrectionConfig.from_config(node).rs_bounds()
        if node.get("rollout_rs") is not None and not lower < upper:
            errors.append(f"{PREFIX}.rollout_rs_threshold_lower={lower:g} must be below the upper bound {upper:g} "
                          "(rollout_rs_threshold, or rollout_is_threshold when that is null)")
    if node.get("use_pure_rollout_correction"):
        errors.append(f"{PREFIX}.use_pure_rollout_correction=true: veRL's pure importance-sampling loss is not "
                      "implemented here; the PPO loss is, in decoupled or bypass mode: set it to false")
    if node.get("bypass_old_logprob_for_rollout"):
        for key in ("rollout_is", "rollout_rs", "rollout_token_veto_threshold"):
            if node.get(key) is not None:
                errors.append(f"{PREFIX}.{key}={node.get(key)!r} with bypass_old_logprob_for_rollout=true: in "
                              "bypass mode the engine's log-probs are the PPO anchor (pi_old = pi_rollout), so "
                              "these ratios would all be 1; set it to null (the PPO ratio pi_theta / pi_rollout "
                              "is clipped as usual)")
    return errors


@dataclass
class RolloutCorrection:
    """What `compute_rollout_correction` returns: weights (B, R) or None (no `rollout_is`), the
    response mask with rejected tokens set to 0, and metrics."""

    weights: torch.Tensor | None
    response_mask: torch.Tensor
    metrics: dict[str, float]


def compute_rollout_correction(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                               response_mask: torch.Tensor, cfg: RolloutCorrectionConfig,
                               policy_mask: torch.Tensor | None = None) -> RolloutCorrection:
    """IS weights and rejection for (B, R) log-probs.

    Ratios come from the policy tokens (`policy_mask`, the tokens the engine sampled; None: all of
    `response_mask`), never from observation tokens, which the engine did not sample and has no
    log-prob for (they are in `response_mask` under `actor.state_masking=false`): their weight is 1,
    and they leave the loss only with their row (sequence / geometric rejection, the veto)."""
    mask = response_mask.bool()
    policy = mask if policy_mask is None else mask & policy_mask.bool()
    policyf = policy.to(torch.float32)
    log_ratio = (old_log_probs.float() - rollout_log_probs.float()) * policyf
    bounded = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    tokens_per_row = policyf.sum(-1)
    rows = tokens_per_row > 0
    n_tokens = policyf.sum().clamp(min=1)
    # a row's product (and geometric mean) from the unbounded ratios, then bounded itself
    seq_log_ratio = log_ratio.sum(-1).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    geo_log_ratio = (log_ratio.sum(-1) / tokens_per_row.clamp(min=1)).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    metrics: dict[str, float] = {}

    weights = None
    if cfg.rollout_is is not None:
        if cfg.rollout_is == "token":
            raw = torch.exp(bounded)
            weights = raw.clamp(max=cfg.rollout_is_threshold) * policyf
            truncated = (raw > cfg.rollout_is_threshold) & policy
            if cfg.rollout_is_batch_normalize:
                weights = weights / (weights.sum() / n_tokens).clamp(min=1e-12)
        else:
            raw_row = torch.exp(seq_log_ratio)
            row_weights = raw_row.clamp(max=cfg.rollout_is_threshold)
            if cfg.rollout_is_batch_normalize and bool(rows.any()):
                row_weights = row_weights / row_weights[rows].mean().clamp(min=1e-12)
            weights = row_weights[:, None] * policyf
            truncated = (raw_row > cfg.rollout_is_threshold)[:, None] & policy
        valid = weights[policy]
        metrics.update({
            "rollout_corr/is_weight_mean": float(valid.mean()) if valid.numel() else 1.0,
            "rollout_corr/is_weight_max": float(valid.max()) if valid.numel() else 1.0,
            "rollout_corr/is_truncated_frac": float(truncated.sum() / n_tokens),
            "rollout_corr/is_ess": _effective_sample_size(valid),
        })
        # tokens in the loss that the engine did not sample (observations without state masking): 1
        weights = torch.where(mask & ~policy, torch.ones_like(weights), weights)

    keep_token = torch.ones_like(mask)
    keep_row = torch.ones_like(rows)
    if cfg.rollout_rs is not None:
        lower, upper = cfg.rs_bounds()
        if cfg.rollout_rs == "token":
            ratio = torch.exp(bounded)
            keep_token = ~policy | ((ratio <= upper) & (ratio >= lower))
        else:
            ratio = torch.exp(seq_log_ratio if cfg.rollout_rs == "sequence" else geo_log_ratio)
            keep_row &= ~rows | ((ratio <= upper) & (ratio >= lower))
    if cfg.rollout_token_veto_threshold is not None:
        # the unbounded per-token ratio, over policy tokens only
        vetoed = ((torch.exp(log_ratio) < cfg.rollout_token_veto_threshold) & policy).any(-1)
        keep_row &= ~vetoed
        metrics["rollout_corr/veto_seq_frac"] = float(vetoed[rows].float().mean()) if bool(rows.any()) else 0.0
    keep = mask & keep_token & keep_row[:, None]
    metrics["rollout_corr/rejected_token_frac"] = float((policy & ~keep).sum() / n_tokens)
    metrics["rollout_corr/rejected_seq_frac"] = float((~keep_row)[rows].float().mean()) if bool(rows.any()) else 0.0
    return RolloutCorrection(weights=weights, response_mask=keep.to(response_mask.dtype), metrics=metrics)


def _effective_sample_size(weights: torch.Tensor) -> float:
    """(Σw)² / (n Σw²) in (0, 1]: 1 when every weight is equal."""
    if weights.numel() == 0:
        return 1.0
    total, squares = float(weights.sum()), float(weights.square().sum())
    return total * total / (weights.numel() * squares) if squares > 0 and math.isfinite(squares) else 0.0
