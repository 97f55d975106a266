"""veRL's agent-loop keys (actor_rollout_ref.rollout.agent.*) compose, are checked at start-up with messages
naming the key, and reach the generation manager; the dataset keeps veRL's `agent_name` column."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from omegaconf import OmegaConf

from tests.trainer.test_tool_recipe_config import SMALL, TOOL
from verl.trainer.config_check import ConfigError, validate_config
from verl.trainer.main_ppo import compose_config

REPO = Path(__file__).resolve().parents[2]
LOOPS = REPO / "example" / "agent_loops" / "agent_loops.yaml"
AGENT = "actor_rollout_ref.rollout.agent"


def _errors(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        validate_config(compose_config(SMALL + overrides))
    return str(info.value)


def test_the_example_loop_composes_and_reaches_the_generation_config() -> None:
    from verl.trainer.ppo.rollout_setup import generation_config

    cfg = compose_config(SMALL + TOOL + [f"{AGENT}.agent_loop_config_path={LOOPS}",
                                         f"{AGENT}.default_agent_loop=search_budget_agent", f"{AGENT}.num_workers=4"])
    OmegaConf.resolve(cfg)
    validate_config(cfg)
    gen = generation_config(cfg, 2)
    assert (gen.default_agent_loop, gen.agent_loop_config_path) == ("search_budget_agent", str(LOOPS))
    assert gen.trainer_config["actor_rollout_ref"]["rollout"]["multi_turn"]["enable"] is True
    # the protocol's own loop by name is the default behaviour; so is veRL's single_turn_agent without search
    validate_config(compose_config(SMALL + [f"{AGENT}.default_agent_loop=search_r1_agent"]))
    validate_config(compose_config(SMALL + [f"{AGENT}.default_agent_loop=single_turn_agent", "do_search=false"]))


@pytest.mark.parametrize(("overrides", "message"), [
    ([f"{AGENT}.default_agent_loop=mine"], f"{AGENT}.default_agent_loop='mine' is not registered; registered: ["),
    ([f"{AGENT}.default_agent_loop=tool_agent"], "default_agent_loop=tool_agent runs the tool protocol; this run is "
                                                 "the tags protocol"),
    ([*TOOL, f"{AGENT}.default_agent_loop=search_r1_agent"], "runs the tags protocol; this run is the tool"),
    ([f"{AGENT}.num_workers=0"], f"{AGENT}.num_workers=0 must be an int >= 1"),
    ([*TOOL, f"{AGENT}.agent_loop_config_path={LOOPS}", "do_search=false"], "names agent loops, which run in the "
                                                                            "multi-turn rollout: set do_search=true"),
    ([*TOOL, f"{AGENT}.agent_loop_config_path=/nowhere/loops.yaml"], "agent_loop_config_path (/nowhere/loops.yaml): "
                                                                     "no such file"),
])
def test_bad_agent_settings_name_their_key(overrides: list[str], message: str) -> None:
    assert message in _errors(overrides)


def test_a_loop_file_must_name_agent_loop_classes(tmp_path: Path) -> None:
    (tmp_path / "loops.yaml").write_text("- name: x\n  _target_: collections.OrderedDict\n- {name: y}\n")
    assert "[0]._target_: 'collections.OrderedDict' is not a verl.experimental.agent_loop.AgentLoopBase" in \
        _errors([*TOOL, f"{AGENT}.agent_loop_config_path={tmp_path / 'loops.yaml'}"])
    (tmp_path / "loops.yaml").write_text("- {name: y}\n")
    assert "[0]: expected {name: <agent name>, _target_:" in \
        _errors([*TOOL, f"{AGENT}.agent_loop_config_path={tmp_path / 'loops.yaml'}"])


def test_the_dataset_keeps_verls_agent_name_column_and_the_raw_chat(tmp_path: Path, tiny_model_dir: str) -> None:
    from transformers import AutoTokenizer

    from verl.utils.dataset.rl_dataset import RLHFDataset

    rows = [{"data_source": "nq", "prompt": [{"role": "user", "content": f"q{i}?"}], "agent_name": name,
             "reward_model": {"ground_truth": {"target": ["a"]}}} for i, name in enumerate(["mine", None])]
    pd.DataFrame(rows).to_parquet(tmp_path / "d.parquet")
    data = RLHFDataset(str(tmp_path / "d.parquet"), AutoTokenizer.from_pretrained(tiny_model_dir), max_prompt_length=64)
    assert [data[i]["agent_name"] for i in range(2)] == ["mine", ""]
    assert data[0]["raw_prompt"] == [{"role": "user", "content": "q0?"}]


INTERACTIONS = REPO / "example" / "interactions" / "interaction_config.yaml"
INTERACTION = "actor_rollout_ref.rollout.multi_turn.interaction_config_path"


def test_interactions_compose_in_the_tool_protocol_and_are_refused_in_the_tags() -> None:
    from verl.trainer.ppo.rollout_setup import generation_config

    cfg = compose_config(SMALL + TOOL + [f"{INTERACTION}={INTERACTIONS}"])
    OmegaConf.resolve(cfg)
    validate_config(cfg)
    assert generation_config(cfg, 2).interaction_config_path == str(INTERACTIONS)
    assert f"{INTERACTION} needs the tool protocol (multi_turn.enable=true)" in \
        _errors([f"{INTERACTION}={INTERACTIONS}"])
    assert "interaction_config_path (/nowhere.yaml): no such file" in _errors([*TOOL, f"{INTERACTION}=/nowhere.yaml"])
