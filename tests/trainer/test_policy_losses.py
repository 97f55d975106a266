"""Every registered policy loss against an independent re-derivation from its paper's formula (plain
Python loops over the policy tokens, float64), on one batch with padding (NaN log-probs there), an
observation span (mask 0 mid-row, garbage there), an empty row and extreme log-ratios (+-30); that
no masked value reaches the loss or a gradient; and the default (vanilla, clip_ratio_low/high null)
being today's dual-clip loss. Gradient checks: tests/trainer/test_policy_loss_gradients.py."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
from omegaconf import OmegaConf

from verl.trainer.main_ppo import compose_config
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.registry import BUILTIN_POLICY_LOSSES, get_policy_loss_fn, policy_loss_names
from verl.utils import torch_functional as tf

pytestmark = pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")

B, R = 4, 6
N_TOKENS = 14          # policy tokens of make_batch: 6 + 4 + 4 + 0
MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def make_batch(fill: float = float("nan")) -> dict[str, torch.Tensor]:
    """Row 0: full, log-ratios +30 and -30 among ordinary ones; row 1: 2 padding positions; row 2: an
    observation span at positions 2..3; row 3: empty. Masked positions hold `fill`."""
    g = torch.Generator().manual_seed(7)
    old = -torch.rand(B, R, generator=g, dtype=torch.float64) * 3
    new = old + 0.4 * torch.randn(B, R, generator=g, dtype=torch.float64)
    new[0, 1], new[0, 4] = old[0, 1] + 30.0, old[0, 4] - 30.0
    new[1, 0] = old[1, 0] + 0.22                     # inside clip-higher's widened band, outside 1.2
    adv = torch.randn(B, R, generator=g, dtype=torch.float64)
    adv[0, 1], adv[0, 4], adv[1, 0] = -1.5, 0.8, 0.9
    adv[2] = -0.7                                     # a row of one (outcome) advantage
    mask = torch.ones(B, R, dtype=torch.float64)
    mask[1, 4:] = 0
    mask[2, 2:4] = 0
    mask[3] = 0
    weights = 0.5 + torch.rand(B, R, generator=g, dtype=torch.float64)
    for t in (old, new, adv, weights):
        t[mask == 0] = fill
    return {"old": old, "new": new, "adv": adv, "mask": mask, "w": weights}


_BASE = []


def actor_cfg(**overrides: object):
    """The real actor node of ppo_trainer.yaml (composed through Hydra once), with `overrides`."""
    if not _BASE:
        _BASE.append(compose_config([]).actor_rollout_ref.actor)
    cfg = copy.deepcopy(_BASE[0])
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, merge=False)
    return cfg


def call(name: str, b: dict, mode: str = "token-mean", cfg=None, weights: bool = False):
    new = b["new"].clone().requires_grad_(True)
    loss, metrics = get_policy_loss_fn(name)(b["old"], new, b["adv"], b["mask"], mode,
                                             cfg if cfg is not None else actor_cfg(),
                                             rollout_is_weights=b["w"] if weights else None)
    return loss, metrics, new


# ------------------------------------------------------------------ the independent re-derivations
def tokens(b: dict, row: int) -> list[int]:
    return [t for t in range(R) if b["mask"][row, t] == 1]


def v(b: dict, key: str, row: int, t: int) -> float:
    return float(b[key][row, t])


def lr(b: dict, row: int, t: int) -> float:
    return min(max(v(b, "new", row, t) - v(b, "old", row, t), -20.0), 20.0)


def aggregate(per: dict[tuple[int, int], float], b: dict, mode: str, scale: float = R) -> float:
    rows = [i for i in range(B) if tokens(b, i)]
    if mode == "token-mean":
        return sum(per.values()) / max(len(per), 1)
    sums = {i: sum(per[i, t] for t in tokens(b, i)) for i in rows}
    if mode == "seq-mean-token-sum":
        return sum(sums.values()) / len(rows)
    if mode == "seq-mean-token-sum-norm":
        return sum(s / scale for s in sums.values()) / len(rows)
    return sum(sums[i] / len(tokens(b, i)) for i in rows) / len(rows)


def per_token(b: dict, fn) -> dict[tuple[int, int], float]:
    return {(i, t): fn(i, t) for i in range(B) for t in tokens(b, i)}


def ref_vanilla(b, low, high, c, weights=False):
    def one(i, t):
        a, r = v(b, "adv", i, t), math.exp(lr(b, i, t))
        loss = max(-a * r, -a * min(max(r, 1 - low), 1 + high))
        if a < 0:
            loss = min(loss, -a * c)
        return loss * (v(b, "w", i, t) if weights else 1.0)
    return per_token(b, one)


def ref_gspo(b, low, high):
    per = {}
    for i in range(B):
        ts = tokens(b, i)
        if not ts:
            continue
        s = math.exp(min(sum(v(b, "new", i, t) - v(b, "old", i, t) for t in ts) / len(ts), 10.0))
        for t in ts:
            a = v(b, "adv", i, t)
            per[i, t] = max(-a * s, -a * min(max(s, 1 - low), 1 + high))
    return per


def ref_sapo(b, tau_pos, tau_neg):
    def one(i, t):
        a, r = v(b, "adv", i, t), math.exp(lr(b, i, t))
        tau = tau_pos if a > 0 else tau_neg
        return -a * 4.0 / tau / (1.0 + math.exp(-tau * (r - 1.0)))
    return per_token(b, one)


def ref_cispo(b, low, high):
    return per_token(b, lambda i, t: -min(max(math.exp(lr(b, i, t)), 1 - low), 1 + high)
                     * v(b, "adv", i, t) * v(b, "new", i, t))


def covariances(b) -> dict[tuple[int, int], float]:
    keys = [(i, t) for i in range(B) for t in tokens(b, i)]
    mean_a = sum(v(b, "adv", *k) for k in keys) / len(keys)
    mean_lp = sum(v(b, "new", *k) for k in keys) / len(keys)
    return {k: (v(b, "adv", *k) - mean_a) * (v(b, "new", *k) - mean_lp) for k in keys}


def ref_kl_cov(b, share, coef):
    cov = covariances(b)
    k = max(1, int(len(cov) * share))
    top = sorted(cov, key=cov.get, reverse=True)[:k]
    return {key: -v(b, "adv", *key) * math.exp(lr(b, *key)) + (coef * abs(lr(b, *key)) if key in top else 0.0)
            for key in cov}


def ref_clip_cov_terms(b, low, high, lb, ub) -> tuple[dict, list]:
    """(the clipped PPO term of every token, the tokens Clip-Cov may drop)."""
    cov, terms, candidates = covariances(b), {}, []
    for key in cov:
        a, r = v(b, "adv", *key), math.exp(lr(b, *key))
        unclipped, clipped = -a * r, -a * min(max(r, 1 - low), 1 + high)
        terms[key] = max(unclipped, clipped)
        if not clipped > unclipped and lb < cov[key] < ub:
            candidates.append(key)
    return terms, candidates


def ref_geo_mean(b, low, high, weights=False):
    rows = []
    for i in range(B):
        ts = tokens(b, i)
        if not ts:
            continue
        logs = []
        for t in ts:
            x, a = lr(b, i, t), v(b, "adv", i, t)
            bounded = min(max(x, -low), high)
            logs.append(min(x, bounded) if a > 0 else max(x, bounded) if a < 0 else 0.0)
        mean_adv = sum(v(b, "adv", i, t) for t in ts) / len(ts)
        row = -mean_adv * math.exp(sum(logs) / len(ts))
        if weights:     # the row's geometric-mean weight
            row *= math.exp(sum(math.log(v(b, "w", i, t)) for t in ts) / len(ts))
        rows.append(row)
    return sum(rows) / len(rows)


# ------------------------------------------------------------------ values
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("low,high", [(None, None), (0.2, 0.28), (0.1, 0.3)])
def test_vanilla_is_dual_clip_ppo_with_clip_higher(mode, low, high):
    b = make_batch()
    cfg = actor_cfg(clip_ratio_low=low, clip_ratio_high=high, loss_agg_mode=mode)
    loss, metrics, _ = call("vanilla", b, mode, cfg)
    expected = aggregate(ref_vanilla(b, low or 0.2, high or 0.2, 3.0), b, mode)
    assert float(loss) == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert set(metrics) == {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}
    # the +30 token with A = -1.5 sits at the dual-clip bound, the one token of 14 counted there
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(1 / N_TOKENS)


def test_clip_higher_widens_the_upper_side_only():
    b = make_batch()
    sym = ref_vanilla(b, 0.2, 0.2, 3.0)
    asym = ref_vanilla(b, 0.2, 0.28, 3.0)
    a, r = float(b["adv"][1, 0]), math.exp(0.22)
    assert a > 0 and sym[1, 0] == pytest.approx(-a * 1.2) and asym[1, 0] == pytest.approx(-a * r)
    loss_sym, _, _ = call("vanilla", b, cfg=actor_cfg())
    loss_asym, _, _ = call("vanilla", b, cfg=actor_cfg(clip_ratio_high=0.28))
    assert float(loss_asym) < float(loss_sym)


def test_the_default_is_todays_loss_exactly():
    """ppo_trainer.yaml's defaults (vanilla, clip_ratio 0.2, low/high null, clip_ratio_c 3) give
    core_algos.compute_policy_loss's loss and metrics, bit for bit."""
    b = make_batch()
    cfg = actor_cfg()
    assert cfg.policy_loss.loss_mode == "vanilla" and cfg.clip_ratio_low is None and cfg.clip_ratio_high is None
    for mode, weights in itertools.product(MODES, (False, True)):
        loss, metrics, _ = call("vanilla", b, mode, cfg, weights)
        old = core_algos.compute_policy_loss(b["old"], b["new"], b["adv"], b["mask"], 0.2, mode,
                                             b["w"] if weights else None, clip_ratio_c=3.0)
        assert torch.equal(loss.detach(), old[0])
        assert [metrics[k] for k in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")] == \
            [float(x) for x in old[1:]]


@pytest.mark.parametrize("low,high", [(0.2, 0.2), (3e-4, 4e-4)])
def test_gspo_is_the_sequence_ratio_clipped_and_averaged_per_sequence(low, high):
    b = make_batch()
    for mode in MODES:   # GSPO aggregates seq-mean-token-mean whatever loss_agg_mode says (veRL)
        loss, metrics, _ = call("gspo", b, mode, actor_cfg(clip_ratio_low=low, clip_ratio_high=high))
        assert float(loss) == pytest.approx(aggregate(ref_gspo(b, low, high), b, "seq-mean-token-mean"), rel=1e-12)
    assert metrics["actor/pg_clipfrac_lower"] == 0.0


def test_gspo_bounds_the_sequence_log_ratio_at_10():
    b = make_batch()
    b["new"][0, :] = b["old"][0, :] + 12.0           # mean log-ratio 12 > 10
    b["adv"][0, :] = -1.0
    loss, _, _ = call("gspo", b)
    assert float(loss) == pytest.approx(aggregate(ref_gspo(b, 0.2, 0.2), b, "seq-mean-token-mean"), rel=1e-12)
    assert math.isfinite(float(loss))


@pytest.mark.parametrize("tau_pos,tau_neg", [(1.0, 1.05), (2.0, 4.0)])
def test_sapo_is_the_soft_gate(tau_pos, tau_neg):
    b = make_batch()
    loss, metrics, _ = call("sapo", b, "token-mean", actor_cfg(tau_pos=tau_pos, tau_neg=tau_neg))
    assert float(loss) == pytest.approx(aggregate(ref_sapo(b, tau_pos, tau_neg), b, "seq-mean-token-mean"),
                                        rel=1e-12)
    assert metrics["actor/pg_clipfrac"] == 0.0


@pytest.mark.parametrize("mode", MODES)
def test_gpg_is_advantage_times_log_prob(mode):
    b = make_batch()
    loss, metrics, _ = call("gpg", b, mode)
    expected = aggregate(per_token(b, lambda i, t: -v(b, "adv", i, t) * v(b, "new", i, t)), b, mode)
    assert float(loss) == pytest.approx(expected, rel=1e-12)
    assert set(metrics) == {"actor/ppo_kl"}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("low,high", [(0.2, 0.2), (1.0, 4.0)])
def test_cispo_is_the_clipped_weight_times_advantage_times_log_prob(mode, low, high):
    b = make_batch()
    loss, metrics, _ = call("cispo", b, mode, actor_cfg(clip_ratio_low=low, clip_ratio_high=high))
    assert float(loss) == pytest.approx(aggregate(ref_cispo(b, low, high), b, mode), rel=1e-12)
    clipped = sum(1 for i in range(B) for t in tokens(b, i)
                  if not 1 - low <= math.exp(lr(b, i, t)) <= 1 + high)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(clipped / N_TOKENS)


@pytest.mark.parametrize("share,coef", [(0.0002, 0.1), (0.25, 0.5), (1.0, 1.0)])
def test_kl_cov_penalises_the_largest_covariance_tokens(share, coef):
    b = make_batch()
    cfg = actor_cfg(**{"policy_loss.kl_cov_ratio": share, "policy_loss.ppo_kl_coef": coef})
    for mode in MODES:
        loss, _, _ = call("kl_cov", b, mode, cfg)
        assert float(loss) == pytest.approx(aggregate(ref_kl_cov(b, share, coef), b, mode), rel=1e-12)


def test_clip_cov_drops_every_candidate_when_the_share_covers_them():
    b = make_batch()
    lb, ub = -1.0, 5.0
    cfg = actor_cfg(**{"policy_loss.clip_cov_ratio": 1.0, "policy_loss.clip_cov_lb": lb,
                       "policy_loss.clip_cov_ub": ub})
    terms, candidates = ref_clip_cov_terms(b, 0.2, 0.2, lb, ub)
    assert 0 < len(candidates) < len(terms)
    for mode in MODES:
        loss, metrics, _ = call("clip_cov", b, mode, cfg)
        kept = {k: (0.0 if k in candidates else x) for k, x in terms.items()}
        assert float(loss) == pytest.approx(aggregate(kept, b, mode), rel=1e-12)
        assert metrics["actor/pg_clipfrac"] == pytest.approx(len(candidates) / N_TOKENS)


def test_clip_cov_drops_a_random_subset_of_the_candidates_of_the_configured_size():
    """0.2 * 14 tokens -> 2 dropped: which two is random (torch's generator); they are candidates,
    their gradient is 0, and the loss is the reference's with exactly those two removed."""
    b = make_batch()
    lb, ub = -1.0, 5.0
    cfg = actor_cfg(**{"policy_loss.clip_cov_ratio": 0.2, "policy_loss.clip_cov_lb": lb,
                       "policy_loss.clip_cov_ub": ub})
    terms, candidates = ref_clip_cov_terms(b, 0.2, 0.2, lb, ub)
    assert len(candidates) > 2
    seen = set()
    for seed in range(6):
        torch.manual_seed(seed)
        loss, metrics, new = call("clip_cov", b, "token-mean", cfg)
        loss.backward()
        dropped = {(i, t) for (i, t) in terms if new.grad[i, t] == 0 and (i, t) in candidates}
        assert len(dropped) == 2 and metrics["actor/pg_clipfrac"] == pytest.approx(2 / N_TOKENS)
        kept = {k: (0.0 if k in dropped else x) for k, x in terms.items()}
        assert float(loss) == pytest.approx(aggregate(kept, b, "token-mean"), rel=1e-12)
        seen.add(frozenset(dropped))
    assert len(seen) > 1


@pytest.mark.parametrize("low,high", [(0.2, 0.2), (0.4, 0.4), (0.1, 0.3)])
def test_geo_mean_is_gmpo(low, high):
    b = make_batch()
    for mode in MODES:   # loss_agg_mode is not used (veRL)
        loss, metrics, _ = call("geo_mean", b, mode, actor_cfg(clip_ratio_low=low, clip_ratio_high=high))
        assert float(loss) == pytest.approx(ref_geo_mean(b, low, high), rel=1e-12)
    assert set(metrics) == {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}


@pytest.mark.parametrize("name", BUILTIN_POLICY_LOSSES)
def test_rollout_is_weights_scale_the_loss_and_weights_of_one_change_nothing(name):
    b = make_batch()
    torch.manual_seed(0)
    weighted, _, _ = call(name, b, weights=True)
    b["w"] = torch.where(b["mask"].bool(), torch.ones_like(b["w"]), b["w"])
    torch.manual_seed(0)
    ones, _, _ = call(name, b, weights=True)
    torch.manual_seed(0)
    none, _, _ = call(name, b)
    assert float(ones) == pytest.approx(float(none), rel=1e-12)
    assert float(weighted) != pytest.approx(float(none))


def test_geo_mean_scales_each_row_by_its_geometric_mean_weight():
    b = make_batch()
    loss, _, _ = call("geo_mean", b, weights=True)
    assert float(loss) == pytest.approx(ref_geo_mean(b, 0.2, 0.2, weights=True), rel=1e-12)


def test_vanilla_rollout_is_weights_match_the_reference():
    b = make_batch()
    loss, _, _ = call("vanilla", b, weights=True)
    assert float(loss) == pytest.approx(aggregate(ref_vanilla(b, 0.2, 0.2, 3.0, weights=True), b, "token-mean"),
                                        rel=1e-12)


# ------------------------------------------------------------------ masked positions
@pytest.mark.parametrize("name", BUILTIN_POLICY_LOSSES)
@pytest.mark.parametrize("mode", MODES)
def test_masked_positions_reach_neither_the_loss_nor_the_gradient(name, mode):
    """Padding, the observation span and the empty row hold NaN in one batch and +-1e6 in another:
    the loss, the metrics and the policy tokens' gradient are the same, finite, and the masked
    positions' gradient is 0."""
    results = []
    for fill in (float("nan"), 1e6, -1e6):
        torch.manual_seed(0)                                  # clip_cov's draw
        loss, metrics, new = call(name, make_batch(fill), mode, weights=True)
        loss.backward()
        results.append((float(loss), metrics, new.grad.clone()))
    mask = make_batch()["mask"].bool()
    for loss, metrics, grad in results:
        assert math.isfinite(loss) and all(math.isfinite(x) for x in metrics.values())
        assert torch.isfinite(grad).all() and (grad[~mask] == 0).all()
        assert loss == results[0][0] and metrics == results[0][1]
        assert torch.equal(grad, results[0][2])


@pytest.mark.parametrize("name", BUILTIN_POLICY_LOSSES)
def test_an_all_empty_batch_gives_zero_loss_and_no_nan(name):
    b = make_batch()
    b["mask"] = torch.zeros_like(b["mask"])
    loss, metrics, new = call(name, b)
    loss.backward()
    assert float(loss) == 0.0 and all(x == 0.0 for x in metrics.values())
    assert (new.grad == 0).all()


def test_all_equal_groups_give_zero_advantage_and_zero_loss_gradient():
    """A group whose rewards are all equal has advantage 0 on every token: every loss is 0 and moves
    nothing, whatever the ratios."""
    b = make_batch()
    b["adv"] = torch.where(b["mask"].bool(), torch.zeros_like(b["adv"]), b["adv"])
    for name in BUILTIN_POLICY_LOSSES:
        torch.manual_seed(0)
        loss, _, new = call(name, b)
        loss.backward()
        if name == "kl_cov":
            # its |log r| penalty does not depend on A: one token (all covariances tie at 0) keeps it
            penalised = [(i, t) for i in range(B) for t in tokens(b, i) if new.grad[i, t] != 0]
            assert len(penalised) == 1
            assert float(loss) == pytest.approx(0.1 * abs(lr(b, *penalised[0])) / N_TOKENS, rel=1e-12)
            continue
        assert float(loss) == 0.0, name
        assert (new.grad == 0).all(), name


# ------------------------------------------------------------------ registry, aggregation, critic
def test_every_builtin_is_registered_under_its_documented_name():
    assert set(BUILTIN_POLICY_LOSSES) <= set(policy_loss_names())
    with pytest.raises(ValueError, match=r"actor_rollout_ref.actor.policy_loss.loss_mode 'nope'.*'gspo'"):
        get_policy_loss_fn("nope")


def test_seq_mean_token_sum_norm_divides_row_sums_by_the_constant():
    loss = torch.tensor([[1.0, 2.0, float("nan")], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.float32)
    assert float(tf.agg_loss(loss, mask, "seq-mean-token-sum-norm")) == pytest.approx((3 / 3 + 4 / 3) / 2)
    assert float(tf.agg_loss(loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=10)) == \
        pytest.approx((0.3 + 0.4) / 2)
    with pytest.raises(ValueError, match="loss_scale_factor"):
        tf.agg_loss(loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=0)


def test_loss_scale_factor_reaches_the_policy_loss_from_the_config():
    b = make_batch()
    mode = "seq-mean-token-sum-norm"
    loss, _, _ = call("gpg", b, mode, actor_cfg(loss_scale_factor=100))
    expected = aggregate(per_token(b, lambda i, t: -v(b, "adv", i, t) * v(b, "new", i, t)), b, mode, scale=100)
    assert float(loss) == pytest.approx(expected, rel=1e-12)


def test_micro_batch_shares_of_seq_mean_token_sum_norm_add_up_to_the_unsplit_loss():
    b = make_batch()
    per = torch.where(b["mask"].bool(), b["new"], torch.zeros_like(b["new"]))
    whole = tf.agg_loss(per, b["mask"], "seq-mean-token-sum-norm")
    rows = tf.rows_with_tokens(b["mask"])
    parts = sum(tf.agg_loss(per[s], b["mask"][s], "seq-mean-token-sum-norm")
                * tf.micro_batch_share(b["mask"][s], float(b["mask"].sum()), tf.rows_with_tokens(b["mask"][s]),
                                       rows, "seq-mean-token-sum-norm")
                for s in (slice(0, 1), slice(1, 3), slice(3, 4)))
    assert float(parts) == pytest.approx(float(whole), rel=1e-12)


def test_value_loss_takes_seq_mean_token_sum_norm():
    vpreds = torch.tensor([[1.0, 2.0, 0.0], [0.5, 0.0, 0.0]])
    returns = torch.tensor([[0.0, 0.0, 0.0], [1.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.float32)
    vf_loss, _ = core_algos.compute_value_loss(vpreds, returns, vpreds, mask, 0.5, "seq-mean-token-sum-norm")
    assert float(vf_loss) == pytest.approx(0.5 * ((1 + 4) / 3 + 1 / 3) / 2)


def test_the_losses_read_a_plain_dict_config_too():
    """veRL passes its actor dataclass; a dict with the keys works as the OmegaConf node does."""
    b = make_batch()
    as_dict = OmegaConf.to_container(actor_cfg(), resolve=True)
    for name in BUILTIN_POLICY_LOSSES:
        torch.manual_seed(0)
        a, _, _ = call(name, b, cfg=as_dict)
        torch.manual_seed(0)
        c, _, _ = call(name, b, cfg=actor_cfg())
        assert float(a) == float(c)
