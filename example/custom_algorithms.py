"""An example custom_algorithms.path file: one policy loss and one advantage estimator of your own.

    python -m verl.trainer.main_ppo custom_algorithms.path=example/custom_algorithms.py \
        actor_rollout_ref.actor.policy_loss.loss_mode=reinforce_clipped_weight \
        algorithm.adv_estimator=group_mean_baseline

The driver imports this file before its start-up checks and every actor worker imports it before
it looks its loss up (docs/algorithms.md, "Policy losses"). Each decorator registers its function
under the name that the config keys then accept.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import torch

from verl.trainer.ppo.registry import register_adv_est, register_policy_loss
from verl.utils import torch_functional as tf


@register_policy_loss("reinforce_clipped_weight")
def reinforce_clipped_weight(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                             response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                             rollout_is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """-min(r, 2) A log pi per token, the weight detached (a REINFORCE with a capped importance weight)."""
    keep = response_mask.bool()
    zero = torch.zeros((), dtype=log_prob.dtype)
    # select, not multiply: padding and retrieved tokens may hold any value, NaN included
    log_prob = torch.where(keep, log_prob, zero)
    log_ratio = torch.where(keep, log_prob - old_log_prob, zero).clamp(-20.0, 20.0)
    weight = torch.exp(log_ratio).clamp(max=2.0).detach()
    per_token = -weight * torch.where(keep, advantages, zero) * log_prob
    if rollout_is_weights is not None:
        per_token = per_token * torch.where(keep, rollout_is_weights, zero)
    loss = tf.agg_loss(per_token, response_mask, loss_agg_mode)
    return loss, {"actor/ppo_kl": float(tf.masked_mean(-log_ratio, response_mask))}


@register_adv_est("group_mean_baseline")
def group_mean_baseline(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: np.ndarray,
                        **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's score (its token rewards summed) minus the mean score of its prompt's group,
    broadcast over its policy tokens; returns = advantages."""
    scores = (token_level_rewards * response_mask).sum(dim=-1)
    groups: dict[Any, list[int]] = defaultdict(list)
    for row, key in enumerate(index):
        groups[key].append(row)
    centred = scores.clone()
    for rows in groups.values():
        centred[rows] = scores[rows] - scores[rows].mean()
    advantages = centred.unsqueeze(-1) * response_mask
    return advantages, advantages
