"""Rollout correction: importance-sampling weights and rejection masks between the policy the
trainer recomputes (old log-probs, π_old) and the engine that sampled (rollout log-probs, π_rollout).

The engine and the trainer's forward differ (bf16 kernels, vLLM's own implementation, later a stale
policy), so the PPO ratio π_θ / π_old is not the importance ratio of the sampled tokens. veRL's
`algorithm.rollout_correction` (its docs/algo/rollout_corr.md) corrects that in "decoupled" mode;
the same keys and meanings here:

- `rollout_is` (null | token | sequence | auto): weights ρ = π_old / π_rollout, per token, or per
  row as the product over its policy tokens (on every token of the row in the loss), truncated above
  at `rollout_is_threshold` (default 2.0); `rollout_is_batch_normalize` rescales them to mean 1
  (over the policy tokens, or over the rows for sequence weights). The policy loss of each token is
  multiplied by its weight. `auto` (the YAML's default, not veRL's): `token` in a pipelined run
  (trainer.pipeline != sync) that selects no other correction (no `rollout_rs`, no veto, not bypass
  mode), null otherwise; an explicit null turns the pipeline's default off.
- `rollout_rs` (null | token | sequence | geometric): rejection. A token (token), or a whole row
  (sequence: the product of its ratios; geometric: their geometric mean), whose ratio is above
  `rollout_rs_threshold` (null: `rollout_is_threshold`) or below `rollout_rs_threshold_lower` (null:
  the reciprocal of the upper bound) leaves the loss: its response_mask is set to 0, so it is out of
  the loss's denominator as well.
- `rollout_token_veto_threshold` (null | float): a row with any token ratio below it is rejected.

Every ratio (a token's, a row's product or geometric mean of the unbounded token ratios) is bounded
to [exp(-20), exp(20)] (the veto reads the unbounded token ratio, so a threshold below exp(-20)
still rejects); weights are 0 outside the loss. Log-probs outside the policy tokens are never read:
a -inf or NaN there (padding) changes nothing.

Bypass mode (`bypass_old_logprob_for_rollout=true`, or veRL's newer spelling `bypass_mode=true`;
veRL's two-policy mode): the engine's log-probs are the PPO anchor (π_old = π_rollout), so the
actor's old-log-prob forward is skipped; the PPO ratio is then π_θ / π_rollout itself, clipped
(veRL's `loss_type=ppo_clip`, `use_policy_gradient=false`), and no separate weights or rejection
apply (refused with it: they would compare π_rollout with itself). veRL's other losses are not
implemented and are refused, naming the key: its REINFORCE / policy-gradient loss
(`loss_type=reinforce`, older `use_policy_gradient=true`) and its pure-IS loss
(`use_pure_rollout_correction=true`). Any other key under the node is refused too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from verl.utils import batch_keys as K

IS_LEVELS = (None, "token", "sequence", "auto")
RS_LEVELS = (None, "token", "sequence", "geometric")
LOSS_TYPES = ("ppo_clip", "reinforce")
LOG_RATIO_BOUND = 20.0          # ratios are bounded to [exp(-20), exp(20)]
PREFIX = "algorithm.rollout_correction"
# Every key the node may hold (ppo_trainer.yaml declares each): this project's and veRL's spellings.
KNOWN_KEYS = ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs",
              "rollout_rs_threshold", "rollout_rs_threshold_lower", "rollout_token_veto_threshold",
              "bypass_old_logprob_for_rollout", "bypass_mode", "loss_type", "use_policy_gradient",
              "use_pure_rollout_correction")
BYPASS_KEYS = ("bypass_old_logprob_for_rollout", "bypass_mode")   # one meaning, two spellings
# veRL >= 0.7 names its rejection modes by the divergence they bound; the ratio ones exist here.
VERL_RS_NAMES = {"token_k1": "token", "seq_sum_k1": "sequence", "seq_mean_k1": "geometric"}


class RolloutCorrectionConfigError(ValueError):
    """`algorithm.rollout_correction` holds a key or value this project cannot run; one message a problem."""


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """The node, resolved: `rollout_is` is null, token or sequence (never auto)."""

    rollout_is: str | None = None
    rollout_is_threshold: float = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: float | None = None
    rollout_rs_threshold_lower: float | None = None
    rollout_token_veto_threshold: float | None = None
    bypass_old_logprob_for_rollout: bool = False

    def __post_init__(self) -> None:
        if self.rollout_is not in ("token", "sequence", None):
            raise RolloutCorrectionConfigError(
                f"RolloutCorrectionConfig.rollout_is={self.rollout_is!r}: token, sequence or None (`auto` is "
                "resolved by from_config, which knows whether the run is pipelined)")
        if self.rollout_rs not in RS_LEVELS:
            raise RolloutCorrectionConfigError(f"RolloutCorrectionConfig.rollout_rs={self.rollout_rs!r}: one of "
                                               f"{list(RS_LEVELS)}")

    @classmethod
    def from_config(cls, node: Any, pipelined: bool = False) -> RolloutCorrectionConfig:
        """From `algorithm.rollout_correction` (a mapping; None: every key at its default), `rollout_is:
        auto` resolved for a pipelined run or not. Raises RolloutCorrectionConfigError listing what
        `config_errors` finds (an unknown key among them)."""
        errors = config_errors(node)
        if errors:
            raise RolloutCorrectionConfigError("invalid trainer config:\n  - " + "\n  - ".join(errors))
        return _resolve(node if node is not None else {}, pipelined)

    @property
    def enabled(self) -> bool:
        return (self.rollout_is is not None or self.rollout_rs is not None
                or self.rollout_token_veto_threshold is not None)

    def rs_bounds(self) -> tuple[float, float]:
        upper = self.rollout_rs_threshold if self.rollout_rs_threshold is not None else self.rollout_is_threshold
        lower = self.rollout_rs_threshold_lower if self.rollout_rs_threshold_lower is not None else 1.0 / upper
        return lower, upper


def _bypass(node: Any) -> bool:
    """Bypass mode from either spelling (null = false; config_errors refuses two that differ)."""
    return any(bool(node.get(key)) for key in BYPASS_KEYS)


def _resolve(node: Any, pipelined: bool) -> RolloutCorrectionConfig:
    get = node.get
    bypass = _bypass(node)
    rollout_is = get("rollout_is", "auto")
    if rollout_is == "auto":
        # the pipeline's decoupled loss needs IS against the stale sampler, unless the user chose
        # another correction (rejection, the veto) or bypass mode (whose ratios would all be 1)
        chose_other = get("rollout_rs") is not None or get("rollout_token_veto_threshold") is not None or bypass
        rollout_is = "token" if pipelined and not chose_other else None
    return RolloutCorrectionConfig(
        rollout_is=rollout_is, rollout_is_threshold=float(get("rollout_is_threshold", 2.0)),
        rollout_is_batch_normalize=bool(get("rollout_is_batch_normalize", False)),
        rollout_rs=get("rollout_rs"), rollout_rs_threshold=_opt_float(get("rollout_rs_threshold")),
        rollout_rs_threshold_lower=_opt_float(get("rollout_rs_threshold_lower")),
        rollout_token_veto_threshold=_opt_float(get("rollout_token_veto_threshold")),
        bypass_old_logprob_for_rollout=bypass)


def bypass_mode(config: Any) -> bool:
    """Whether the trainer config (the whole tree) asks for bypass mode: the engine's log-probs as
    the old log-probs, no old-log-prob pass."""
    node = config.get("algorithm", {}).get("rollout_correction")
    return RolloutCorrectionConfig.from_config(node).bypass_old_logprob_for_rollout


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _bad_number(value: Any) -> bool:
    return isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0


def config_errors(node: Any) -> list[str]:
    """What is wrong with `algorithm.rollout_correction`, each message naming its key."""
    if node is None:
        return []
    unknown = [str(key) for key in node.keys() if key not in KNOWN_KEYS]
    if unknown:
        # composed through Hydra the undeclared-key check names them too; the node also arrives
        # from other paths (a recipe's own tree, a test, bypass_mode(config) in the memory plan)
        return [f"{PREFIX}.{key} is not a rollout-correction key; the keys are {list(KNOWN_KEYS)} "
                "(docs/algorithms.md, 'Rollout correction')" for key in unknown]
    errors = []
    for key, allowed in (("rollout_is", IS_LEVELS), ("rollout_rs", RS_LEVELS)):
        value = node.get(key, "auto" if key == "rollout_is" else None)
        if value not in allowed:
            hint = (f" (veRL's {value!r} is {VERL_RS_NAMES[value]!r} here, its bounds as numbers in "
                    "rollout_rs_threshold / rollout_rs_threshold_lower)") if value in VERL_RS_NAMES else ""
            errors.append(f"{PREFIX}.{key}={value!r} is unknown; choose one of {list(allowed)}{hint}")
    for key in ("rollout_is_threshold", "rollout_rs_threshold", "rollout_rs_threshold_lower",
                "rollout_token_veto_threshold"):
        value = node.get(key, 2.0 if key == "rollout_is_threshold" else None)
        if value is None:
            if key == "rollout_is_threshold":
                errors.append(f"{PREFIX}.{key} must be a number > 0 (default 2.0)")
            continue
        if _bad_number(value):
            errors.append(f"{PREFIX}.{key}={value!r} must be a number > 0 or null")
    for key in ("rollout_is_batch_normalize", *BYPASS_KEYS, "use_policy_gradient", "use_pure_rollout_correction"):
        value = node.get(key)
        if value is not None and not isinstance(value, bool):
            errors.append(f"{PREFIX}.{key}={value!r} must be true or false")
    if not errors:
        lower, upper = _resolve(node, pipelined=False).rs_bounds()
        if node.get("rollout_rs") is not None and not lower < upper:
            errors.append(f"{PREFIX}.rollout_rs_threshold_lower={lower:g} must be below the upper bound {upper:g} "
                          "(rollout_rs_threshold, or rollout_is_threshold when that is null)")
    errors.extend(_loss_errors(node))
    return errors


def _loss_errors(node: Any) -> list[str]:
    """Bypass mode's two spellings, veRL's loss selectors, and what bypass mode refuses."""
    errors = []
    spelled = {key: node.get(key) for key in BYPASS_KEYS if node.get(key) is not None}
    if len(spelled) == 2 and len({bool(v) for v in spelled.values()}) == 2:
        errors.append(f"{PREFIX}.bypass_old_logprob_for_rollout={spelled['bypass_old_logprob_for_rollout']} and "
                      f"{PREFIX}.bypass_mode={spelled['bypass_mode']} disagree: they are one setting (bypass_mode "
                      "is veRL's newer name); set one of them")
    loss_type = node.get("loss_type", "ppo_clip")
    if loss_type not in LOSS_TYPES:
        errors.append(f"{PREFIX}.loss_type={loss_type!r} is unknown; choose one of {list(LOSS_TYPES)}")
    elif loss_type == "reinforce":
        errors.append(f"{PREFIX}.loss_type=reinforce: veRL's REINFORCE loss with explicit IS weights (bypass mode) "
                      "is not implemented here; the PPO clipped loss is (loss_type=ppo_clip, in bypass or "
                      "decoupled mode)")
    if node.get("use_policy_gradient"):
        errors.append(f"{PREFIX}.use_policy_gradient=true: veRL's policy-gradient loss without clipping (bypass "
                      "mode) is not implemented here; set it to false (the PPO clipped loss)")
    if node.get("use_pure_rollout_correction"):
        errors.append(f"{PREFIX}.use_pure_rollout_correction=true: veRL's pure importance-sampling loss is not "
                      "implemented here; the PPO loss is, in decoupled or bypass mode: set it to false")
    if _bypass(node):
        on = next(key for key in BYPASS_KEYS if node.get(key))
        for key in ("rollout_is", "rollout_rs", "rollout_token_veto_threshold"):
            value = node.get(key)
            if value is not None and value != "auto":
                errors.append(f"{PREFIX}.{key}={value!r} with {on}=true: in "
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
    log-prob for (they are in `response_mask` under `actor.state_masking=false`). Those observation
    tokens get weight 1 under token IS and their row's weight under sequence IS (the weight is the
    row's: every token the loss reads from that row is sampled under it), and leave the loss only
    with their row (sequence / geometric rejection, the veto)."""
    mask = response_mask.bool()
    policy = mask if policy_mask is None else mask & policy_mask.bool()
    policyf = policy.to(torch.float32)
    maskf = mask.to(torch.float32)
    # selected, not multiplied: a -inf / NaN log-prob on padding would make (x * 0) NaN, and the row sum
    log_ratio = torch.where(policy, old_log_probs.float() - rollout_log_probs.float(), torch.zeros_like(policyf))
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
            # tokens in the loss that the engine did not sample (observations without state masking): 1
            weights = torch.where(mask & ~policy, torch.ones_like(weights), weights)
        else:
            raw_row = torch.exp(seq_log_ratio)
            row_weights = raw_row.clamp(max=cfg.rollout_is_threshold)
            if cfg.rollout_is_batch_normalize and bool(rows.any()):
                row_weights = row_weights / row_weights[rows].mean().clamp(min=1e-12)
            # on every token of the row in the loss, observations included; a row without policy
            # tokens has ratio 1
            weights = row_weights[:, None] * maskf
            truncated = (raw_row > cfg.rollout_is_threshold)[:, None] & policy
        valid = weights[policy]
        metrics.update({
            "rollout_corr/is_weight_mean": float(valid.mean()) if valid.numel() else 1.0,
            "rollout_corr/is_weight_max": float(valid.max()) if valid.numel() else 1.0,
            "rollout_corr/is_truncated_frac": float(truncated.sum() / n_tokens),
            "rollout_corr/is_ess": _effective_sample_size(valid),
        })

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
        # the unbounded per-token ratio, over policy tokens only: a threshold below exp(-20) still works
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


