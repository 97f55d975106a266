"""The driver's rollout-correction glue (RayPPOTrainer._reward_masks_advantages): rejection before the
advantages, so rejected tokens shape no statistic of the kept ones, while a rejected token that
carries the outcome reward still passes it back; and a pipelined run's default token IS only when no
other correction is chosen. No workers: the stage runs in the driver on a hand-made batch."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from verl.protocol import DataProto
from verl.trainer.main_ppo import compose_config
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.utils import batch_keys as K

PREFIX = "algorithm.rollout_correction"


def _trainer(overrides: list[str], scores_BR: torch.Tensor, pipelined: bool = False) -> RayPPOTrainer:
    trainer = RayPPOTrainer.__new__(RayPPOTrainer)
    trainer.config = compose_config(overrides)
    trainer.reward_fn = lambda batch: scores_BR
    trainer.use_kl_in_reward, trainer._bypass_old_log_prob, trainer.use_critic = False, False, False
    trainer.pipelined = pipelined
    return trainer


def _batch(log_ratio_BR: torch.Tensor, mask_BR: torch.Tensor, uids: list[str]) -> DataProto:
    """old log-probs - engine log-probs = `log_ratio_BR` on the policy tokens (`mask_BR`)."""
    rollout = torch.full(log_ratio_BR.shape, -1.0)
    return DataProto.from_dict(
        tensors={K.RESPONSE_MASK: mask_BR.clone(), K.LOSS_MASK: mask_BR.clone(),
                 K.OLD_LOG_PROBS: rollout + log_ratio_BR, K.ROLLOUT_LOG_PROBS: rollout},
        non_tensors={K.UID: np.array(uids, dtype=object)})


def test_a_rejected_row_leaves_its_grpo_group_before_the_advantages() -> None:
    # group a: rows 0-2 scoring 1, 0, 5; row 2's sequence ratio is e^3 > 2: rejected. Group b: row 3.
    scores = torch.zeros(4, 3)
    scores[0, 2], scores[1, 2], scores[2, 2], scores[3, 1] = 1.0, 0.0, 5.0, 2.0
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 0]])
    log_ratio = torch.zeros(4, 3)
    log_ratio[2] = 1.0
    trainer = _trainer(["algorithm.adv_estimator=grpo", f"{PREFIX}.rollout_rs=sequence",
                        f"{PREFIX}.rollout_rs_threshold=2.0"], scores)
    batch = _batch(log_ratio, mask, ["a", "a", "a", "b"])
    metrics: dict[str, float] = {}
    trainer._reward_masks_advantages(batch, metrics)
    assert batch.batch[K.RESPONSE_MASK][2].tolist() == [0, 0, 0]
    assert metrics["rollout_corr/rejected_seq_frac"] == pytest.approx(0.25)
    # group a is rows 0 and 1: mean 0.5, unbiased std sqrt(0.5); a group of one keeps its raw score
    kept = 0.5 / (math.sqrt(0.5) + 1e-6)
    expected = torch.tensor([[kept] * 3, [-kept] * 3, [0.0] * 3, [2.0, 2.0, 0.0]])
    torch.testing.assert_close(batch.batch[K.ADVANTAGES], expected)


def test_a_rejected_token_carrying_the_reward_still_passes_it_back_but_shapes_no_statistic() -> None:
    # REINFORCE++, gamma 1: row 0 scores 1 on its last token, whose ratio e^1 > 2 is rejected
    # (token rejection); row 1 scores 3. Returns over the trajectory: [1, 1, 1] and [3, 3, 3].
    scores = torch.zeros(2, 3)
    scores[0, 2], scores[1, 2] = 1.0, 3.0
    log_ratio = torch.zeros(2, 3)
    log_ratio[0, 2] = 1.0
    trainer = _trainer(["algorithm.adv_estimator=reinforce_plus_plus", "algorithm.gamma=1.0",
                        f"{PREFIX}.rollout_rs=token", f"{PREFIX}.rollout_rs_threshold=2.0"], scores)
    batch = _batch(log_ratio, torch.ones(2, 3, dtype=torch.long), ["a", "b"])
    trainer._reward_masks_advantages(batch, {})
    assert batch.batch[K.RESPONSE_MASK].tolist() == [[1, 1, 0], [1, 1, 1]]
    # whitened over the 5 kept returns 1, 1, 3, 3, 3: mean 2.2, unbiased variance 4.8 / 4 = 1.2
    std = math.sqrt(1.2 + 1e-8)
    low, high = (1 - 2.2) / std, (3 - 2.2) / std
    torch.testing.assert_close(batch.batch[K.ADVANTAGES], torch.tensor([[low, low, 0.0], [high, high, high]]))
    torch.testing.assert_close(batch.batch[K.RETURNS], torch.tensor([[1.0, 1.0, 0.0], [3.0, 3.0, 3.0]]))


@pytest.mark.parametrize(("overrides", "weights", "mask"), [
    # no correction chosen: the pipeline's default token IS (ratios e^0.5 = 1.65 and e^1 truncated to 2)
    ([], [[1.0, math.exp(0.5), 2.0]], [[1, 1, 1]]),
    # rejection only: no IS is added; the token above 2 is rejected
    ([f"{PREFIX}.rollout_rs=token", f"{PREFIX}.rollout_rs_threshold=2.0"], None, [[1, 1, 0]]),
    # the default IS turned off explicitly: nothing at all
    ([f"{PREFIX}.rollout_is=null"], None, [[1, 1, 1]]),
])
def test_a_pipeline_adds_token_is_only_when_no_correction_is_chosen(overrides: list[str], weights: list | None,
                                                                    mask: list) -> None:
    trainer = _trainer(["algorithm.adv_estimator=grpo", *overrides], torch.zeros(1, 3), pipelined=True)
    batch = _batch(torch.tensor([[0.0, 0.5, 1.0]]), torch.ones(1, 3, dtype=torch.long), ["a"])
    metrics: dict[str, float] = {}
    trainer._apply_rollout_correction(batch, metrics)
    assert batch.batch[K.RESPONSE_MASK].tolist() == mask
    if weights is None:
        assert K.ROLLOUT_IS_WEIGHTS not in batch.batch.keys()
        assert "rollout_corr/is_weight_mean" not in metrics
    else:
        torch.testing.assert_close(batch.batch[K.ROLLOUT_IS_WEIGHTS], torch.tensor(weights))
    # the same config in a sync run adds nothing by default
    sync = _trainer(["algorithm.adv_estimator=grpo"], torch.zeros(1, 3))
    batch = _batch(torch.tensor([[0.0, 0.5, 1.0]]), torch.ones(1, 3, dtype=torch.long), ["a"])
    sync._apply_rollout_correction(batch, metrics)
    assert K.ROLLOUT_IS_WEIGHTS not in batch.batch.keys()
