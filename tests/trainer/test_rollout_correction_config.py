"""`algorithm.rollout_correction` as a config node: unknown keys refused on every path that reads it
(Hydra composition, `config_errors`, `RolloutCorrectionConfig.from_config`, `bypass_mode`), veRL's
newer spellings (`bypass_mode`, `loss_type`, `use_policy_gradient`) accepted where this project has
their meaning and refused by name where it does not, and `rollout_is: auto`: token IS in a pipelined
run that chose no other correction."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from verl.trainer.config_check import ConfigError, validate_config
from verl.trainer.main_ppo import compose_config
from verl.trainer.ppo.rollout_correction import (
    RolloutCorrectionConfig,
    RolloutCorrectionConfigError,
    bypass_mode,
    config_errors,
)

PREFIX = "algorithm.rollout_correction"
MASKED = "actor_rollout_ref.actor.state_masking=true"   # bypass mode with search needs it


def _node(**keys: object) -> object:
    """The YAML's node with `keys` changed, as another code path (not Hydra) would hand it over."""
    node = OmegaConf.to_container(compose_config([]).algorithm.rollout_correction)
    return OmegaConf.create({**node, **keys})


# --------------------------------------------------------------------------- unknown keys
def test_an_unknown_key_is_refused_when_composed_through_hydra() -> None:
    with pytest.raises(ConfigError, match=f"{PREFIX}.rollout_is_treshold"):
        validate_config(compose_config([f"+{PREFIX}.rollout_is_treshold=3.0"]))


def test_an_unknown_key_is_refused_by_every_function_that_reads_the_node() -> None:
    node = _node(rollout_is_treshold=3.0, rollout_is="token")
    (message,) = config_errors(node)
    assert message.startswith(f"{PREFIX}.rollout_is_treshold is not a rollout-correction key; the keys are [")
    with pytest.raises(RolloutCorrectionConfigError, match=f"{PREFIX}.rollout_is_treshold is not"):
        RolloutCorrectionConfig.from_config(node)
    with pytest.raises(RolloutCorrectionConfigError, match="rollout_is_treshold"):
        bypass_mode(OmegaConf.create({"algorithm": {"rollout_correction": node}}))
    # a plain dict (a recipe's own tree) too; veRL's spellings and this project's are all known
    assert config_errors({"rollout_is": "token", "bypass_mode": False, "loss_type": "ppo_clip",
                          "use_policy_gradient": False, "bypass_old_logprob_for_rollout": None}) == []
    assert config_errors({"rollout_is": "token", "rollout_rs_thresold": 2.0}) == [
        message.replace("rollout_is_treshold", "rollout_rs_thresold")]


def test_veRLs_newer_rejection_names_are_refused_with_their_equivalent_here() -> None:
    (message,) = config_errors(_node(rollout_rs="seq_mean_k1"))
    assert message.startswith(f"{PREFIX}.rollout_rs='seq_mean_k1' is unknown")
    assert "veRL's 'seq_mean_k1' is 'geometric' here" in message


# --------------------------------------------------------------------------- bypass_mode alias
def test_bypass_mode_is_veRLs_spelling_of_bypass_old_logprob_for_rollout() -> None:
    cfg = compose_config([f"{PREFIX}.bypass_mode=true", MASKED])
    validate_config(cfg)
    assert bypass_mode(cfg)
    assert RolloutCorrectionConfig.from_config(cfg.algorithm.rollout_correction).bypass_old_logprob_for_rollout
    # both spellings, agreeing: accepted; neither: off
    validate_config(compose_config([f"{PREFIX}.bypass_mode=true", f"{PREFIX}.bypass_old_logprob_for_rollout=true",
                                    MASKED]))
    assert not bypass_mode(compose_config([f"{PREFIX}.bypass_mode=false"]))
    assert not bypass_mode(compose_config([]))


@pytest.mark.parametrize(("new", "old"), [(True, False), (False, True)])
def test_both_bypass_spellings_set_and_different_are_refused_naming_both(new: bool, old: bool) -> None:
    cfg = compose_config([f"{PREFIX}.bypass_mode={new}", f"{PREFIX}.bypass_old_logprob_for_rollout={old}", MASKED])
    with pytest.raises(ConfigError, match=f"bypass_old_logprob_for_rollout={old} and {PREFIX}.bypass_mode={new} "
                                          "disagree"):
        validate_config(cfg)


