"""algorithm.rollout_correction (veRL's decoupled mode): IS weights pi_old / pi_rollout and rejection
masks against hand-computed values, the policy loss they change, the config check, and one GRPO step
through run_ppo with the correction on."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from verl.trainer.config_check import ConfigError, validate_config
from verl.trainer.main_ppo import compose_config
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.rollout_correction import RolloutCorrectionConfig, compute_rollout_correction

# Two rows of three policy tokens (the second row's last position is padding).
# log(pi_old) - log(pi_rollout): row 0: ln 3, ln 0.5, 0; row 1: ln 1.5, ln 1.2, (pad)
OLD = torch.tensor([[math.log(0.6), math.log(0.2), math.log(0.5)], [math.log(0.3), math.log(0.6), -1.0]])
ROLLOUT = torch.tensor([[math.log(0.2), math.log(0.4), math.log(0.5)], [math.log(0.2), math.log(0.5), -7.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def _run(**keys) -> object:
    return compute_rollout_correction(OLD, ROLLOUT, MASK, RolloutCorrectionConfig(**keys))


def test_token_is_weights_are_the_per_token_ratios_truncated_above() -> None:
    out = _run(rollout_is="token", rollout_is_threshold=2.0)
    expected = torch.tensor([[2.0, 0.5, 1.0], [1.5, 1.2, 0.0]])        # 3 -> 2 (truncated), pad -> 0
    torch.testing.assert_close(out.weights, expected)
    assert torch.equal(out.response_mask, MASK)                          # no rejection asked
    m = out.metrics
    assert m["rollout_corr/is_truncated_frac"] == pytest.approx(1 / 5)
    assert m["rollout_corr/is_weight_mean"] == pytest.approx((2 + 0.5 + 1 + 1.5 + 1.2) / 5)
    assert m["rollout_corr/is_weight_max"] == pytest.approx(2.0)
    w = [2.0, 0.5, 1.0, 1.5, 1.2]
    assert m["rollout_corr/is_ess"] == pytest.approx(sum(w) ** 2 / (5 * sum(x * x for x in w)))


def test_sequence_is_weights_are_each_rows_product_broadcast_to_its_tokens() -> None:
    out = _run(rollout_is="sequence", rollout_is_threshold=2.0)
    # row 0: 3 x 0.5 x 1 = 1.5; row 1: 1.5 x 1.2 = 1.8
    torch.testing.assert_close(out.weights, torch.tensor([[1.5, 1.5, 1.5], [1.8, 1.8, 0.0]]))
    out = _run(rollout_is="sequence", rollout_is_threshold=1.6)
    torch.testing.assert_close(out.weights, torch.tensor([[1.5, 1.5, 1.5], [1.6, 1.6, 0.0]]))
    assert out.metrics["rollout_corr/is_truncated_frac"] == pytest.approx(2 / 5)


def test_batch_normalized_weights_have_mean_one() -> None:
    token = _run(rollout_is="token", rollout_is_threshold=2.0, rollout_is_batch_normalize=True)
    torch.testing.assert_close(token.weights, torch.tensor([[2.0, 0.5, 1.0], [1.5, 1.2, 0.0]]) / (6.2 / 5))
    seq = _run(rollout_is="sequence", rollout_is_threshold=2.0, rollout_is_batch_normalize=True)
    torch.testing.assert_close(seq.weights, torch.tensor([[1.5, 1.5, 1.5], [1.8, 1.8, 0.0]]) / 1.65)


def test_token_rejection_masks_tokens_outside_the_bounds() -> None:
    out = _run(rollout_rs="token", rollout_rs_threshold=2.0)            # lower bound 1/2
    assert out.weights is None
    assert out.response_mask.tolist() == [[0, 1, 1], [1, 1, 0]]          # ratio 3 out; 0.5 is on the bound
    out = _run(rollout_rs="token", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=0.6)
    assert out.response_mask.tolist() == [[0, 0, 1], [1, 1, 0]]
    assert out.metrics["rollout_corr/rejected_token_frac"] == pytest.approx(2 / 5)
    assert out.metrics["rollout_corr/rejected_seq_frac"] == 0.0           # no row lost all its tokens


def test_sequence_and_geometric_rejection_drop_whole_rows() -> None:
    # sequence ratios 1.5 and 1.8; upper bound 1.6 (rollout_is_threshold when rs has none)
    out = _run(rollout_rs="sequence", rollout_is_threshold=1.6)
    assert out.response_mask.tolist() == [[1, 1, 1], [0, 0, 0]]
    assert out.metrics["rollout_corr/rejected_seq_frac"] == pytest.approx(0.5)
    # geometric means: 1.5 ** (1/3) = 1.145, 1.8 ** (1/2) = 1.342
    out = _run(rollout_rs="geometric", rollout_rs_threshold=1.2)
    assert out.response_mask.tolist() == [[1, 1, 1], [0, 0, 0]]
    out = _run(rollout_rs="geometric", rollout_rs_threshold=1.4, rollout_rs_threshold_lower=1.2)
    assert out.response_mask.tolist() == [[0, 0, 0], [1, 1, 0]]


def test_veto_rejects_a_row_with_one_very_unlikely_token() -> None:
    old = OLD.clone()
    old[1, 0] = ROLLOUT[1, 0] - 12.0                                     # ratio e^-12 in row 1
    out = compute_rollout_correction(old, ROLLOUT, MASK, RolloutCorrectionConfig(rollout_token_veto_threshold=1e-4))
    assert out.response_mask.tolist() == [[1, 1, 1], [0, 0, 0]]
    assert out.metrics["rollout_corr/veto_seq_frac"] == pytest.approx(0.5)
    # padding is never vetoed: a huge gap on the pad position of row 1 changes nothing
    old = OLD.clone()
    old[1, 2] = -40.0
    out = compute_rollout_correction(old, ROLLOUT, MASK, RolloutCorrectionConfig(rollout_token_veto_threshold=1e-4))
    assert torch.equal(out.response_mask, MASK)


def test_the_veto_reads_the_unbounded_ratio_below_exp_minus_20() -> None:
    # issue 32 item 13: ratios elsewhere are bounded to [e^-20, e^20]; a veto threshold below e^-20
    # (1e-12 ~ e^-27.6) must still reject a row whose token ratio is e^-30, and only such a row
    old = OLD.clone()
    old[1, 1] = ROLLOUT[1, 1] - 30.0                                     # ratio e^-30 = 9.4e-14 in row 1
    old[0, 2] = ROLLOUT[0, 2] - 25.0                                     # ratio e^-25 = 1.4e-11 in row 0
    out = compute_rollout_correction(old, ROLLOUT, MASK, RolloutCorrectionConfig(rollout_token_veto_threshold=1e-12))
    assert out.response_mask.tolist() == [[1, 1, 1], [0, 0, 0]]
    assert out.metrics["rollout_corr/veto_seq_frac"] == pytest.approx(0.5)


def test_minus_inf_and_nan_log_probs_outside_the_policy_tokens_change_nothing() -> None:
    # -inf (an engine's log-prob of padding) or NaN at masked positions: (x * 0) would be NaN and the
    # row's sum with it; selected out, the weights, masks and metrics equal the clean batch's
    response_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    policy = torch.tensor([[1, 0, 1, 0], [1, 1, 0, 0]])                 # row 0, column 1: an observation
    old = torch.tensor([[math.log(0.6), -2.0, math.log(0.5), -1.0], [math.log(0.3), math.log(0.6), -1.0, -1.0]])
    rollout = torch.tensor([[math.log(0.4), -2.0, math.log(0.5), -1.0], [math.log(0.2), math.log(0.5), -1.0, -1.0]])
    dirty_old, dirty_rollout = old.clone(), rollout.clone()
    dirty_rollout[0, 1], dirty_old[0, 3], dirty_rollout[0, 3] = float("-inf"), float("nan"), float("-inf")
    dirty_old[1, 2], dirty_rollout[1, 3] = float("-inf"), float("nan")
    for cfg in (RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=5.0),
                RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=5.0, rollout_is_batch_normalize=True),
                RolloutCorrectionConfig(rollout_rs="geometric", rollout_rs_threshold=1.3),
                RolloutCorrectionConfig(rollout_rs="sequence", rollout_rs_threshold=1.6,
                                        rollout_token_veto_threshold=1e-3)):
        clean = compute_rollout_correction(old, rollout, response_mask, cfg, policy_mask=policy)
        dirty = compute_rollout_correction(dirty_old, dirty_rollout, response_mask, cfg, policy_mask=policy)
        assert torch.equal(dirty.response_mask, clean.response_mask), cfg
        if clean.weights is not None:
            assert torch.isfinite(dirty.weights).all(), cfg
            torch.testing.assert_close(dirty.weights, clean.weights)
        assert dirty.metrics == pytest.approx(clean.metrics), cfg
    # by hand: sequence weights 1.5 and 1.8 on every token in the loss (the observation included)
    seq = compute_rollout_correction(dirty_old, dirty_rollout, response_mask,
                                     RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=5.0),
                                     policy_mask=policy)
    torch.testing.assert_close(seq.weights, torch.tensor([[1.5, 1.5, 1.5, 0.0], [1.8, 1.8, 0.0, 0.0]]))
    # geometric means 1.5 ** (1/2) = 1.22 and 1.8 ** (1/2) = 1.34: bound 1.3 rejects row 1
    geo = compute_rollout_correction(dirty_old, dirty_rollout, response_mask,
                                     RolloutCorrectionConfig(rollout_rs="geometric", rollout_rs_threshold=1.3),
                                     policy_mask=policy)
    assert geo.response_mask.tolist() == [[1, 1, 1, 0], [0, 0, 0, 0]]


def test_ratios_are_bounded_to_exp_20() -> None:
    old = OLD.clone()
    old[0, 0] = ROLLOUT[0, 0] + 50.0
    out = compute_rollout_correction(old, ROLLOUT, MASK, RolloutCorrectionConfig(
        rollout_is="sequence", rollout_is_threshold=1e12))
    assert float(out.weights[0, 0]) == pytest.approx(math.exp(20.0), rel=1e-5)      # 50 - 0.69, bounded
    token = compute_rollout_correction(old, ROLLOUT, MASK, RolloutCorrectionConfig(
        rollout_is="token", rollout_is_threshold=1e12))
    assert float(token.weights[0, 0]) == pytest.approx(math.exp(20.0), rel=1e-5)


def test_the_policy_loss_is_weighted_token_by_token() -> None:
    old, new = torch.zeros(2, 3), torch.full((2, 3), 0.1)
    adv, mask = torch.tensor([[1.0, -1.0, 2.0], [0.5, 1.0, 0.0]]), MASK.float()
    plain, _, _, _ = core_algos.compute_policy_loss(old, new, adv, mask, 0.2)
    ones, _, _, _ = core_algos.compute_policy_loss(old, new, adv, mask, 0.2, is_weights=torch.ones(2, 3))
    assert float(ones) == pytest.approx(float(plain))
    weights = torch.tensor([[2.0, 0.5, 1.0], [1.5, 1.2, 0.0]])
    weighted, _, _, _ = core_algos.compute_policy_loss(old, new, adv, mask, 0.2, is_weights=weights)
    ratio = math.exp(0.1)
    per_token = [[-1 * min(ratio, 1.2), 1 * ratio, -2 * min(ratio, 1.2)], [-0.5 * min(ratio, 1.2), -1 * min(ratio, 1.2)]]
    w = [[2.0, 0.5, 1.0], [1.5, 1.2]]
    expected = sum(p * x for row_p, row_w in zip(per_token, w, strict=True) for p, x in zip(row_p, row_w, strict=True)) / 5
    assert float(weighted) == pytest.approx(expected)
    assert float(weighted) != pytest.approx(float(plain))


@pytest.mark.parametrize(("override", "message"), [
    ("algorithm.rollout_correction.rollout_is=seq", "algorithm.rollout_correction.rollout_is='seq' is unknown"),
    ("algorithm.rollout_correction.rollout_rs=tokens", "algorithm.rollout_correction.rollout_rs='tokens' is unknown"),
    ("algorithm.rollout_correction.rollout_is_threshold=0", "rollout_is_threshold=0 must be a number > 0"),
    ("algorithm.rollout_correction.use_pure_rollout_correction=true", "use_pure_rollout_correction=true"),
])
def test_bad_settings_name_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        validate_config(compose_config([override]))


BYPASS = "algorithm.rollout_correction.bypass_old_logprob_for_rollout=true"


def test_bypass_mode_is_accepted_and_read() -> None:
    cfg = compose_config([BYPASS, "actor_rollout_ref.actor.state_masking=true"])
    validate_config(cfg)
    # vLLM's nucleus sampling at temperature 1: its raw log-probs are the actor's quantity
    validate_config(compose_config([BYPASS, "actor_rollout_ref.actor.state_masking=true",
                                    "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.top_p=0.9"]))
    assert RolloutCorrectionConfig.from_config(cfg.algorithm.rollout_correction).bypass_old_logprob_for_rollout
    assert not RolloutCorrectionConfig.from_config(compose_config([]).algorithm.rollout_correction) \
        .bypass_old_logprob_for_rollout


@pytest.mark.parametrize(("override", "message"), [
    ("algorithm.rollout_correction.rollout_is=token", "rollout_is='token' with bypass_old_logprob_for_rollout=true"),
    ("algorithm.rollout_correction.rollout_is=sequence", "rollout_is='sequence' with bypass_old_logprob_for_rollout"),
    ("algorithm.rollout_correction.rollout_rs=geometric", "rollout_rs='geometric' with bypass_old_logprob_for_rollout"),
    ("algorithm.rollout_correction.rollout_token_veto_threshold=1e-4", "rollout_token_veto_threshold=0.0001 with"),
    ("actor_rollout_ref.actor.state_masking=false", "state_masking=false: the observations are then in the loss"),
    ("actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.top_p=0.9 actor_rollout_ref.rollout.temperature=0.7",
     "with vLLM sampling top_p=0.9 / top_k=-1 at temperature 0.7: vLLM's log-probs are then renormalised"),
])
def test_bypass_mode_refuses_what_it_cannot_anchor(override: str, message: str) -> None:
    # bypass: pi_old = pi_rollout, so decoupled ratios are all 1; observations have no engine log-prob
    with pytest.raises(ConfigError, match=message):
        validate_config(compose_config([BYPASS, "actor_rollout_ref.actor.state_masking=true", *override.split()]))


def test_a_lower_rejection_bound_above_the_upper_is_refused() -> None:
    cfg = compose_config(["algorithm.rollout_correction.rollout_rs=token",
                          "algorithm.rollout_correction.rollout_rs_threshold=2.0",
                          "algorithm.rollout_correction.rollout_rs_threshold_lower=3.0"])
    with pytest.raises(ConfigError, match="rollout_rs_threshold_lower=3 must be below the upper bound 2"):
        validate_config(cfg)


def test_off_by_default() -> None:
    cfg = compose_config([])
    assert not RolloutCorrectionConfig.from_config(cfg.algorithm.rollout_correction).enabled
    # auto: token IS in a pipelined run only (tests/trainer/test_rollout_correction_config.py)
    assert OmegaConf.to_container(cfg.algorithm.rollout_correction)["rollout_is"] == "auto"


def test_observation_tokens_in_the_loss_take_no_part_in_the_ratios() -> None:
    # actor.state_masking=false: response_mask holds the observations too, but the engine never
    # sampled them (rollout log-prob 0.0 placeholder there): ratios come from the policy tokens only.
    response_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    policy = torch.tensor([[1, 0, 0, 1], [1, 1, 0, 0]])                 # columns 1-2 of row 0, 2 of row 1: observation
    old = torch.tensor([[math.log(0.6), -9.0, -9.0, math.log(0.5)], [math.log(0.3), math.log(0.6), -9.0, 0.0]])
    rollout = torch.tensor([[math.log(0.4), 0.0, 0.0, math.log(0.5)], [math.log(0.2), math.log(0.5), 0.0, 0.0]])
    cfg = RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=5.0,
                                  rollout_token_veto_threshold=1e-3, rollout_rs="token", rollout_rs_threshold=5.0)
    out = compute_rollout_correction(old, rollout, response_mask, cfg, policy_mask=policy)
    # row 0: 1.5 x 1 = 1.5; row 1: 1.5 x 1.2 = 1.8, on every token of the row in the loss: the
    # observations too (the row was sampled under that weight); padding 0
    torch.testing.assert_close(out.weights, torch.tensor([[1.5, 1.5, 1.5, 1.5], [1.8, 1.8, 1.8, 0.0]]))
    assert torch.equal(out.response_mask, response_mask)                 # e^-9 on observations vetoes nothing
    # token IS: an observation has no ratio of its own and weighs 1
    token = compute_rollout_correction(old, rollout, response_mask, RolloutCorrectionConfig(
        rollout_is="token", rollout_is_threshold=5.0), policy_mask=policy)
    torch.testing.assert_close(token.weights, torch.tensor([[1.5, 1.0, 1.0, 1.0], [1.5, 1.2, 1.0, 0.0]]))
    # a row rejected as a whole leaves the loss with its observations
    cfg = RolloutCorrectionConfig(rollout_rs="sequence", rollout_rs_threshold=1.6)
    out = compute_rollout_correction(old, rollout, response_mask, cfg, policy_mask=policy)
    assert out.response_mask.tolist() == [[1, 1, 1, 1], [0, 0, 0, 0]]
    # without the policy mask the placeholders would be ratios: e^-9 vetoes row 0
    vetoing = RolloutCorrectionConfig(rollout_token_veto_threshold=1e-3)
    assert compute_rollout_correction(old, rollout, response_mask, vetoing).response_mask[0].tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("bypass", [False, True])
def test_bypass_kl_in_reward_leaves_out_tokens_sampled_from_a_cut_context(bypass: bool) -> None:
    # bypass: old log-probs are the engine's, sampled from the cut (shorter) context at those tokens,
    # not comparable with the reference's over the whole sequence; recomputed ones (decoupled) are
    from verl.protocol import DataProto
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.utils import batch_keys as K

    trainer = RayPPOTrainer.__new__(RayPPOTrainer)
    trainer.config = compose_config(["algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=kl"])
    trainer.reward_fn = lambda batch: torch.zeros(1, 4)
    trainer.use_kl_in_reward, trainer._bypass_old_log_prob = True, bypass
    trainer.kl_ctrl = core_algos.FixedKLController(0.5)
    batch = DataProto.from_dict(tensors={
        K.OLD_LOG_PROBS: torch.tensor([[-1.0, -1.0, -3.0, -3.0]]), K.REF_LOG_PROB: torch.full((1, 4), -2.0),
        K.RESPONSE_MASK: torch.ones(1, 4, dtype=torch.long),
        K.CONTEXT_CUT_MASK: torch.tensor([[0, 0, 1, 1]])})
    trainer._compute_reward(batch, {})
    rewards = batch.batch[K.TOKEN_LEVEL_REWARDS][0].tolist()
    # kl = old - ref: +1 on the first two tokens, -1 on the cut ones; reward -= 0.5 * kl
    assert rewards == ([-0.5, -0.5, 0.0, 0.0] if bypass else [-0.5, -0.5, 0.5, 0.5])
