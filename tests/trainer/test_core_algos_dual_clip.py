"""Dual-clip PPO (`actor_rollout_ref.actor.clip_ratio_c`, veRL's semantics): for a negative advantage A
a token's loss is at most -A * clip_ratio_c, so a stale or bypass-mode token with ratio >> 1 no longer
scales its gradient by the ratio. Values by hand, gradients against finite differences and against
the hand-derived d/dlogp, extreme ratios, NaN padding, and the rollout-correction weights on top."""

from __future__ import annotations

import math

import pytest
import torch

from verl.trainer.config_check import ConfigError, validate_config
from verl.trainer.main_ppo import compose_config
from verl.trainer.ppo import core_algos

EPS, C = 0.2, 3.0


def _loss(log_prob: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
          weights: torch.Tensor | None = None, mode: str = "token-mean") -> torch.Tensor:
    return core_algos.compute_policy_loss(old, log_prob, adv, mask, EPS, mode, weights, clip_ratio_c=C)[0]


def test_negative_advantage_loss_stops_at_clip_ratio_c_times_minus_a() -> None:
    # ratios 10, 1.5 and 10; advantages -1, -2, +1; a padding position whose log-probs are NaN / -inf
    old = torch.tensor([[0.0, 0.0, 0.0, float("nan")]])
    new = torch.tensor([[math.log(10.0), math.log(1.5), math.log(10.0), float("-inf")]], requires_grad=True)
    adv = torch.tensor([[-1.0, -2.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    pg_loss, clipfrac, ppo_kl, clipfrac_lower = core_algos.compute_policy_loss(old, new, adv, mask, EPS)
    # the gradient: 0 where a clip holds the loss (tokens 0 and 2) and on padding (not NaN: the NaN
    # log-ratio there is selected out before the exp, not multiplied by 0 after it); token 1: -A r / 3
    pg_loss.backward()
    torch.testing.assert_close(new.grad, torch.tensor([[0.0, 2.0 * 1.5 / 3, 0.0, 0.0]]))
    # token 0: max(-A r, -A clip(r)) = max(10, 1.2) = 10, above -A c = 3: 3 (dual-clipped)
    # token 1: max(3, 2.4) = 3, below -A c = 6: 3 (not dual-clipped)
    # token 2: A > 0: max(-10, -1.2) = -1.2 (the ordinary clip; no dual clip for A > 0)
    assert pg_loss.item() == pytest.approx((3.0 + 3.0 - 1.2) / 3)
    assert clipfrac_lower.item() == pytest.approx(1 / 3)
    assert clipfrac.item() == pytest.approx(1 / 3)                     # token 2's clipped term is active
    assert ppo_kl.item() == pytest.approx(-(math.log(10) + math.log(1.5) + math.log(10)) / 3)
    # without the bound (clip_ratio_c huge) token 0 would weigh its ratio, 10
    unbounded = core_algos.compute_policy_loss(old, new.detach(), adv, mask, EPS, clip_ratio_c=1e9)
    assert unbounded[0].item() == pytest.approx((10.0 + 3.0 - 1.2) / 3)
    assert unbounded[3].item() == 0.0


def test_extreme_ratios_give_a_finite_bounded_loss_and_no_gradient() -> None:
    # e^50 (bounded to e^20 first) with A < 0: loss -A * c exactly, gradient 0; e^-50 with A > 0:
    # bounded to e^-20, the unclipped -A r ~ -4e-9 is the larger term, and past the bound no gradient
    old = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    new = torch.tensor([[50.0, -50.0]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[-0.5, 2.0]], dtype=torch.float64)
    loss = _loss(new, old, adv, torch.ones(1, 2))
    assert loss.item() == pytest.approx((0.5 * C - 2.0 * math.exp(-20.0)) / 2, rel=1e-12)
    loss.backward()
    assert new.grad.tolist() == [[0.0, 0.0]]


def _finite_difference(log_prob: torch.Tensor, *args: torch.Tensor | None, h: float = 1e-6) -> torch.Tensor:
    grad = torch.zeros_like(log_prob)
    for i in range(log_prob.shape[1]):
        up, down = log_prob.clone(), log_prob.clone()
        up[0, i] += h
        down[0, i] -= h
        grad[0, i] = (_loss(up, *args) - _loss(down, *args)) / (2 * h)
    return grad


@pytest.mark.parametrize("with_weights", [False, True])
def test_gradient_on_both_sides_of_the_dual_clip_bound(with_weights: bool) -> None:
    # A < 0: ratios just below c (inside: loss -A r, d/dlogp = -A r) and just above (bound: 0);
    # a ratio inside the ordinary clip (-A r again) and one above 1 + eps with A > 0 (clipped: 0)
    ratios = [C * 0.99, C * 1.01, 1.05, 1.5]
    adv = torch.tensor([[-1.5, -1.5, -0.7, 2.0]], dtype=torch.float64)
    old = torch.full((1, 4), -1.0, dtype=torch.float64)
    log_prob = (old + torch.log(torch.tensor([ratios], dtype=torch.float64))).requires_grad_(True)
    mask = torch.ones(1, 4, dtype=torch.float64)
    weights = torch.tensor([[0.5, 2.0, 1.5, 3.0]], dtype=torch.float64) if with_weights else None
    loss = _loss(log_prob, old, adv, mask, weights)
    loss.backward()
    w = weights[0].tolist() if with_weights else [1.0] * 4
    # token-mean over 4 tokens; d(-A r)/dlogp = -A r; the IS weight multiplies each token's term
    by_hand = [w[0] * 1.5 * ratios[0] / 4, 0.0, w[2] * 0.7 * ratios[2] / 4, 0.0]
    torch.testing.assert_close(log_prob.grad[0], torch.tensor(by_hand, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    numeric = _finite_difference(log_prob.detach(), old, adv, mask, weights)
    torch.testing.assert_close(log_prob.grad, numeric, rtol=1e-6, atol=1e-9)
    # the loss itself, by hand: token 1 sits at -A c, token 3 at -A (1 + eps)
    per_token = [1.5 * ratios[0], 1.5 * C, 0.7 * ratios[2], -2.0 * (1 + EPS)]
    assert loss.item() == pytest.approx(sum(x * y for x, y in zip(per_token, w, strict=True)) / 4)


def test_seq_mean_modes_aggregate_the_dual_clipped_loss() -> None:
    old = torch.zeros(2, 2)
    new = torch.log(torch.tensor([[10.0, 1.0], [1.0, 1.0]]))
    adv = torch.tensor([[-1.0, -1.0], [1.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    # row 0: 3 (bounded) + 1; row 1: -1
    assert _loss(new, old, adv, mask, mode="seq-mean-token-sum").item() == pytest.approx((4.0 - 1.0) / 2)
    assert _loss(new, old, adv, mask, mode="seq-mean-token-mean").item() == pytest.approx((2.0 - 1.0) / 2)


@pytest.mark.parametrize("value", [1.0, 0.5])
def test_clip_ratio_c_at_or_below_one_is_refused_naming_the_key(value: float) -> None:
    with pytest.raises(ValueError, match=f"actor_rollout_ref.actor.clip_ratio_c must be > 1 .*got {value}"):
        core_algos.compute_policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1),
                                       EPS, clip_ratio_c=value)
    with pytest.raises(ConfigError, match=f"actor_rollout_ref.actor.clip_ratio_c={value} must be a number > 1"):
        validate_config(compose_config([f"actor_rollout_ref.actor.clip_ratio_c={value}"]))


def test_clip_ratio_c_defaults_to_three_in_the_config_and_the_function() -> None:
    cfg = compose_config([])
    validate_config(cfg)
    assert cfg.actor_rollout_ref.actor.clip_ratio_c == 3.0 == core_algos.DEFAULT_CLIP_RATIO_C
    old, new, adv = torch.zeros(1, 1), torch.tensor([[math.log(5.0)]]), -torch.ones(1, 1)
    assert core_algos.compute_policy_loss(old, new, adv, torch.ones(1, 1), EPS)[0].item() == pytest.approx(3.0)