def test_bypass_mode_spelled_the_new_way_refuses_what_it_cannot_anchor_naming_that_spelling() -> None:
    with pytest.raises(ConfigError, match=f"{PREFIX}.bypass_mode=true \\(bypass mode\\) with "
                                          "actor_rollout_ref.actor.state_masking=false"):
        validate_config(compose_config([f"{PREFIX}.bypass_mode=true", "actor_rollout_ref.actor.state_masking=false"]))
    with pytest.raises(ConfigError, match="rollout_rs='token' with bypass_mode=true"):
        validate_config(compose_config([f"{PREFIX}.bypass_mode=true", f"{PREFIX}.rollout_rs=token", MASKED]))


# --------------------------------------------------------------------------- veRL's loss selectors
def test_the_ppo_clip_loss_is_accepted_under_both_of_veRLs_selectors() -> None:
    validate_config(compose_config([f"{PREFIX}.bypass_mode=true", f"{PREFIX}.loss_type=ppo_clip",
                                    f"{PREFIX}.use_policy_gradient=false", MASKED]))


@pytest.mark.parametrize(("override", "message"), [
    ("loss_type=reinforce", "loss_type=reinforce: veRL's REINFORCE loss with explicit IS weights"),
    ("loss_type=gspo", "loss_type='gspo' is unknown; choose one of \\['ppo_clip', 'reinforce'\\]"),
    ("use_policy_gradient=true", "use_policy_gradient=true: veRL's policy-gradient loss without clipping"),
    ("use_policy_gradient=1", "use_policy_gradient=1 must be true or false"),
    ("bypass_mode=yes", "bypass_mode='yes' must be true or false"),
])
def test_veRLs_losses_not_implemented_here_are_refused_naming_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=f"{PREFIX}.{message}"):
        validate_config(compose_config([f"{PREFIX}.bypass_mode=true", f"{PREFIX}.{override}", MASKED]))


# --------------------------------------------------------------------------- auto: the pipeline's default IS
@pytest.mark.parametrize(("keys", "pipelined", "expected"), [
    ({}, False, None),                                          # off in a sync run
    ({}, True, "token"),                                        # a pipeline's decoupled loss: token IS
    ({"rollout_is_threshold": 3.0}, True, "token"),             # tuning the default IS keeps it
    ({"rollout_is": None}, True, None),                         # an explicit null turns it off
    ({"rollout_rs": "token"}, True, None),                      # rejection only: no IS added
    ({"rollout_token_veto_threshold": 1e-4}, True, None),       # the veto only: no IS added
    ({"bypass_mode": True}, True, None),                        # bypass: its ratios would all be 1
    ({"rollout_is": "sequence"}, False, "sequence"),
    ({"rollout_is": "sequence", "rollout_rs": "token"}, True, "sequence"),
])
def test_auto_is_token_is_in_a_pipeline_that_chose_no_other_correction(keys: dict, pipelined: bool,
                                                                       expected: str | None) -> None:
    cfg = RolloutCorrectionConfig.from_config(_node(**keys), pipelined=pipelined)
    assert cfg.rollout_is == expected
    assert cfg.rollout_is_threshold == keys.get("rollout_is_threshold", 2.0)
    # no node at all: every key at its default (auto)
    assert RolloutCorrectionConfig.from_config(None, pipelined=True).rollout_is == "token"
    assert RolloutCorrectionConfig.from_config({"rollout_rs": "token"}, pipelined=True).rollout_is is None


def test_a_config_built_directly_takes_resolved_levels_only() -> None:
    # `auto` needs to know whether the run is pipelined: only from_config resolves it; built directly
    # it would otherwise fall through to the sequence branch of compute_rollout_correction
    with pytest.raises(RolloutCorrectionConfigError, match="rollout_is='auto': token, sequence or None"):
        RolloutCorrectionConfig(rollout_is="auto")
    with pytest.raises(RolloutCorrectionConfigError, match="rollout_rs='tokens'"):
        RolloutCorrectionConfig(rollout_rs="tokens")
