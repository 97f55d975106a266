"""Gradients of the policy losses (float64): autograd against central finite differences where the loss
is a plain function of the log-probs (dual-clip's branches, clip-higher's asymmetry), and against the
finite differences of an independently written objective where a stop-gradient makes the loss's own
derivative differ from its value's (GSPO's sequence ratio, CISPO's clipped weight)."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from verl.trainer.ppo.registry import get_policy_loss_fn

pytestmark = pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")
H = 1e-6


def cfg(**values: object):
    return OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": None, "clip_ratio_high": None, "clip_ratio_c": 3.0,
                             "policy_loss": {"loss_mode": "vanilla"}, **values})


def autograd(name: str, old, new, adv, mask, config, mode: str = "token-mean") -> torch.Tensor:
    new = new.clone().requires_grad_(True)
    loss, _ = get_policy_loss_fn(name)(old, new, adv, mask, mode, config)
    loss.backward()
    return new.grad


def finite_differences(f, new: torch.Tensor) -> torch.Tensor:
    grad = torch.zeros_like(new)
    for idx in range(new.numel()):
        up, down = new.clone().reshape(-1), new.clone().reshape(-1)
        up[idx] += H
        down[idx] -= H
        grad.reshape(-1)[idx] = (f(up.reshape(new.shape)) - f(down.reshape(new.shape))) / (2 * H)
    return grad


def of_loss(name: str, old, adv, mask, config, mode: str = "token-mean"):
    return lambda new: float(get_policy_loss_fn(name)(old, new, adv, mask, mode, config)[0])


# ------------------------------------------------------------------ dual-clip, clip-higher
def test_dual_clip_branches_have_the_gradients_of_their_terms():
    """One token per branch (log-ratios away from every kink): A > 0 inside the band (gradient -A r / N),
    A > 0 above 1 + eps (clipped: 0), A < 0 between 1 + eps and c (unclipped: -A r / N), A < 0 past
    c (the dual-clip bound: 0), A < 0 below 1 - eps (clipped: 0)."""
    log_ratios = torch.tensor([[0.1, 0.5, 0.6, 1.5, -0.5]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0]], dtype=torch.float64)
    old = torch.full_like(adv, -1.0)
    new, mask = old + log_ratios, torch.ones_like(adv)
    got = autograd("vanilla", old, new, adv, mask, cfg())
    fd = finite_differences(of_loss("vanilla", old, adv, mask, cfg()), new)
    torch.testing.assert_close(got, fd, atol=1e-7, rtol=1e-6)
    r = torch.exp(log_ratios)
    expected = torch.tensor([[-r[0, 0] / 5, 0.0, r[0, 2] / 5, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)
    assert math.exp(1.5) > 3.0 > math.exp(0.6) > 1.2


def test_clip_higher_keeps_the_gradient_between_the_two_upper_bounds_only():
    """r = e^0.22 = 1.246, A > 0: clipped (0) with eps 0.2, unclipped (-A r / N) with clip_ratio_high 0.28;
    the lower side (r = e^-0.3 = 0.74, A < 0) stays clipped at 1 - 0.2 either way."""
    log_ratios = torch.tensor([[0.22, -0.3, 0.05]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0, 0.5]], dtype=torch.float64)
    old = torch.full_like(adv, -2.0)
    new, mask = old + log_ratios, torch.ones_like(adv)
    for config, upper_grad in ((cfg(), 0.0), (cfg(clip_ratio_high=0.28), -math.exp(0.22) / 3)):
        got = autograd("vanilla", old, new, adv, mask, config)
        torch.testing.assert_close(got, finite_differences(of_loss("vanilla", old, adv, mask, config), new),
                                   atol=1e-7, rtol=1e-6)
        assert float(got[0, 0]) == pytest.approx(upper_grad, abs=1e-12)
        assert float(got[0, 1]) == 0.0
        assert float(got[0, 2]) == pytest.approx(-0.5 * math.exp(0.05) / 3, rel=1e-12)


# ------------------------------------------------------------------ GSPO
def gspo_sequence_objective(old, adv, mask, low, high):
    """GSPO's own objective (arXiv:2507.18071 eq. 5), written independently: per row
    s_i = exp(mean_t (log pi - log pi_old)), loss_i = max(-A_i s_i, -A_i clip(s_i, 1 - low, 1 + high)),
    averaged over rows; A_i the row's (outcome) advantage."""
    def f(new):
        total, rows = 0.0, 0
        for i in range(new.shape[0]):
            ts = [t for t in range(new.shape[1]) if mask[i, t] == 1]
            if not ts:
                continue
            s = math.exp(sum(float(new[i, t] - old[i, t]) for t in ts) / len(ts))
            a = float(adv[i, ts[0]])
            total += max(-a * s, -a * min(max(s, 1 - low), 1 + high))
            rows += 1
        return total / rows
    return f


