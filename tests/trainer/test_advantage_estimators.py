"""Every registered advantage estimator against an independent re-derivation from its paper's formula
(plain Python loops over each row's policy tokens), called through core_algos.compute_advantage and the
registry as the trainer calls it.

The batch has padding, observation spans in the middle of rows (retrieved passages: response_mask 0),
an empty row, an all-equal group, a group of one, and a kept_mask (rollout-correction rejection) that
drops a whole row and one token of another."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from verl.trainer.ppo import core_algos
from verl.trainer.ppo.registry import ADV_ESTIMATOR_REGISTRY, adv_estimator_names, register_adv_est

EPS_GRPO, EPS_OTB, WHITEN_EPS = 1e-6, 1e-8, 1e-8
GAMMA, LAM = 0.9, 0.8

# row: (uid, response mask, {position: reward}); 0 in the middle of a mask = an observation span
ROWS = [
    ("a", [1, 1, 0, 0, 1, 0, 0], {0: 0.5, 4: 1.0}),
    ("a", [1, 1, 1, 1, 1, 1, 1], {1: 0.25, 6: 0.0}),
    ("a", [1, 1, 1, 0, 0, 0, 0], {2: 3.0}),
    ("b", [0, 0, 0, 0, 0, 0, 0], {}),                 # an empty row: no member of group b
    ("b", [1, 0, 1, 1, 0, 0, 0], {3: 2.0}),
    ("c", [1, 1, 1, 0, 0, 0, 0], {2: 1.0}),           # group c: all scores equal
    ("c", [1, 1, 1, 1, 1, 0, 0], {4: 1.0}),
    ("d", [1, 1, 0, 1, 0, 0, 0], {3: -2.0}),          # a group of one
]
B, R = len(ROWS), len(ROWS[0][1])
INDEX = np.array([uid for uid, _, _ in ROWS], dtype=object)
MASK = torch.tensor([mask for _, mask, _ in ROWS], dtype=torch.long)
REWARDS = torch.zeros(B, R)
for _row, (_, _, _rewards) in enumerate(ROWS):
    for _t, _r in _rewards.items():
        REWARDS[_row, _t] = _r
VALUES = torch.linspace(-1.0, 1.0, B * R).reshape(B, R)
# rejection: row 2 whole, and row 1's token 1 (its reward still reaches the tokens before it)
KEPT = MASK.clone()
KEPT[2] = 0
KEPT[1, 1] = 0
BASELINES = torch.tensor([0.5, 0.5, 0.5, 1.0, 1.0, -1.0, -1.0, 3.0])
gen = torch.Generator().manual_seed(0)
OLD_LOG_PROBS = -torch.rand(B, R, generator=gen) * 3.0
OLD_LOG_PROBS[0, 0], OLD_LOG_PROBS[1, 3] = 0.0, -30.0          # pi = 1 and pi ~ 0
SUM_PI_SQUARED = torch.rand(B, R, generator=gen) * 0.9 + 0.05
IS_WEIGHTS = torch.rand(B, R, generator=gen) * 2.0
IS_WEIGHTS[1, 2], IS_WEIGHTS[0, 4] = 1e3, 1e-3                 # extreme ratios


# --------------------------------------------------------------------------- the re-derivations
def policy_positions(row: int) -> list[int]:
    return [t for t in range(R) if MASK[row, t]]


def scores() -> list[float]:
    return [float(sum(rewards.values())) for _, _, rewards in ROWS]


def groups(kept: torch.Tensor) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for row in range(B):
        if kept[row].sum() > 0:
            out.setdefault(str(INDEX[row]), []).append(row)
    return out


def on_kept(per_row: list[float], kept: torch.Tensor) -> torch.Tensor:
    return torch.tensor([[per_row[row] if kept[row, t] else 0.0 for t in range(R)] for row in range(B)])


def whiten(table: list[list[float]], kept: torch.Tensor) -> torch.Tensor:
    xs = [table[row][t] for row in range(B) for t in range(R) if kept[row, t]]
    mean = sum(xs) / len(xs)
    var = sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)
    return torch.tensor([[(table[row][t] - mean) / math.sqrt(var + WHITEN_EPS) if kept[row, t] else 0.0
                          for t in range(R)] for row in range(B)])


def sample_std(xs: list[float]) -> float:
    mean = sum(xs) / len(xs)
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))


def rewards_to_go(gamma: float) -> list[list[float]]:
    """G_t = r_t + gamma G_(next policy token), over each row's policy tokens only; 0 elsewhere."""
    table = [[0.0] * R for _ in range(B)]
    for row in range(B):
        running = 0.0
        for t in reversed(policy_positions(row)):
            running = float(REWARDS[row, t]) + gamma * running
            table[row][t] = running
    return table