# --------------------------------------------------------------------------- a batch's correction (the trainer's step)
def require_rollout_log_probs(batch: Any) -> torch.Tensor:
    """The engine's log-probs of the sampled tokens (rollout correction, bypass mode), when they are
    the distribution the actor recomputes; a clear error otherwise."""
    if K.ROLLOUT_LOG_PROBS not in batch.batch.keys():
        raise RuntimeError("algorithm.rollout_correction needs the engine's log-probs of the sampled tokens, "
                           "and this rollout returned none")
    if not batch.meta_info.get(K.META_ROLLOUT_LOG_PROBS_MATCH_ACTOR, True):
        raise RuntimeError(
            "algorithm.rollout_correction: vLLM returned log-probs renormalised over its top-p / top-k set "
            "(actor_rollout_ref.rollout.top_p < 1 or top_k > 0 at a temperature other than 1), not the "
            "distribution the actor recomputes; sample with top_p=1, top_k=-1 or turn the correction off")
    return batch.batch[K.ROLLOUT_LOG_PROBS]


def mask_cut_context(batch: Any, metrics: dict[str, float]) -> None:
    """Keep tokens sampled from a cut rolling context out of the actor and critic updates.

    When the rolling context dropped old turns, the policy sampled the later tokens from a
    shorter context than the full sequence that old log-probs, values and the update see, so
    their PPO ratio is not an importance ratio of the sampling policy. Advantages are computed
    after, with those tokens still steps of the recursion (the reward sits on the last policy
    token) but out of the whitening statistics; the losses skip them.
    """
    if K.CONTEXT_CUT_MASK not in batch.batch.keys():
        return
    cut_BR = batch.batch[K.CONTEXT_CUT_MASK].to(batch.batch[K.RESPONSE_MASK].dtype)
    response_mask = batch.batch[K.RESPONSE_MASK]
    metrics["env/context_cut_masked_tokens"] = float((response_mask * cut_BR).sum())
    batch.batch[K.RESPONSE_MASK] = response_mask * (1 - cut_BR)


def correct_batch(batch: Any, cfg: RolloutCorrectionConfig, metrics: dict[str, float]) -> None:
    """IS weights (pi_old / pi_rollout) for the actor's policy loss and rejected tokens out of
    response_mask (so out of the losses and, computed next, out of the advantages' statistics), from
    the engine's log-probs and the actor's recomputed ones, written into `batch` (a DataProto)."""
    if not cfg.enabled:
        return
    require_rollout_log_probs(batch)
    # ratios over the tokens the engine sampled (loss_mask), also when state_masking=false puts
    # observations in response_mask
    policy = batch.batch[K.LOSS_MASK] if K.LOSS_MASK in batch.batch.keys() else None
    corr = compute_rollout_correction(
        batch.batch[K.OLD_LOG_PROBS], batch.batch[K.ROLLOUT_LOG_PROBS], batch.batch[K.RESPONSE_MASK], cfg,
        policy_mask=policy)
    batch.batch[K.RESPONSE_MASK] = corr.response_mask
    if corr.weights is not None:
        batch.batch[K.ROLLOUT_IS_WEIGHTS] = corr.weights
    metrics.update(corr.metrics)