@pytest.mark.parametrize("low,high", [(0.2, 0.2), (3e-4, 4e-4)])
def test_gspo_token_gradient_is_the_sequence_objectives_gradient(low, high):
    """With one advantage per row the GSPO-token loss's autograd gradient equals the finite-difference
    gradient of the sequence-level objective: s_i * A_i / |y_i| on each of the row's tokens, 0 where
    s_i is clipped. A plain (no stop-gradient) token ratio would give r_it, not s_i."""
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(4, 5, generator=g, dtype=torch.float64) * 2
    mask = torch.ones(4, 5, dtype=torch.float64)
    mask[1, 3:] = 0
    mask[2, 1:3] = 0                                   # an observation span
    # row 0: s inside the band; row 1: s above it, A > 0; row 2: s below it, A < 0; row 3: tiny log-ratios;
    # the 9s and 7s sit on masked positions
    shifts = torch.tensor([[0.02, -0.01, 0.015, -0.02, 0.01], [0.5, 0.4, 0.6, 9.0, 9.0],
                           [-0.5, 7.0, 7.0, -0.4, -0.6], [1e-5, -2e-5, 1e-5, 5e-6, -5e-6]], dtype=torch.float64)
    if low < 0.01:
        shifts[0] *= 1e-3                              # inside GSPO's own narrow band
        shifts[3] *= 1e-2
    new = old + shifts
    adv = torch.tensor([[1.0], [1.0], [-1.0], [-0.5]], dtype=torch.float64).expand(4, 5).clone()
    config = cfg(clip_ratio_low=low, clip_ratio_high=high)
    got = autograd("gspo", old, new, adv, mask, config)
    fd = finite_differences(gspo_sequence_objective(old, adv, mask, low, high), new)
    torch.testing.assert_close(got * mask, fd, atol=1e-6, rtol=1e-5)
    assert (got[mask == 0] == 0).all()
    s0 = math.exp(float(shifts[0].mean()))
    torch.testing.assert_close(got[0], torch.full((5,), -s0 / 5 / 4, dtype=torch.float64), atol=1e-12, rtol=1e-9)
    assert (got[1] == 0).all() and (got[2] == 0).all()  # clipped on the side that takes the gradient


# ------------------------------------------------------------------ CISPO
def test_cispo_gradient_is_the_detached_clipped_weight_times_the_advantage():
    """d/d log pi of CISPO's loss is -sg[clip(r)] A / N for every token, clipped or not: the finite
    differences of -w A log pi with the weights w held at their values; not those of the loss itself,
    whose weight moves with log pi inside the band."""
    log_ratios = torch.tensor([[0.1, 0.9, -0.9, -0.05]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, -2.0, 0.5]], dtype=torch.float64)
    old = torch.full_like(adv, -1.5)
    new, mask = old + log_ratios, torch.ones_like(adv)
    config = cfg(clip_ratio_low=0.2, clip_ratio_high=0.3)
    got = autograd("cispo", old, new, adv, mask, config)
    weights = torch.clamp(torch.exp(log_ratios), 0.8, 1.3)

    def held(new_: torch.Tensor) -> float:
        return float((-weights * adv * new_).sum() / 4)

    torch.testing.assert_close(got, finite_differences(held, new), atol=1e-7, rtol=1e-6)
    assert (got != 0).all()                            # the clipped tokens (1, 2) keep their gradient
    through_weight = finite_differences(of_loss("cispo", old, adv, mask, config), new)
    assert abs(float(through_weight[0, 0] - got[0, 0])) > 1e-3


# ------------------------------------------------------------------ the others: autograd = finite differences
@pytest.mark.parametrize("name", ["sapo", "gpg", "geo_mean", "kl_cov"])
def test_losses_without_stop_gradients_have_their_finite_difference_gradient(name):
    g = torch.Generator().manual_seed(11)
    old = -torch.rand(3, 4, generator=g, dtype=torch.float64) * 2
    new = old + 0.3 * torch.randn(3, 4, generator=g, dtype=torch.float64)
    adv = torch.tensor([[1.0], [-0.7], [0.4]], dtype=torch.float64).expand(3, 4).clone()
    mask = torch.ones(3, 4, dtype=torch.float64)
    mask[2, 2:] = 0
    config = cfg(tau_pos=1.0, tau_neg=1.05, policy_loss={"loss_mode": name, "kl_cov_ratio": 0.2, "ppo_kl_coef": 0.1})
    got = autograd(name, old, new, adv, mask, config)
    fd = finite_differences(of_loss(name, old, adv, mask, config), new)
    torch.testing.assert_close(got, fd, atol=1e-6, rtol=1e-5)
    assert (got[mask == 0] == 0).all() and (got[mask == 1] != 0).any()