def ref_gae(kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    adv = [[0.0] * R for _ in range(B)]
    for row in range(B):
        steps = policy_positions(row)      # the trajectory with its observation spans removed
        last, next_value = 0.0, 0.0
        for t in reversed(steps):
            delta = float(REWARDS[row, t]) + GAMMA * next_value - float(VALUES[row, t])
            last = delta + GAMMA * LAM * last
            adv[row][t], next_value = last, float(VALUES[row, t])
    ret = torch.tensor([[(adv[r][t] + float(VALUES[r, t])) * float(kept[r, t]) for t in range(R)] for r in range(B)])
    return whiten(adv, kept), ret


def ref_reinforce_plus_plus(kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    returns = rewards_to_go(GAMMA)
    return whiten(returns, kept), torch.tensor(returns) * kept


def ref_grpo(kept: torch.Tensor, norm: bool = True) -> torch.Tensor:
    s, out = scores(), [0.0] * B
    for rows in groups(kept).values():
        xs = [s[r] for r in rows]
        for r in rows:
            if len(rows) == 1:
                out[r] = s[r]
            else:
                centred = s[r] - sum(xs) / len(xs)
                out[r] = centred / (sample_std(xs) + EPS_GRPO) if norm else centred
    return on_kept(out, kept)


def ref_rloo(kept: torch.Tensor) -> torch.Tensor:
    s, out = scores(), [0.0] * B
    for rows in groups(kept).values():
        for r in rows:
            others = [s[o] for o in rows if o != r]
            out[r] = s[r] - sum(others) / len(others) if others else s[r]
    return on_kept(out, kept)


def ref_grpo_passk(kept: torch.Tensor, norm: bool = True) -> torch.Tensor:
    s, out = scores(), [0.0] * B
    for rows in groups(kept).values():
        if len(rows) < 2:
            continue
        ranked = sorted(rows, key=lambda r: -s[r])      # stable: the first best row wins a tie
        gap = s[ranked[0]] - s[ranked[1]]
        out[ranked[0]] = gap / (sample_std([s[r] for r in rows]) + EPS_GRPO) if norm else gap
    return on_kept(out, kept)


def ref_reinforce_plus_plus_baseline(kept: torch.Tensor) -> torch.Tensor:
    s, centred = scores(), scores()
    for rows in groups(kept).values():
        if len(rows) > 1:
            mean = sum(s[r] for r in rows) / len(rows)
            for r in rows:
                centred[r] = s[r] - mean
    return whiten([[centred[r]] * R for r in range(B)], kept)


def ref_opo(kept: torch.Tensor) -> torch.Tensor:
    s, out = scores(), scores()
    lengths = [float(kept[r].sum()) for r in range(B)]
    for rows in groups(kept).values():
        if len(rows) > 1:
            baseline = sum(lengths[r] * s[r] for r in rows) / sum(lengths[r] for r in rows)
            for r in rows:
                out[r] = s[r] - baseline
    return on_kept(out, kept)


def ref_gpg(kept: torch.Tensor) -> torch.Tensor:
    s, out = scores(), scores()
    all_groups = groups(kept).values()
    batch = sum(len(rows) for rows in all_groups)
    homogeneous = sum(len(rows) for rows in all_groups if len(rows) > 1 and len({s[r] for r in rows}) == 1)
    alpha = batch / (batch - homogeneous)
    for rows in all_groups:
        mean = sum(s[r] for r in rows) / len(rows) if len(rows) > 1 else 0.0
        for r in rows:
            out[r] = alpha * (s[r] - mean)
    return on_kept(out, kept)


def ref_remax(kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    returns = rewards_to_go(1.0)
    adv = [[(returns[r][t] - float(BASELINES[r])) * float(kept[r, t]) for t in range(R)] for r in range(B)]
    return torch.tensor(adv), torch.tensor(returns) * kept


def ref_otb(kept: torch.Tensor, is_weights: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    returns = rewards_to_go(1.0)
    # per row, per policy step k: (G_k, W_k) with W_k = sum_{j <= k} (1 - 2 pi_j + sum pi^2) rho_j^2
    steps: dict[int, list[tuple[int, float, float]]] = {}
    for row in range(B):
        cumulative, seq = 0.0, []
        for t in policy_positions(row):
            w = 1.0 - 2.0 * math.exp(float(OLD_LOG_PROBS[row, t])) + float(SUM_PI_SQUARED[row, t])
            if is_weights is not None:
                w *= float(is_weights[row, t]) ** 2
            cumulative += w
            seq.append((t, returns[row][t], cumulative))
        steps[row] = seq
    adv = [[0.0] * R for _ in range(B)]
    for rows in groups(kept).values():
        if len(rows) == 1:
            for t, g, _ in steps[rows[0]]:
                adv[rows[0]][t] = g
            continue
        longest = max(len(steps[r]) for r in rows)
        for k in range(longest):
            num = sum(steps[r][k][1] * steps[r][k][2] for r in rows if k < len(steps[r]) and kept[r, steps[r][k][0]])
            den = sum(steps[r][k][2] for r in rows if k < len(steps[r]) and kept[r, steps[r][k][0]])
            baseline = num / (den + EPS_OTB)
            for r in rows:
                if k < len(steps[r]):
                    t, g, _ = steps[r][k]
                    adv[r][t] = g - baseline
    return torch.tensor(adv) * kept, torch.tensor(returns) * kept


def reference(name: str, kept: torch.Tensor, norm: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(advantages, returns or None where returns = advantages)."""
    table = {
        "gae": lambda: ref_gae(kept),
        "reinforce_plus_plus": lambda: ref_reinforce_plus_plus(kept),
        "grpo": lambda: (ref_grpo(kept, norm), None),
        "rloo": lambda: (ref_rloo(kept), None),
        "rloo_vectorized": lambda: (ref_rloo(kept), None),
        "grpo_passk": lambda: (ref_grpo_passk(kept, norm), None),
        "reinforce_plus_plus_baseline": lambda: (ref_reinforce_plus_plus_baseline(kept), None),
        "opo": lambda: (ref_opo(kept), None),
        "gpg": lambda: (ref_gpg(kept), None),
        "remax": lambda: ref_remax(kept),
        "optimal_token_baseline": lambda: ref_otb(kept, None),
    }
    return table[name]()


BUILT_INS = ["gae", "grpo", "rloo", "reinforce_plus_plus", "grpo_passk", "rloo_vectorized",
             "reinforce_plus_plus_baseline", "opo", "gpg", "optimal_token_baseline", "remax"]


def call(name: str, kept: torch.Tensor | None, norm: bool = True, **extra: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor]:
    return core_algos.compute_advantage(
        name, REWARDS.clone(), MASK.clone(), values=VALUES, index=INDEX, gamma=GAMMA, lam=LAM,
        norm_adv_by_std_in_grpo=norm, kept_mask=kept, reward_baselines=BASELINES,
        old_log_probs=OLD_LOG_PROBS, sum_pi_squared=SUM_PI_SQUARED, **extra)


# --------------------------------------------------------------------------- tests
def test_every_built_in_is_registered() -> None:
    assert set(BUILT_INS) <= set(adv_estimator_names())


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("rejection", [False, True])
@pytest.mark.parametrize("name", BUILT_INS)
def test_estimator_equals_its_re_derivation(name: str, rejection: bool, norm: bool) -> None:
    kept = KEPT if rejection else None
    adv, ret = call(name, kept, norm)
    want_adv, want_ret = reference(name, KEPT if rejection else MASK, norm)
    torch.testing.assert_close(adv, want_adv.to(adv.dtype), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret, (want_adv if want_ret is None else want_ret).to(ret.dtype), rtol=1e-5, atol=1e-5)
    # nothing outside the kept policy tokens: padding, observation spans, the empty row, rejected tokens
    outside = (KEPT if rejection else MASK) == 0
    assert torch.all(adv[outside] == 0) and torch.all(ret[outside] == 0)


def test_the_batch_exercises_the_edges() -> None:
    # the all-equal group gets 0 from every centring estimator; the group of one keeps its score
    adv, _ = call("grpo", None)
    assert torch.all(adv[5:7] == 0)
    assert adv[7, 0].item() == pytest.approx(-2.0)
    assert torch.all(adv[3] == 0)                        # the empty row
    assert torch.all(call("grpo_passk", None)[0][7] == 0)  # a group of one has no second best


def test_dr_grpo_is_the_centred_score() -> None:
    adv, _ = call("grpo", None, norm=False)
    s = scores()
    for rows in groups(MASK).values():
        mean = sum(s[r] for r in rows) / len(rows) if len(rows) > 1 else 0.0
        for r in rows:
            assert adv[r, policy_positions(r)[0]].item() == pytest.approx(s[r] - mean, abs=1e-6)


def test_gpgs_alpha_is_the_papers_where_veRLs_nonzero_count_differs() -> None:
    """The example in docs/algorithms.md (GPG): groups [1,0,0], [0,0,0], [1,1,0]. The paper's alpha = B / (B - M) =
    9 / 6 (M: the all-equal group's 3 rows); veRL's B / (nonzero scores) would be 9 / 3."""
    scores_B = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    index = np.array(["a"] * 3 + ["b"] * 3 + ["c"] * 3, dtype=object)
    adv, _ = core_algos.compute_advantage("gpg", scores_B.unsqueeze(-1), torch.ones(9, 1), index=index)
    means = torch.tensor([1 / 3] * 3 + [0.0] * 3 + [2 / 3] * 3)
    torch.testing.assert_close(adv[:, 0], 1.5 * (scores_B - means))


def test_grpo_with_extreme_scores_stays_finite_and_exact() -> None:
    rewards = torch.tensor([[0.0, 1e4], [0.0, -1e4], [0.0, 1e4], [0.0, 1e4]])
    index = np.array(["g"] * 4, dtype=object)
    adv, _ = core_algos.compute_advantage("grpo", rewards, torch.ones(4, 2), index=index)
    std = sample_std([1e4, -1e4, 1e4, 1e4])
    torch.testing.assert_close(adv[:, 1], torch.tensor([5e3, -15e3, 5e3, 5e3]) / (std + EPS_GRPO))


@pytest.mark.parametrize("rejection", [False, True])
def test_optimal_token_baseline_with_extreme_is_weights(rejection: bool) -> None:
    kept = KEPT if rejection else None
    adv, ret = call("optimal_token_baseline", kept, rollout_is_weights=IS_WEIGHTS)
    want_adv, want_ret = ref_otb(KEPT if rejection else MASK, IS_WEIGHTS)
    torch.testing.assert_close(adv, want_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret, want_ret)
    assert torch.isfinite(adv).all()


@pytest.mark.parametrize("seed", range(5))
def test_rloo_vectorized_equals_rloo(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    rows, length = 24, 6
    rewards = torch.randn(rows, length, generator=gen)
    mask = (torch.rand(rows, length, generator=gen) > 0.3).long()
    kept = mask * (torch.rand(rows, length, generator=gen) > 0.2).long()
    kept[seed] = 0
    index = np.array([f"u{int(i)}" for i in torch.randint(0, 7, (rows,), generator=gen)], dtype=object)
    for k in (None, kept):
        loop, _ = core_algos.compute_advantage("rloo", rewards, mask, index=index, kept_mask=k)
        vectorized, _ = core_algos.compute_advantage("rloo_vectorized", rewards, mask, index=index, kept_mask=k)
        torch.testing.assert_close(vectorized, loop)


@pytest.mark.parametrize("name", ["grpo", "rloo", "rloo_vectorized", "grpo_passk", "reinforce_plus_plus_baseline",
                                  "opo", "gpg", "optimal_token_baseline"])
def test_group_estimators_without_uid_name_the_key(name: str) -> None:
    with pytest.raises(ValueError, match=f"algorithm.adv_estimator={name} needs the non-tensor key 'uid'"):
        core_algos.compute_advantage(name, REWARDS, MASK, old_log_probs=OLD_LOG_PROBS, sum_pi_squared=SUM_PI_SQUARED)


def test_remax_and_otb_name_their_missing_batch_keys() -> None:
    with pytest.raises(ValueError, match="reward_baselines"):
        core_algos.compute_advantage("remax", REWARDS, MASK)
    with pytest.raises(ValueError, match="sum_pi_squared"):
        core_algos.compute_advantage("optimal_token_baseline", REWARDS, MASK, index=INDEX)


def test_a_verl_style_custom_estimator_drops_in() -> None:
    seen: dict[str, object] = {}

    @register_adv_est("test_verl_style_mean_baseline")
    def mean_baseline(token_level_rewards, response_mask, index, config=None, **kwargs):  # noqa: ANN001, ANN003
        seen.update(kwargs, config=config, index=index, response_mask=response_mask.clone())
        scores = token_level_rewards.sum(-1)
        adv = (scores - scores.mean()).unsqueeze(-1) * response_mask
        return adv, adv

    try:
        algo = {"adv_estimator": "test_verl_style_mean_baseline", "gamma": 1.0, "lam": 1.0,
                "norm_adv_by_std_in_grpo": True}
        from omegaconf import OmegaConf

        adv, _ = core_algos.compute_advantage("test_verl_style_mean_baseline", REWARDS, MASK, index=INDEX,
                                              kept_mask=KEPT, config=OmegaConf.create(algo))
        # no kept_mask parameter: it gets the kept tokens as response_mask (veRL's rejection does the same)
        assert "kept_mask" not in seen
        assert torch.equal(seen["response_mask"], KEPT)
        assert seen["config"].adv_estimator == "test_verl_style_mean_baseline"
        assert seen["index"] is INDEX
        assert "values" not in seen and seen["gamma"] == 1.0 and seen["norm_adv_by_std_in_grpo"] is True
        s = REWARDS.sum(-1)
        torch.testing.assert_close(adv, (s - s.mean()).unsqueeze(-1) * KEPT)
    finally:
        ADV_ESTIMATOR_REGISTRY.pop("test_verl_style_mean_baseline", None)


def test_an_estimator_without_kwargs_gets_only_what_it_names() -> None:
    @register_adv_est("test_narrow_estimator")
    def narrow(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return token_level_rewards * response_mask, token_level_rewards

    try:
        adv, ret = core_algos.compute_advantage("test_narrow_estimator", REWARDS, MASK, index=INDEX, gamma=0.5)
        torch.testing.assert_close(adv, REWARDS * MASK)
    finally:
        ADV_ESTIMATOR_REGISTRY.pop("test_narrow_estimator", None)


def test_an_estimator_without_kept_mask_under_rejection_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    @register_adv_est("test_no_kept_mask_estimator")
    def no_kept(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, **kwargs: object
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return token_level_rewards * response_mask, token_level_rewards * response_mask

    try:
        with caplog.at_level("WARNING"):
            core_algos.compute_advantage("test_no_kept_mask_estimator", REWARDS, MASK, kept_mask=MASK)
        assert "takes no kept_mask" not in caplog.text        # nothing rejected: nothing to say
        with caplog.at_level("WARNING"):
            adv, _ = core_algos.compute_advantage("test_no_kept_mask_estimator", REWARDS, MASK, kept_mask=KEPT)
        assert "algorithm.adv_estimator=test_no_kept_mask_estimator takes no kept_mask" in caplog.text
        torch.testing.assert_close(adv, REWARDS * KEPT)
    finally:
        ADV_ESTIMATOR_REGISTRY.pop("test_no_kept_mask_estimator", None)
