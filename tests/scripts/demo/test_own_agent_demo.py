"""docs/demo.md "Your own tool and your own agent loop": the tool demo's entry point with the example tool
(example/tools/corpus_search_tool.yaml) and with the example agent loop (example/agent_loops/agent_loops.yaml),
at a tiny size (one RL step each; the learning figures in docs/demo.md are demo runs, not tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from scripts.demo.run_demo import run_demo
from tests.scripts.demo.test_tool_demo import TINY_TOOL

REPO = Path(__file__).resolve().parents[3]


def _tiny(tmp_path: Path, *extra: str) -> list[str]:
    from tests.scripts.demo.test_run_demo import tiny_args

    return [a for a in tiny_args(tmp_path) if not a.startswith("data.max_response_length=")] + TINY_TOOL + list(extra)


def _trained_step(summary) -> dict:
    records = [json.loads(line) for line in Path(summary.metrics_path).read_text().splitlines()]
    return [r for r in records if "critic/score/mean" in r][-1]


@pytest.mark.slow
def test_the_demo_trains_with_the_example_tool(tmp_path: Path) -> None:
    # the example YAML as shipped, its corpus_path pointed at this run's data folder (the docs' command runs
    # from the repository, where the demo writes data/demo_tool/corpus.jsonl before the tool loads)
    config = yaml.safe_load((REPO / "example" / "tools" / "corpus_search_tool.yaml").read_text())
    config["tools"][0]["class_name"] = f"{REPO / 'example' / 'tools' / 'corpus_search_tool.py'}:CorpusSearchTool"
    config["tools"][0]["config"]["corpus_path"] = str(tmp_path / "data" / "corpus.jsonl")
    (tmp_path / "tool.yaml").write_text(yaml.safe_dump(config))
    step = _trained_step(run_demo(_tiny(tmp_path, f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'tool.yaml'}")))
    assert "tools/search/reward" in step   # the example tool's calc_reward, per row


@pytest.mark.slow
def test_the_demo_trains_with_the_example_agent_loop(tmp_path: Path) -> None:
    loops = REPO / "example" / "agent_loops" / "agent_loops.yaml"
    step = _trained_step(run_demo(_tiny(tmp_path, f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}",
                                        "actor_rollout_ref.rollout.agent.default_agent_loop=search_budget_agent")))
    assert step["env/agent_loop/search_budget_agent/rows"] > 0
