"""The advantage estimators beyond PPO's four (DESIGN §3.5): grpo_passk, rloo_vectorized,
reinforce_plus_plus_baseline, opo, gpg, optimal_token_baseline, remax.

Each registers under its `algorithm.adv_estimator` name and is called with veRL's keyword arguments
(`token_level_rewards`, `response_mask`, `index`, `epsilon`, `norm_adv_by_std_in_grpo`, `config`,
`reward_baselines`, ...) plus this project's `kept_mask`; each returns `(advantages, returns)`, (B, R).

Conventions shared with core_algos' four:
  * `response_mask` is the trajectory's policy tokens (observation spans, e.g. retrieved passages,
    are 0): a return-to-go runs over them only, carrying across an observation span unchanged;
  * `kept_mask` (None: `response_mask`) is what the losses keep after rollout-correction rejection and
    the cut-context mask: group membership (a row with no kept token is no member of its group) and
    every statistic (whitening, lengths, per-step sums) read it, and both outputs are 0 outside it;
  * a score is the row's summed token_level_rewards; a group is the rows sharing a uid (`index`).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from verl.trainer.ppo.registry import register_adv_est
from verl.utils import torch_functional as tf

logger = logging.getLogger(__name__)

# Rules the config check reads: which built-in estimators need a critic, which need uid groups
# (several samples per prompt), which need two samples per prompt at least.
NEEDS_CRITIC = frozenset({"gae"})
NEEDS_GROUPS = frozenset({"grpo", "rloo", "rloo_vectorized", "grpo_passk", "reinforce_plus_plus_baseline",
                          "opo", "gpg", "optimal_token_baseline"})
NEEDS_TWO_PER_GROUP = frozenset({"grpo_passk"})


def config_errors(cfg: DictConfig, samples_per_prompt: int) -> list[str]:
    """The estimator's needs the config must meet (the name itself is checked against the registry
    in run_config.Algorithm). A group estimator with one sample per prompt is refused where it
    cannot work (grpo_passk) and warned about elsewhere (every advantage is the raw score or 0)."""
    from verl.trainer.ppo import remax

    name, errors = str(cfg.algorithm.adv_estimator), []
    key = "actor_rollout_ref.rollout.n_agent * actor_rollout_ref.rollout.n"
    if name in NEEDS_TWO_PER_GROUP and samples_per_prompt < 2:
        errors.append(f"algorithm.adv_estimator={name} compares the best and second-best sample of a prompt: "
                      f"{key} must be >= 2 (got {samples_per_prompt})")
    elif name in NEEDS_GROUPS and samples_per_prompt < 2:
        logger.warning("algorithm.adv_estimator=%s with %s = 1: every group is one row, so there is no group "
                       "baseline (set rollout.n or rollout.n_agent >= 2)", name, key)
    if name == "optimal_token_baseline":
        sum_pi_key = "actor_rollout_ref.actor.calculate_sum_pi_squared"
        if not OmegaConf.select(cfg, sum_pi_key, default=False):
            errors.append(f"algorithm.adv_estimator=optimal_token_baseline reads the actor's sum of squared token "
                          f"probabilities: set {sum_pi_key}=true (veRL's key; the old-log-prob pass computes it)")
        if OmegaConf.select(cfg, "algorithm.rollout_correction.bypass_old_logprob_for_rollout", default=False):
            errors.append("algorithm.adv_estimator=optimal_token_baseline with algorithm.rollout_correction."
                          "bypass_old_logprob_for_rollout=true: bypass mode skips the old-log-prob pass that "
                          "computes sum_pi_squared; set bypass off")
    errors.extend(remax.config_errors(cfg))
    return errors


def kept_float(response_mask: torch.Tensor, kept_mask: torch.Tensor | None) -> torch.Tensor:
    """The tokens the losses keep as a float mask; None: all of `response_mask`."""
    return (response_mask if kept_mask is None else kept_mask).float()


def check_index(index: np.ndarray | None, batch: int, estimator: str) -> np.ndarray:
    if index is None:
        raise ValueError(f"algorithm.adv_estimator={estimator} needs the non-tensor key 'uid' as index")
    if len(index) != batch:
        raise ValueError(f"non-tensor key 'uid' (group index of {estimator}) has {len(index)} rows, batch has {batch}")
    return index


def group_rows(index: np.ndarray, rows_kept: torch.Tensor) -> list[list[int]]:
    """Rows per uid (in first-seen order), the rows with a kept token only."""
    groups: dict[Any, list[int]] = defaultdict(list)
    for row, uid in enumerate(index):
        if bool(rows_kept[row]):
            groups[uid].append(row)
    return list(groups.values())


def return_to_go(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """sum_{k >= t} gamma^(policy steps from t to k) r_k over policy tokens; 0 off them. An observation
    span is no step: the running return passes across it unchanged, and a reward on it is ignored."""
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros(token_level_rewards.shape[0], dtype=returns.dtype, device=returns.device)
    for t in reversed(range(token_level_rewards.shape[1])):
        on_policy = response_mask[:, t].bool()
        running = torch.where(on_policy, token_level_rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(on_policy, running, torch.zeros_like(running))
    return returns


def _outcome(scores: torch.Tensor, kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    advantages = scores.unsqueeze(-1) * kept
    return advantages, advantages


# --------------------------------------------------------------------------- group estimators
@register_adv_est("grpo_passk")
def compute_grpo_passk_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                         index: np.ndarray, epsilon: float = 1e-6,
                                         norm_adv_by_std_in_grpo: bool = True, config: Any = None,
                                         kept_mask: torch.Tensor | None = None, **kwargs: Any,
                                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k (Tang, Zheng, Synnaeve & Munos 2025, arXiv:2503.19595): only the best row of a group gets an
    advantage, r_max - r_second_max, divided by (group std + eps) unless `norm_adv_by_std_in_grpo` is false.
    Ties: the first best row. A group with fewer than 2 kept rows gets 0 (veRL raises; here a
    rejection that leaves one row must not stop a run; the config check refuses rollout.n < 2)."""
    scores = token_level_rewards.sum(dim=-1)
    check_index(index, scores.shape[0], "grpo_passk")
    kept = kept_float(response_mask, kept_mask).to(scores.dtype)
    with torch.no_grad():
        out = torch.zeros_like(scores)
        for rows in group_rows(index, kept.sum(-1) > 0):
            if len(rows) < 2:
                continue
            group = scores[rows]
            order = sorted(range(len(rows)), key=lambda i: (-float(group[i]), i))
            advantage = group[order[0]] - group[order[1]]
            if norm_adv_by_std_in_grpo:
                advantage = advantage / (group.std() + epsilon)
            out[rows[order[0]]] = advantage
    return _outcome(out, kept)


