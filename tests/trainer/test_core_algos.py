"""PPO / GRPO algorithm core checked against values worked out by hand."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from verl.trainer.ppo import core_algos
from verl.utils.torch_functional import masked_whiten

CONFIG = Path(__file__).resolve().parents[2] / "verl" / "trainer" / "config" / "ppo_trainer.yaml"

# Tolerances: each expected value is a handful of fp32 element-wise ops (no long reductions), so
# any CPU, FMA or not, lands within a few ulps (~4e-7 relative); pytest.approx's default rel=1e-6
# covers that. Exact == is used only where the result is exact by construction (masked zeros,
# clamps, counts, stored constants).

# Shared 3-step trajectory: reward 1 at the end, values v = [0.5, 0.2, 0.4].
REWARDS = torch.tensor([[0.0, 0.0, 1.0]])
VALUES = torch.tensor([[0.5, 0.2, 0.4]])
FULL_MASK = torch.ones(1, 3)


def test_gae_with_gamma_lambda_one_is_return_minus_value():
    adv, ret = core_algos._gae_unwhitened(REWARDS, VALUES, FULL_MASK, gamma=1.0, lam=1.0)
    # t=2: delta = 1 + 0 - 0.4 = 0.6                  -> A2 = 0.6
    # t=1: delta = 0 + 0.4 - 0.2 = 0.2                -> A1 = 0.2 + 0.6 = 0.8
    # t=0: delta = 0 + 0.2 - 0.5 = -0.3               -> A0 = -0.3 + 0.8 = 0.5
    assert adv.tolist()[0] == pytest.approx([0.5, 0.8, 0.6])
    # returns = A + V = [1, 1, 1] (undiscounted reward-to-go)
    assert ret.tolist()[0] == pytest.approx([1.0, 1.0, 1.0])


def test_gae_with_discount_and_lambda():
    adv, ret = core_algos._gae_unwhitened(REWARDS, VALUES, FULL_MASK, gamma=0.9, lam=0.5)
    # gamma*lam = 0.45
    # t=2: delta = 1 - 0.4 = 0.6                       -> A2 = 0.6
    # t=1: delta = 0.9*0.4 - 0.2 = 0.16                -> A1 = 0.16 + 0.45*0.6 = 0.43
    # t=0: delta = 0.9*0.2 - 0.5 = -0.32               -> A0 = -0.32 + 0.45*0.43 = -0.1265
    assert adv.tolist()[0] == pytest.approx([-0.1265, 0.43, 0.6])
    # returns = A + V = [0.3735, 0.63, 1.0]
    assert ret.tolist()[0] == pytest.approx([0.3735, 0.63, 1.0])


def test_gae_skips_observation_span_as_if_it_were_removed():
    # policy, policy, obs, obs, policy, pad -- values on obs/pad are junk that must not leak in.
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.2, 9.0, 9.0, 0.4, 7.0]])
    mask = torch.tensor([[1, 1, 0, 0, 1, 0]])
    adv, ret = core_algos._gae_unwhitened(rewards, values, mask, gamma=0.9, lam=0.5)
    # Same numbers as the 3-step trajectory without the span, zeros on obs and pad.
    assert adv.tolist()[0] == pytest.approx([-0.1265, 0.43, 0.0, 0.0, 0.6, 0.0])
    assert ret.tolist()[0] == pytest.approx([0.3735, 0.63, 0.0, 0.0, 1.0, 0.0])


def test_public_gae_whitens_over_mask_and_zeroes_observations():
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.5, 0.0, 0.0, 0.0]])
    values = torch.tensor([[0.5, 0.2, 9.0, 9.0, 0.4, 7.0], [0.1, 0.3, 0.2, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0]])
    raw_adv, raw_ret = core_algos._gae_unwhitened(rewards, values, mask, 0.9, 0.5)
    adv, ret = core_algos.compute_gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.5)
    assert torch.allclose(adv, masked_whiten(raw_adv, mask.float()) * mask)
    assert torch.allclose(ret, raw_ret)
    assert adv[mask == 0].abs().max().item() == 0.0
    kept = adv[mask == 1]
    assert kept.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert kept.std().item() == pytest.approx(1.0, abs=1e-4)


def test_grpo_group_of_one_keeps_raw_score():
    rewards = torch.tensor([[0.0, 0.7, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    adv, ret = core_algos.compute_grpo_outcome_advantage(rewards, mask, np.array(["solo"], dtype=object))
    # mean 0, std 1 -> 0.7 / (1 + 1e-6) on policy tokens
    assert adv.tolist()[0] == pytest.approx([0.7, 0.7, 0.0], rel=1e-5)
    assert torch.equal(adv, ret)


def test_grpo_group_of_three_normalises_within_its_uid_only():
    # rows 0, 2, 3 share uid "a" (scores 1, 0, 0); row 1 is alone in "b" (score 1).
    rewards = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 0]])
    index = np.array(["a", "b", "a", "a"], dtype=object)
    adv, _ = core_algos.compute_grpo_outcome_advantage(rewards, mask, index)
    # group a: mean 1/3, unbiased std = sqrt(((2/3)^2 + 2*(1/3)^2) / 2) = sqrt(1/3) = 0.57735
    #   row 0: (2/3)/0.57735 = 1.1547 ; rows 2, 3: (-1/3)/0.57735 = -0.57735
    # group b: single row -> 1.0
    assert adv[0].tolist() == pytest.approx([1.1547, 1.1547], abs=1e-4)
    assert adv[1].tolist() == pytest.approx([1.0, 1.0], abs=1e-5)
    assert adv[2].tolist() == pytest.approx([-0.57735, -0.57735], abs=1e-4)
    assert adv[3].tolist() == pytest.approx([-0.57735, 0.0], abs=1e-4)
    unnormalised, _ = core_algos.compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=False)
    assert unnormalised[0, 0].item() == pytest.approx(2.0 / 3.0)


def test_rloo_subtracts_mean_of_other_samples():
    rewards = torch.tensor([[1.0], [0.0], [0.0]])
    adv, _ = core_algos.compute_rloo_outcome_advantage(rewards, torch.ones(3, 1), np.array([7, 7, 7], dtype=object))
    # 1 - mean(0, 0) = 1 ; 0 - mean(1, 0) = -0.5 (twice)
    assert adv.flatten().tolist() == pytest.approx([1.0, -0.5, -0.5])


def test_reinforce_plus_plus_returns_skip_observations():
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    mask = torch.tensor([[1, 0, 1, 1]])
    adv, ret = core_algos.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    # t3: 1 ; t2: 0.5 * 1 = 0.5 ; t1 is an observation (0) ; t0: 0.5 * 0.5 = 0.25
    assert ret.tolist()[0] == pytest.approx([0.25, 0.0, 0.5, 1.0])
    assert adv[0, 1].item() == 0.0


def test_compute_advantage_dispatches_and_names_bad_estimator():
    index = np.array(["u", "u"], dtype=object)
    rewards, mask = torch.tensor([[1.0], [0.0]]), torch.ones(2, 1)
    direct, _ = core_algos.compute_grpo_outcome_advantage(rewards, mask, index)
    via, _ = core_algos.compute_advantage("grpo", rewards, mask, index=index)
    assert torch.equal(direct, via)
    with pytest.raises(ValueError, match="algorithm.adv_estimator"):
        core_algos.compute_advantage("ppo2", rewards, mask)
    with pytest.raises(ValueError, match="values"):
        core_algos.compute_advantage("gae", rewards, mask)


def test_each_kl_estimator_by_hand():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    # diff = logp - ref = 0.5
    assert core_algos.kl_penalty(logp, ref, "kl").item() == pytest.approx(0.5)
    assert core_algos.kl_penalty(ref, logp, "abs").item() == pytest.approx(0.5)
    assert core_algos.kl_penalty(logp, ref, "mse").item() == pytest.approx(0.125)  # 0.5 * 0.25
    # k3: r = ref - logp = -0.5 ; exp(-0.5) - (-0.5) - 1 = 0.606531 + 0.5 - 1 = 0.106531
    assert core_algos.kl_penalty(logp, ref, "low_var_kl").item() == pytest.approx(math.exp(-0.5) - 0.5, abs=1e-6)
    # exp(20) would explode; k3 is clamped at 10
    assert core_algos.kl_penalty(torch.tensor([0.0]), torch.tensor([20.0]), "low_var_kl").item() == 10.0
    with pytest.raises(ValueError, match="'js'"):
        core_algos.kl_penalty(logp, ref, "js")


def test_policy_loss_clips_large_ratio_with_positive_advantage():
    old = torch.zeros(1, 3)
    # ratios 1.5 (above 1+0.2), 1.1 (inside), and a masked-out token with ratio e^5
    new = torch.log(torch.tensor([[1.5, 1.1, math.exp(5.0)]]))
    adv = torch.ones(1, 3)
    mask = torch.tensor([[1, 1, 0]])
    pg_loss, clipfrac, ppo_kl, _ = core_algos.compute_policy_loss(old, new, adv, mask, cliprange=0.2)
    # token 0: max(-1.5, -1.2) = -1.2 (clipped); token 1: -1.1 -> mean = -1.15
    assert pg_loss.item() == pytest.approx(-1.15)
    assert clipfrac.item() == pytest.approx(0.5)
    # ppo_kl = mean(-log 1.5, -log 1.1) = -(0.405465 + 0.095310)/2
    assert ppo_kl.item() == pytest.approx(-(math.log(1.5) + math.log(1.1)) / 2)


def test_policy_loss_clips_small_ratio_with_negative_advantage():
    old = torch.zeros(1, 1)
    new = torch.log(torch.tensor([[0.5]]))
    pg_loss, clipfrac, _, _ = core_algos.compute_policy_loss(old, new, -torch.ones(1, 1), torch.ones(1, 1), 0.2)
    # unclipped: -(-1)*0.5 = 0.5 ; clipped: -(-1)*0.8 = 0.8 -> max = 0.8 (pessimistic)
    assert pg_loss.item() == pytest.approx(0.8)
    assert clipfrac.item() == 1.0


def test_value_loss_clips_far_prediction():
    values = torch.tensor([[1.0, 1.0, 1.0]])
    vpreds = torch.tensor([[2.0, 1.1, 50.0]])
    returns = torch.tensor([[3.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    vf_loss, clipfrac = core_algos.compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.5)
    # token 0: clip(2.0) -> 1.5 ; (2-3)^2 = 1, (1.5-3)^2 = 2.25 -> 2.25 (clipped active)
    # token 1: 1.1 within [0.5, 1.5] ; both 1.21 -> 1.21 (not counted as clipped)
    # vf_loss = 0.5 * (2.25 + 1.21) / 2 = 0.865
    assert vf_loss.item() == pytest.approx(0.865)
    assert clipfrac.item() == pytest.approx(0.5)


def test_entropy_loss_averages_over_policy_tokens():
    logits = torch.zeros(1, 2, 4)
    logits[0, 1] = torch.tensor([100.0, 0.0, 0.0, 0.0])
    # token 0 uniform over 4 -> log 4 ; token 1 is masked out
    assert core_algos.compute_entropy_loss(logits, torch.tensor([[1, 0]])).item() == pytest.approx(math.log(4))


def test_adaptive_kl_controller_moves_toward_target():
    ctrl = core_algos.AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=100)
    ctrl.update(current_kl=0.15, n_steps=10)
    # error = clip(0.15/0.1 - 1 = 0.5, +-0.2) = 0.2 ; beta *= 1 + 0.2*10/100 = 1.02 -> 0.102
    assert ctrl.value == pytest.approx(0.102)
    ctrl.update(current_kl=0.09, n_steps=10)
    # error = 0.9 - 1 = -0.1 ; beta *= 1 - 0.1*10/100 = 0.99 -> 0.10098
    assert ctrl.value == pytest.approx(0.10098)
    fixed = core_algos.FixedKLController(0.3)
    fixed.update(current_kl=5.0, n_steps=10)
    assert fixed.value == 0.3


def test_kl_controller_built_from_trainer_config():
    cfg = OmegaConf.load(CONFIG)
    ctrl = core_algos.get_kl_controller(cfg.algorithm.kl_ctrl)
    assert isinstance(ctrl, core_algos.FixedKLController) and ctrl.value == pytest.approx(0.001)
    cfg.algorithm.kl_ctrl.type = "adaptive"
    adaptive = core_algos.get_kl_controller(cfg.algorithm.kl_ctrl)
    assert isinstance(adaptive, core_algos.AdaptiveKLController) and adaptive.horizon == 10000
    cfg.algorithm.kl_ctrl.type = "pid"
    with pytest.raises(ValueError, match="algorithm.kl_ctrl.type"):
        core_algos.get_kl_controller(cfg.algorithm.kl_ctrl)


def test_apply_kl_penalty_only_on_policy_tokens():
    scores = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    old = torch.tensor([[-1.0, -1.0, -1.0, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, -2.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    ctrl = core_algos.AdaptiveKLController(init_kl_coef=0.1, target_kl=1.0, horizon=10)
    rewards, metrics = core_algos.apply_kl_penalty(scores, old, ref, mask, ctrl, "kl")
    # kl = [0.5, 0, 1, (masked)] ; rewards = scores - 0.1*kl = [-0.05, 0, 0.9, 0]
    assert rewards.tolist()[0] == pytest.approx([-0.05, 0.0, 0.9, 0.0])
    # masked mean kl = 1.5/3 = 0.5 ; beta was 0.1 when applied
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.5)
    assert metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(0.1)
    # controller updated with kl 0.5: error clip(-0.5) = -0.2 ; beta *= 1 - 0.2*1/10 -> 0.098
    assert ctrl.value == pytest.approx(0.098)
