"""Advantages after rollout-correction rejection (`kept_mask`): the recursions run over the trajectory
(`response_mask`), every statistic over the kept tokens only. Values by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from verl.trainer.ppo import core_algos


def test_gae_keeps_a_rejected_last_tokens_reward_and_whitens_over_the_kept_tokens() -> None:
    # gamma = lam = 1. Row 0 scores 2 on its last token, which is rejected; row 1 scores 0.
    rewards = torch.tensor([[0.0, 2.0], [0.0, 0.0]])
    values = torch.tensor([[0.5, 0.25], [0.1, 0.2]])
    trajectory = torch.ones(2, 2, dtype=torch.long)
    kept = torch.tensor([[1, 0], [1, 1]])
    adv, ret = core_algos.compute_gae_advantage_return(rewards, values, trajectory, 1.0, 1.0, kept_mask=kept)
    # raw GAE: row 0: t1 delta = 2 - 0.25 = 1.75; t0 delta = 0.25 - 0.5 = -0.25, gae = 1.5
    #          row 1: t1 delta = -0.2; t0 delta = 0.2 - 0.1 = 0.1, gae = -0.1
    # kept raw 1.5, -0.1, -0.2: mean 0.4, unbiased variance (1.21 + 0.25 + 0.36) / 2 = 0.91
    std = math.sqrt(0.91 + 1e-8)
    torch.testing.assert_close(adv, torch.tensor([[1.1 / std, 0.0], [-0.5 / std, -0.6 / std]]))
    torch.testing.assert_close(ret, torch.tensor([[2.0, 0.0], [0.0, 0.0]]))    # gae + value; 0 where rejected
    # the rejected token's raw advantage (1.75) is in no statistic: changing its value changes nothing kept
    moved = values.clone()
    moved[0, 1] = -40.0
    adv_moved, _ = core_algos.compute_gae_advantage_return(rewards, moved, trajectory, 1.0, 1.0, kept_mask=kept)
    # row 0 t0 raw becomes (-40 - 0.5) + (2 + 40) = 1.5 again: the reward still passes back
    torch.testing.assert_close(adv_moved, adv)


def test_grpo_and_rloo_groups_leave_out_rows_rejected_whole() -> None:
    rewards = torch.zeros(4, 2)
    rewards[:, 1] = torch.tensor([1.0, 0.0, 5.0, 4.0])
    trajectory = torch.ones(4, 2, dtype=torch.long)
    kept = torch.tensor([[1, 1], [1, 0], [0, 0], [1, 1]])        # row 2 rejected whole; row 1 one token
    index = np.array(["a", "a", "a", "a"], dtype=object)
    adv, _ = core_algos.compute_grpo_outcome_advantage(rewards, trajectory, index, kept_mask=kept)
    # members 1, 0, 4: mean 5/3, unbiased std sqrt(((2/3)^2 + (5/3)^2 + (7/3)^2) / 2) = sqrt(13/3)
    std = math.sqrt(13 / 3) + 1e-6
    expected = torch.tensor([[-2 / 3, -2 / 3], [-5 / 3, 0.0], [0.0, 0.0], [7 / 3, 7 / 3]]) / std
    torch.testing.assert_close(adv, expected)
    # the rejected row's score moves nothing
    rewards[2, 1] = -100.0
    torch.testing.assert_close(core_algos.compute_grpo_outcome_advantage(rewards, trajectory, index,
                                                                         kept_mask=kept)[0], expected)
    rloo, _ = core_algos.compute_rloo_outcome_advantage(rewards, trajectory, index, kept_mask=kept)
    # leave-one-out over the members 1, 0, 4: 1 - 2, 0 - 2.5, 4 - 0.5
    torch.testing.assert_close(rloo, torch.tensor([[-1.0, -1.0], [-2.5, 0.0], [0.0, 0.0], [3.5, 3.5]]))


def test_a_group_left_with_one_member_keeps_its_raw_score() -> None:
    rewards = torch.tensor([[0.0, 0.7], [0.0, 0.2]])
    kept = torch.tensor([[1, 1], [0, 0]])
    adv, _ = core_algos.compute_grpo_outcome_advantage(rewards, torch.ones(2, 2), np.array(["a", "a"], dtype=object),
                                                       kept_mask=kept)
    torch.testing.assert_close(adv, torch.tensor([[0.7, 0.7], [0.0, 0.0]]))


# Rows 0-1 one prompt, 2-3 another; row 1 rejected whole, row 3's middle token rejected; row 2 padded.
REWARDS = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 3.0], [0.0, 0.5, 0.0], [0.2, 0.0, 2.0]])
TRAJECTORY = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1]])
KEPT = torch.tensor([[1, 1, 1], [0, 0, 0], [1, 1, 0], [1, 0, 1]])
VALUES = torch.linspace(-0.4, 0.7, 12).reshape(4, 3)
INDEX = np.array(["a", "a", "b", "b"], dtype=object)


@pytest.mark.parametrize("estimator", core_algos.ADV_ESTIMATORS)
def test_compute_advantage_passes_the_kept_mask_to_every_estimator(estimator: str) -> None:
    got = core_algos.compute_advantage(estimator, REWARDS, TRAJECTORY, values=VALUES, index=INDEX, gamma=0.9,
                                       lam=0.8, kept_mask=KEPT)
    unkept = core_algos.compute_advantage(estimator, REWARDS, TRAJECTORY, values=VALUES, index=INDEX, gamma=0.9,
                                          lam=0.8)
    assert not torch.allclose(got[0], unkept[0])
    assert (got[0][KEPT == 0] == 0).all()
    # kept_mask=None is the trajectory itself
    same = core_algos.compute_advantage(estimator, REWARDS, TRAJECTORY, values=VALUES, index=INDEX, gamma=0.9,
                                        lam=0.8, kept_mask=TRAJECTORY)
    torch.testing.assert_close(same[0], unkept[0])
    torch.testing.assert_close(same[1], unkept[1])