@register_adv_est("rloo_vectorized")
def compute_rloo_vectorized_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                              index: np.ndarray, config: Any = None,
                                              kept_mask: torch.Tensor | None = None, **kwargs: Any,
                                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024, arXiv:2402.14740) without a Python loop over groups:
    score_i - (group sum - score_i) / (n - 1); a group of one keeps its score, as `rloo`.
    Equal to `rloo` on every batch (a test pins it)."""
    scores = token_level_rewards.sum(dim=-1)
    check_index(index, scores.shape[0], "rloo_vectorized")
    kept = kept_float(response_mask, kept_mask).to(scores.dtype)
    with torch.no_grad():
        member = (kept.sum(-1) > 0).to(scores.dtype)
        group_id = torch.from_numpy(np.unique(np.asarray(index, dtype=str), return_inverse=True)[1].reshape(-1))
        group_id = group_id.to(scores.device)
        count = torch.bincount(group_id, weights=member)[group_id].to(scores.dtype)
        total = torch.bincount(group_id, weights=scores * member)[group_id].to(scores.dtype)
        loo = (count * scores - total) / (count - 1).clamp_min(1)
        out = torch.where(count > 1, loo, scores)
    return _outcome(out, kept)


@register_adv_est("reinforce_plus_plus_baseline")
def compute_reinforce_plus_plus_baseline_outcome_advantage(
        token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: np.ndarray, epsilon: float = 1e-6,
        config: Any = None, kept_mask: torch.Tensor | None = None, **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (Hu 2025, arXiv:2501.03262): score - group mean on every kept token, then
    whitened over all kept tokens of the batch (a group of one: mean 0)."""
    scores = token_level_rewards.sum(dim=-1)
    check_index(index, scores.shape[0], "reinforce_plus_plus_baseline")
    kept = kept_float(response_mask, kept_mask).to(scores.dtype)
    with torch.no_grad():
        centred = scores.clone()
        for rows in group_rows(index, kept.sum(-1) > 0):
            if len(rows) > 1:
                centred[rows] = scores[rows] - scores[rows].mean()
        advantages = tf.masked_whiten(centred.unsqueeze(-1) * kept, kept) * kept
    return advantages, advantages


@register_adv_est("opo")
def compute_opo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                  index: np.ndarray, epsilon: float = 1e-6, config: Any = None,
                                  kept_mask: torch.Tensor | None = None, **kwargs: Any,
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (Hao et al. 2025, arXiv:2505.23585): the length-weighted group baseline
    b = sum_j |o_j| r_j / sum_j |o_j|, |o_j| the row's kept policy tokens; advantage r_i - b
    (a group of one: b = 0). A group whose kept rows are all empty cannot occur (empty rows are no members)."""
    scores = token_level_rewards.sum(dim=-1)
    check_index(index, scores.shape[0], "opo")
    kept = kept_float(response_mask, kept_mask).to(scores.dtype)
    lengths = kept.sum(-1)
    with torch.no_grad():
        out = scores.clone()
        for rows in group_rows(index, lengths > 0):
            if len(rows) > 1:
                baseline = (lengths[rows] * scores[rows]).sum() / lengths[rows].sum()
                out[rows] = scores[rows] - baseline
    return _outcome(out, kept)


@register_adv_est("gpg")
def compute_gpg_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                  index: np.ndarray, epsilon: float = 1e-6, f_norm: float = 1.0,
                                  config: Any = None, kept_mask: torch.Tensor | None = None, **kwargs: Any,
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (Chu et al. 2025, arXiv:2504.02546): alpha * (score - group mean) / f_norm with the paper's
    correction alpha = B / (B - M): B the kept rows of the batch, M those in groups (of 2 or more) whose
    scores are all equal, which carry no gradient. A group of one has mean 0. veRL takes B - M as the
    count of nonzero scores instead, which differs as soon as a group mixes 0 and 1 (groups [1,0,0],
    [0,0,0], [1,1,0]: veRL's alpha 9 / 3 = 3.0, the paper's 9 / 6 = 1.5)."""
    scores = token_level_rewards.sum(dim=-1)
    check_index(index, scores.shape[0], "gpg")
    kept = kept_float(response_mask, kept_mask).to(scores.dtype)
    with torch.no_grad():
        centred = scores.clone()
        groups = group_rows(index, kept.sum(-1) > 0)
        rows_total = sum(len(rows) for rows in groups)
        homogeneous = 0
        for rows in groups:
            if len(rows) > 1:
                group = scores[rows]
                centred[rows] = group - group.mean()
                homogeneous += len(rows) if bool((group == group[0]).all()) else 0
        alpha = rows_total / max(rows_total - homogeneous, 1)
        out = alpha * centred / f_norm
    return _outcome(out, kept)


