"""rollout/log_prob_gap_*: the engine's log-probs against the actor's recomputation, over policy tokens."""

from __future__ import annotations

import torch

from verl.protocol import DataProto
from verl.trainer.ppo.metric_utils import compute_rollout_log_prob_gap
from verl.utils import batch_keys as K


def _batch(rollout_lp, old_lp, response_mask, cut=None, loss_mask=None) -> DataProto:
    tensors = {K.ROLLOUT_LOG_PROBS: torch.tensor(rollout_lp), K.OLD_LOG_PROBS: torch.tensor(old_lp),
               K.RESPONSE_MASK: torch.tensor(response_mask)}
    if cut is not None:
        tensors[K.CONTEXT_CUT_MASK] = torch.tensor(cut)
    if loss_mask is not None:
        tensors[K.LOSS_MASK] = torch.tensor(loss_mask)
    return DataProto.from_dict(tensors=tensors)


def test_gap_is_mean_and_max_over_policy_tokens_only() -> None:
    batch = _batch([[-1.0, -2.0, -9.0], [-0.5, 0.0, 0.0]],
                   [[-1.5, -2.0, -1.0], [-0.25, 0.0, 0.0]],
                   [[1, 1, 0], [1, 0, 0]])          # -9 vs -1 sits on an observation token
    gap = compute_rollout_log_prob_gap(batch)
    assert gap["rollout/log_prob_gap_max"] == 0.5
    assert abs(gap["rollout/log_prob_gap_mean"] - (0.5 + 0.0 + 0.25) / 3) < 1e-7


def test_tokens_sampled_from_a_cut_context_are_left_out() -> None:
    batch = _batch([[-1.0, -5.0]], [[-1.0, -1.0]], [[1, 1]], cut=[[0, 1]])
    assert compute_rollout_log_prob_gap(batch) == {"rollout/log_prob_gap_mean": 0.0, "rollout/log_prob_gap_max": 0.0}


def test_no_engine_log_probs_no_metric() -> None:
    batch = DataProto.from_dict(tensors={K.OLD_LOG_PROBS: torch.zeros(1, 2), K.RESPONSE_MASK: torch.ones(1, 2)})
    assert compute_rollout_log_prob_gap(batch) == {}


def test_gap_reads_the_tokens_the_engine_sampled_not_observations_in_the_loss() -> None:
    # actor.state_masking=false: response_mask holds the observation (column 1), which the engine did
    # not sample (its rollout log-prob is a 0.0 placeholder); loss_mask marks the sampled tokens
    batch = _batch([[-1.0, 0.0, -2.0, 0.0]], [[-1.25, -9.0, -2.0, -3.0]], [[1, 1, 1, 0]],
                   cut=[[0, 0, 0, 0]], loss_mask=[[1, 0, 1, 0]])
    gap = compute_rollout_log_prob_gap(batch)
    assert gap == {"rollout/log_prob_gap_mean": 0.125, "rollout/log_prob_gap_max": 0.25}
