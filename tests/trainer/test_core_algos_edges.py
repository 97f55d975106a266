"""core_algos at the edges mutation testing found unpinned (docs/testing.md): `compute_advantage`
passes every argument through to each estimator, its defaults and errors, and RLOO's small groups."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from verl.trainer.ppo import core_algos

# 4 rows x 5 tokens, two prompts (uid a, b), an observation hole in rows 0 and 2, a padded tail in row 3.
MASK = torch.tensor([[1, 0, 0, 1, 1], [1, 1, 1, 1, 1], [1, 1, 0, 1, 0], [1, 1, 1, 0, 0]])
REWARDS = torch.zeros(4, 5)
REWARDS[0, 4], REWARDS[1, 4], REWARDS[2, 3], REWARDS[3, 2] = 1.0, 0.0, 0.5, 2.0
REWARDS[1, 1] = -0.1     # a per-token (KL-like) reward too: GAE and REINFORCE++ see where rewards sit
VALUES = torch.linspace(-0.3, 0.6, 20).reshape(4, 5)
INDEX = np.array(["a", "a", "b", "b"], dtype=object)


def _direct(estimator: str, gamma: float, lam: float, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if estimator == "gae":
        return core_algos.compute_gae_advantage_return(REWARDS, VALUES, MASK, gamma, lam)
    if estimator == "grpo":
        return core_algos.compute_grpo_outcome_advantage(REWARDS, MASK, INDEX, norm_adv_by_std_in_grpo=norm)
    if estimator == "rloo":
        return core_algos.compute_rloo_outcome_advantage(REWARDS, MASK, INDEX)
    return core_algos.compute_reinforce_plus_plus_outcome_advantage(REWARDS, MASK, gamma)


@pytest.mark.parametrize("estimator", core_algos.ADV_ESTIMATORS)
@pytest.mark.parametrize("norm", [True, False])
def test_compute_advantage_passes_every_argument_to_the_estimator(estimator, norm):
    adv, ret = core_algos.compute_advantage(estimator, REWARDS, MASK, values=VALUES, index=INDEX, gamma=0.9,
                                            lam=0.8, norm_adv_by_std_in_grpo=norm)
    want_adv, want_ret = _direct(estimator, 0.9, 0.8, norm)
    assert torch.isfinite(adv).all() and adv.abs().sum() > 0
    torch.testing.assert_close(adv, want_adv)
    torch.testing.assert_close(ret, want_ret)
    assert (adv[MASK == 0] == 0).all()


@pytest.mark.parametrize("estimator", ["gae", "reinforce_plus_plus"])
def test_compute_advantage_defaults_to_gamma_and_lambda_one_and_needs_no_index(estimator):
    adv, ret = core_algos.compute_advantage(estimator, REWARDS, MASK, values=VALUES)
    want_adv, want_ret = _direct(estimator, 1.0, 1.0, True)
    torch.testing.assert_close(adv, want_adv)
    torch.testing.assert_close(ret, want_ret)
    # The defaults matter: gamma = 0.9 gives other returns.
    _, discounted = _direct(estimator, 0.9, 1.0, True)
    assert not torch.allclose(ret, discounted)


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_group_estimators_without_uid_name_the_key(estimator):
    with pytest.raises(ValueError) as err:
        core_algos.compute_advantage(estimator, REWARDS, MASK)
    assert str(err.value) == f"algorithm.adv_estimator={estimator} needs the non-tensor key 'uid' as index"


def test_gae_without_values_names_the_key():
    with pytest.raises(ValueError) as err:
        core_algos.compute_advantage("gae", REWARDS, MASK)
    assert str(err.value) == "algorithm.adv_estimator=gae needs the batch key 'values' (a critic)"


def test_rloo_group_of_one_keeps_its_score_and_group_of_two_subtracts_the_other():
    rewards = torch.tensor([[0.0, 3.0], [0.0, 1.0], [0.0, 0.0]])
    mask = torch.tensor([[1, 1], [0, 1], [1, 1]])
    adv, ret = core_algos.compute_rloo_outcome_advantage(rewards, mask, np.array(["solo", "pair", "pair"],
                                                                                 dtype=object))
    # solo: 3 (no baseline); pair: 1 - 0 = 1 and 0 - 1 = -1; the observation position of row 1 stays 0.
    assert adv.tolist() == [[3.0, 3.0], [0.0, 1.0], [-1.0, -1.0]]
    assert torch.equal(adv, ret)


def test_kl_penalty_defaults_to_k1_and_reports_the_mean_of_per_row_means():
    scores = torch.zeros(2, 4)
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0], [-1.0, -1.0, -1.0, -1.0]])
    ref = torch.tensor([[-2.0, -1.0, -1.0, -1.0], [-1.5, -1.5, -1.5, -1.5]])   # k1: [1, 0, 0, 0], [0.5] * 4
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1]])
    rewards, metrics = core_algos.apply_kl_penalty(scores, old, ref, mask, core_algos.FixedKLController(0.1))
    torch.testing.assert_close(rewards, torch.tensor([[-0.1, 0.0, 0.0, 0.0], [-0.05] * 4]))   # k1, not k2/k3/abs
    # Each row's masked mean (1 and 0.5), then their mean: 0.75. A token mean over the batch would be 3/5.
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.75)


def test_kl_controller_type_defaults_to_fixed():
    ctrl = core_algos.get_kl_controller(OmegaConf.create({"kl_coef": 0.02}))
    assert isinstance(ctrl, core_algos.FixedKLController) and ctrl.value == 0.02


def test_group_index_of_the_wrong_length_names_both_lengths():
    with pytest.raises(ValueError) as err:
        core_algos.compute_advantage("grpo", REWARDS, MASK, index=INDEX[:3])
    assert str(err.value) == "non-tensor key 'uid' (GRPO/RLOO group index) has 3 rows, batch has 4"


def test_grpo_epsilon_is_added_to_a_tiny_std():
    # Scores 0 and 1e-6: std 7.07e-7 is below epsilon (1e-6); (x - mean) / (std + eps) keeps the sign.
    rewards = torch.tensor([[0.0], [1e-6]])
    adv, _ = core_algos.compute_grpo_outcome_advantage(rewards, torch.ones(2, 1), np.array(["g", "g"], dtype=object))
    std = float(rewards.flatten().std())
    expected = [-5e-7 / (std + 1e-6), 5e-7 / (std + 1e-6)]
    assert adv.flatten().tolist() == pytest.approx(expected, rel=1e-4)


def test_policy_loss_ratio_is_new_over_old_probability():
    old = torch.log(torch.tensor([[0.5, 0.2]]))
    new = torch.log(torch.tensor([[0.55, 0.2]]))              # ratios 1.1 and 1.0, both inside the clip
    pg_loss, clipfrac, ppo_kl, _ = core_algos.compute_policy_loss(old, new, torch.ones(1, 2), torch.ones(1, 2), 0.2)
    assert pg_loss.item() == pytest.approx(-(1.1 + 1.0) / 2)
    assert clipfrac.item() == 0.0
    assert ppo_kl.item() == pytest.approx(-math.log(1.1) / 2)


def test_value_loss_clips_a_prediction_far_below_the_old_value():
    values, vpreds, returns = torch.tensor([[1.0]]), torch.tensor([[-3.0]]), torch.tensor([[-2.0]])
    vf_loss, clipfrac = core_algos.compute_value_loss(vpreds, returns, values, torch.ones(1, 1), cliprange_value=0.5)
    # clip(-3) to [0.5, 1.5] = 0.5: (0.5 + 2)^2 = 6.25 > (-3 + 2)^2 = 1 -> 0.5 * 6.25
    assert vf_loss.item() == pytest.approx(3.125)
    assert clipfrac.item() == 1.0


def test_adaptive_kl_horizon_must_be_positive():
    assert core_algos.AdaptiveKLController(init_kl_coef=0.1, target_kl=1.0, horizon=1).horizon == 1
    with pytest.raises(ValueError) as err:
        core_algos.AdaptiveKLController(init_kl_coef=0.1, target_kl=1.0, horizon=0)
    assert str(err.value) == "algorithm.kl_ctrl.horizon must be > 0, got 0"


def test_the_ppo_ratio_is_bounded_so_a_near_impossible_old_token_gives_a_finite_loss() -> None:
    # bypass mode anchors on the engine: a token it gave log-prob -200 that the policy now finds likely
    # would make exp(log-ratio) inf, and a zero advantage elsewhere then 0 * inf = NaN
    old = torch.tensor([[-200.0, -1.0]])
    new = torch.tensor([[-0.5, -1.0]])
    adv, mask = torch.tensor([[0.0, -1.0]]), torch.ones(1, 2)
    loss, _, ppo_kl, _ = core_algos.compute_policy_loss(old, new, adv, mask, cliprange=0.2)
    assert torch.isfinite(loss) and torch.isfinite(ppo_kl)
    bound = core_algos.LOG_RATIO_CLAMP
    assert float(ppo_kl) == pytest.approx(-bound / 2)        # mean of -clamp(199.5) and -0
    assert float(loss) == pytest.approx((0.0 + 1.0) / 2)     # token 2: ratio 1, advantage -1
    # inside the bound nothing changes: the ratio is exp(new - old) exactly
    small, _, _, _ = core_algos.compute_policy_loss(torch.tensor([[-1.0]]), torch.tensor([[-0.9]]),
                                                 torch.tensor([[1.0]]), torch.ones(1, 1), cliprange=0.5)
    assert float(small) == pytest.approx(-math.exp(0.1))


def test_the_ppo_log_ratio_is_bounded_below_too() -> None:
    # the policy now finds nearly impossible a token the old policy sampled: the log-ratio stops at -bound
    bound = core_algos.LOG_RATIO_CLAMP
    old, new = torch.tensor([[-0.5]]), torch.tensor([[-0.5 - 3 * bound]])
    _, _, ppo_kl, _ = core_algos.compute_policy_loss(old, new, torch.tensor([[1.0]]), torch.ones(1, 1), cliprange=0.2)
    assert float(ppo_kl) == pytest.approx(bound)


def test_rollout_correction_weights_multiply_each_tokens_clipped_loss() -> None:
    old = torch.log(torch.tensor([[0.5, 0.2, 0.4]]))
    new = torch.log(torch.tensor([[0.55, 0.2, 0.8]]))          # ratios 1.1, 1.0 and 2.0 (clipped to 1.2)
    adv, mask = torch.ones(1, 3), torch.ones(1, 3)
    weights = torch.tensor([[2.0, 0.5, 0.25]], dtype=torch.float64)
    plain, clipfrac, kl, _ = core_algos.compute_policy_loss(old, new, adv, mask, 0.2)
    weighted, w_clipfrac, w_kl, _ = core_algos.compute_policy_loss(old, new, adv, mask, 0.2, is_weights=weights)
    assert float(plain) == pytest.approx(-(1.1 + 1.0 + 1.2) / 3)
    assert float(weighted) == pytest.approx(-(1.1 * 2.0 + 1.0 * 0.5 + 1.2 * 0.25) / 3)
    assert weighted.dtype == torch.float32
    # the weights scale the loss only: clip fraction and KL are the unweighted ones
    assert (float(w_clipfrac), float(w_kl)) == (float(clipfrac), float(kl))


def test_low_var_kl_on_a_padding_token_far_below_the_reference_leaves_the_gradient_finite() -> None:
    """The actor's KL loss (kl_penalty, then the masked aggregate) with ref - logp = 100 on a padding token:
    in fp32 exp(100) is inf, and without a clamp before the exp the backward of the outer [-10, 10] clamp
    gives 0 * inf = NaN there, which made the whole gradient NaN and the optimizer step skipped. The
    log-ratio is clamped first (veRL's +-20): the loss and every gradient are finite, the policy tokens'
    gradient is k3's own and the padding token's is 0."""
    from verl.utils import torch_functional as tf

    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    ref = torch.tensor([[-1.2, -1.5, -0.5 + 100.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss = tf.agg_loss(core_algos.kl_penalty(logp, ref, "low_var_kl"), mask, "token-mean")
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(logp.grad).all(), logp.grad
    # d/dlogp [e^(q - p) - (q - p) - 1] = 1 - e^(q - p), over the 2 policy tokens
    kept = (1.0 - torch.exp(ref[0, :2] - logp.detach()[0, :2])) / 2
    torch.testing.assert_close(logp.grad, torch.cat([kept, torch.zeros(1)]).unsqueeze(0))
    # on a policy token the estimate itself is unchanged: capped at 10 as before
    far = core_algos.kl_penalty(torch.tensor([[-1.0]]), torch.tensor([[99.0]]), "low_var_kl")
    assert float(far) == 10.0