@register_adv_est("optimal_token_baseline")
def compute_optimal_token_baseline_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                             index: np.ndarray, old_log_probs: torch.Tensor | None = None,
                                             sum_pi_squared: torch.Tensor | None = None,
                                             rollout_is_weights: torch.Tensor | None = None,
                                             epsilon: float = 1e-8, config: Any = None,
                                             kept_mask: torch.Tensor | None = None, **kwargs: Any,
                                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal token baseline (veRL's docs/algo/otb.md): per policy step k and group,
    B_k = sum_i G_ik W_ik / sum_i W_ik, with G_ik the return-to-go at the row's k-th policy token and
    W_ik = sum_{j<=k} (1 - 2 pi_ij + sum_v pi_ijv^2) (times rho_ij^2 with rollout IS weights) the
    cumulative path-variance proxy; advantage G_ik - B_k. Steps count policy tokens only (an
    observation span is no step, veRL's multi-turn variant). A group of one: B = 0.
    The sums over i take the kept tokens of the group's kept rows."""
    if old_log_probs is None or sum_pi_squared is None:
        raise ValueError("algorithm.adv_estimator=optimal_token_baseline needs the batch keys 'old_log_probs' and "
                         "'sum_pi_squared' (sum of squared token probabilities from the actor)")
    scores_dtype = token_level_rewards.dtype
    check_index(index, token_level_rewards.shape[0], "optimal_token_baseline")
    kept = kept_float(response_mask, kept_mask).to(scores_dtype)
    with torch.no_grad():
        returns = return_to_go(token_level_rewards, response_mask)
        w = 1.0 - 2.0 * torch.exp(old_log_probs.to(scores_dtype)) + sum_pi_squared.to(scores_dtype)
        if rollout_is_weights is not None:
            w = w * rollout_is_weights.to(scores_dtype) ** 2
        policy = response_mask.bool()
        w_cum = torch.cumsum(w * policy.to(scores_dtype), dim=-1)
        step = torch.cumsum(policy.long(), dim=-1) - 1          # k of each policy token
        advantages = torch.zeros_like(returns)
        for rows in group_rows(index, kept.sum(-1) > 0):
            if len(rows) == 1:
                advantages[rows] = returns[rows]
                continue
            steps = int(policy[rows].sum(-1).max())
            num = torch.zeros(steps, dtype=scores_dtype)
            den = torch.zeros(steps, dtype=scores_dtype)
            for row in rows:
                on = policy[row] & kept[row].bool()
                num.index_add_(0, step[row][on], (returns[row] * w_cum[row])[on])
                den.index_add_(0, step[row][on], w_cum[row][on])
            baseline = num / (den + epsilon)
            for row in rows:
                on = policy[row]
                advantages[row, on] = returns[row, on] - baseline[step[row][on]]
        advantages = advantages * kept
    return advantages, returns * kept


# --------------------------------------------------------------------------- remax
@register_adv_est("remax")
def compute_remax_outcome_advantage(token_level_rewards: torch.Tensor, reward_baselines: torch.Tensor,
                                    response_mask: torch.Tensor, config: Any = None,
                                    kept_mask: torch.Tensor | None = None, **kwargs: Any,
                                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023, arXiv:2310.10505): return-to-go over policy tokens minus the score of
    the prompt's greedy rollout (`reward_baselines`, (B,), made by the trainer: verl/trainer/ppo/remax.py)."""
    if reward_baselines is None:
        raise ValueError("algorithm.adv_estimator=remax needs the batch key 'reward_baselines' (the greedy "
                         "rollout's scores; the trainer makes them)")
    kept = kept_float(response_mask, kept_mask).to(token_level_rewards.dtype)
    with torch.no_grad():
        returns = return_to_go(token_level_rewards, response_mask)
        advantages = (returns - reward_baselines.to(returns.dtype).unsqueeze(-1)) * kept
    return advantages, returns * kept
