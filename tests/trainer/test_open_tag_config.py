"""The open tag's trainer keys (`open_tag.*`): declared, checked naming the key, passed to the manager."""

from __future__ import annotations

import dataclasses

import pytest

from search_r1.llm_agent import actions
from verl.trainer.config_check import config_errors
from verl.trainer.main_ppo import compose_config
from verl.trainer.ppo.rollout_setup import generation_config


def test_default_is_off_and_the_manager_gets_the_originals_settings():
    cfg = compose_config([])
    assert cfg.open_tag.enable is False
    assert not [e for e in config_errors(cfg) if "open_tag" in e]
    gen = generation_config(cfg, 8)
    assert gen.open_tag is False and gen.stop == actions.STOP_STRINGS == ("</search>", "</answer>")


def test_on_passes_the_settings_and_adds_the_stop_string():
    cfg = compose_config(["open_tag.enable=true", "open_tag.max_opens=3", "open_tag.page_size=500"])
    assert not [e for e in config_errors(cfg) if "open_tag" in e]
    gen = generation_config(cfg, 8)
    assert (gen.open_tag, gen.max_opens, gen.open_page_size) == (True, 3, 500)
    assert gen.stop == ("</search>", "</answer>", "</open>")
    assert dataclasses.asdict(gen)["open_tag"] is True    # what travels to async rollout workers


@pytest.mark.parametrize("overrides, message", [
    (["open_tag.enable=yes"], "open_tag.enable='yes' must be true or false"),
    (["open_tag.enable=true", "open_tag.max_opens=0"], "open_tag.max_opens=0 must be an integer >= 1"),
    (["open_tag.enable=true", "open_tag.page_size=0"], "open_tag.page_size=0 must be an integer in [1, 20000]"),
    (["open_tag.enable=true", "open_tag.page_size=50000"], "open_tag.page_size=50000"),
    (["open_tag.enable=true", "do_search=false"], "open_tag.enable=true needs do_search=true"),
    (["open_tag.enable=true", "retriever.serve=ray"], "retriever.serve=ray is not supported with it"),
])
def test_bad_settings_are_refused_naming_the_key(overrides, message):
    errors = config_errors(compose_config(overrides))
    assert any(message in e for e in errors), errors


def test_with_the_tool_protocol_it_is_refused():
    errors = config_errors(compose_config(["open_tag.enable=true", "actor_rollout_ref.rollout.multi_turn.enable=true"]))
    assert any("open_tag.enable=true is the tag protocol's" in e for e in errors), errors


def test_an_undeclared_open_tag_key_is_refused():
    with pytest.raises(Exception, match="open_tag"):
        compose_config(["open_tag.max_open=3"])
