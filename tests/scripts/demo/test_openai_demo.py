"""`bash train_grpo.sh demo.agent=openai` (docs/demo.md "Your own agent"): the demo's entry point with the plain
`openai` example agent rolling out every row through the trainer's endpoint, at a tiny size (one RL step)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts.demo.run_demo import run_demo
from tests.scripts.demo.test_tool_demo import TINY_TOOL

# One validation question per kind (both sources, 6 rows): validation, twice a run, is most of a run's rollout.
ONE_PER_KIND = "demo.n_val_per_kind=1"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["async", "sync"])   # async first: in a serial run, before the session's Ray
def test_tiny_openai_agent_demo_trains_a_step_through_the_endpoint(tmp_path: Path, mode: str,
                                                                    request: pytest.FixtureRequest) -> None:
    """sync: the driver serves the endpoint over the worker group; async: each rollout worker serves its rows'
    agents over its own engine (generate_agent_samples)."""
    from tests.scripts.demo.test_run_demo import tiny_args

    if mode == "sync":
        # The sync agents run in this process (they find the demo's server in its environment): the run can join
        # the session's Ray instead of starting one. The async agents run in the workers, which must be started
        # after the demo has set SEARCH_R1_RETRIEVAL_URL: that run starts its own Ray, as the demo does.
        request.getfixturevalue("ray_cluster")
    # async on the demo's two workers: each serves its own rows' agents
    workers = 2 if mode == "async" else 1
    args = [a for a in tiny_args(tmp_path, workers) if not a.startswith("data.max_response_length=")] + [
        *(a for a in TINY_TOOL if not a.startswith("demo.protocol=")), "demo.agent=openai",
        f"actor_rollout_ref.rollout.mode={mode}", ONE_PER_KIND]
    summary = run_demo(args)
    assert summary.protocol == "tool"
    assert set(summary.val_em_after_by_source) == {"searchR1_demo_onehop", "searchR1_demo_twohop"}
    records = [json.loads(line) for line in Path(summary.metrics_path).read_text().splitlines()]
    trained = [r for r in records if "agent/samples" in r and "critic/score/mean" in r]
    assert trained, records
    step = trained[-1]
    # every row's agent ran against the endpoint and came back with samples the step trained on
    assert step["agent/samples"] > 0 and step["agent/completions"] >= step["agent/samples"]
    assert step["agent/failure_fraction"] <= 0.5
    assert ("agent/engine_calls" in step) == (mode == "sync")   # async: no driver-side waves


@pytest.mark.slow
def test_the_smolagents_example_trains_a_step_through_the_demo(ray_cluster, tmp_path: Path) -> None:
    """The framework example (example/openai_agents/smolagents_agent.py) in place of the plain one: smolagents
    re-renders its memory at every step, so its completions come back as prefix breaks, each a sample.
    Sync mode (its agents run in this process), so the run joins the session's Ray."""
    from tests.scripts.demo.test_run_demo import tiny_args

    agent = Path(__file__).resolve().parents[3] / "example" / "openai_agents" / "smolagents_agent.py"
    args = [a for a in tiny_args(tmp_path) if not a.startswith("data.max_response_length=")] + [
        *(a for a in TINY_TOOL if not a.startswith("demo.protocol=")), "demo.agent=openai",
        f"openai_agent.path={agent}", "openai_agent.max_failure_fraction=1.0",
        # smolagents' own system prompt and tool list are longer than the demo's, and its second step re-renders
        # the first one's completion into a new prompt (a prefix break)
        "data.max_prompt_length=2048", "data.max_response_length=768", ONE_PER_KIND]
    summary = run_demo(args)
    records = [json.loads(line) for line in Path(summary.metrics_path).read_text().splitlines()]
    step = [r for r in records if "agent/samples" in r and "critic/score/mean" in r][-1]
    assert step["agent/samples"] > 0 and step["agent/completions"] >= step["agent/samples"]
    assert step["agent/failure_fraction"] < 1.0
