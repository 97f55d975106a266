"""The user's agents run per row against the endpoint (search_r1/llm_agent/openai_endpoint/agents.py,
rollout.py), on the real HF step engine over the demo's tool warm start and a real BM25 server: a failing
agent costs only its row; rows' samples become a batch whose rows the trainer repeats to match; the
plain-`openai` example agent searches and answers through the endpoint."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import numpy as np
import openai
import pytest
import torch

from search_r1.llm_agent.openai_endpoint import agents, rollout
from search_r1.llm_agent.openai_endpoint.engines import BatchedClient, StepEngineClient
from search_r1.llm_agent.openai_endpoint.server import Endpoint, EndpointLimits
from verl.protocol import DataProto
from verl.utils import batch_keys as K

REPO = Path(__file__).resolve().parents[2]
WARMSTART = REPO / "example" / "demo_warmstart_tool"
EXAMPLE = REPO / "example" / "openai_agents" / "search_agent.py"


@pytest.fixture(scope="module")
def engine():
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl.workers.rollout import HFRollout

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(WARMSTART)
    model = AutoModelForCausalLM.from_pretrained(WARMSTART).eval()
    cfg = OmegaConf.create({"temperature": 1.0, "response_length": 96, "micro_batch_size": 8})
    meta = {"eos_token_id": [tok.eos_token_id], "pad_token_id": tok.pad_token_id, "do_sample": False,
            "stop": ["</tool_call>"]}
    return tok, HFRollout(model, cfg, tok).step_engine(meta)


def _endpoint(engine, **limits) -> Endpoint:
    tok, step_engine = engine
    return Endpoint(tok, StepEngineClient(step_engine, 96),
                    EndpointLimits(max_prompt_length=640, max_response_length=400, **limits),
                    frozenset([tok.eos_token_id]))


def _rows(questions: list[str]) -> list[dict]:
    from scripts.demo.tool_demonstrations import prompt_messages

    return [{"raw_prompt": prompt_messages(q), "extra_info": {"index": i}} for i, q in enumerate(questions)]


async def _asks_once(base_url: str, row: dict) -> dict:
    async with openai.AsyncOpenAI(base_url=base_url, api_key="-") as client:
        reply = await client.chat.completions.create(model="policy", messages=row["raw_prompt"], max_tokens=8)
    return {"text": reply.choices[0].message.content}


def test_a_failing_agent_costs_only_its_row(engine) -> None:
    """Rows whose agent raises, times out, returns no dict or never calls the endpoint are dropped and
    counted; the others keep their samples."""
    async def agent(base_url: str, row: dict) -> dict:
        kind = row["kind"]
        if kind == "raises":
            await _asks_once(base_url, row)      # its completion is not trained on either
            raise RuntimeError("the agent's own bug")
        if kind == "hangs":
            await asyncio.sleep(60)
        if kind == "no_dict":
            await _asks_once(base_url, row)
            return "an answer"                   # type: ignore[return-value]
        if kind == "silent":
            return {}
        return await _asks_once(base_url, row)

    kinds = ["ok", "raises", "hangs", "no_dict", "silent", "ok"]
    rows = [{**r, "kind": k} for r, k in zip(_rows(["Where was Eldriqui Kabel born?"] * 6), kinds, strict=True)]
    settings = agents.AgentSettings(path="unused.py", concurrency=3, timeout=5.0, max_failure_fraction=0.5)
    results, counters = agents.run_agents(agent, _endpoint(engine), rows, settings)
    assert [bool(r.samples) for r in results] == [k == "ok" for k in kinds]
    assert counters["failures"] == 4 and counters["timeouts"] == 1
    assert "RuntimeError: the agent's own bug" in results[1].error
    assert results[0].output == {"text": results[0].output["text"]}
    agents.check_failures(counters, 6, agents.AgentSettings(path="x.py", max_failure_fraction=0.7), "rollout")
    with pytest.raises(agents.AgentFailureError, match="openai_agent.max_failure_fraction"):
        agents.check_failures(counters, 6, agents.AgentSettings(path="x.py", max_failure_fraction=0.5), "rollout")


def test_samples_become_a_batch_the_trainer_repeats_rows_for(engine) -> None:
    """compose: one batch row per sample (prompts left-padded, completions in loss_mask, inserted text not);
    select_samples: the generation batch's rows repeated to match, the agent's return value in extra_info."""
    from search_r1.llm_agent.generation import GenerationConfig, LLMGenerationManager

    tok = engine[0]

    async def agent(base_url: str, row: dict) -> dict:
        if row["extra_info"]["index"] == 1:
            raise ValueError("dropped")
        async with openai.AsyncOpenAI(base_url=base_url, api_key="-") as client:
            messages = list(row["raw_prompt"])
            reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
            messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]
            await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
            if row["extra_info"]["index"] == 2:   # rewrites its history: a second sample
                await client.chat.completions.create(model="policy", messages=messages[:2] + messages[-1:], max_tokens=6)
        return {"answer": f"row {row['extra_info']['index']}"}

    rows = _rows(["Where was Eldriqui Kabel born?", "In which country is Naruven?", "Who founded Marrowind Logistics?"])
    settings = agents.AgentSettings(path="unused.py", max_failure_fraction=1.0)
    results, counters = agents.run_agents(agent, _endpoint(engine), rows, settings)
    assert counters["prefix_breaks"] == 1 and counters["samples"] == 3
    config = GenerationConfig(max_turns=1, max_start_length=100, max_prompt_length=200, max_response_length=50,
                              max_obs_length=150)
    manager = LLMGenerationManager(tok, None, config)
    out = rollout.compose(manager, results, counters, {"generate": 1.0})
    assert out.meta_info[rollout.SAMPLE_ROWS] == [0, 2, 2]
    assert out.meta_info["tool_stats"]["agent/failures"] == 1.0
    first = results[0].samples[0]
    width = out.batch[K.RESPONSES].shape[1]
    assert out.batch[K.LOSS_MASK][0].tolist() == first.response_mask + [0] * (width - len(first.response_mask))
    prompt = out.batch[K.PROMPTS][0]
    assert prompt[prompt != tok.pad_token_id].tolist() == first.prompt_ids

    uids = np.array(["a", "b", "c"], dtype=object)
    infos = np.array([{"index": i} for i in range(3)], dtype=object)
    batch = DataProto.from_dict(tensors={"dummy": torch.zeros(3, 1)}, non_tensors={K.UID: uids, K.EXTRA_INFO: infos})
    picked = rollout.select_samples(batch, dict(out.meta_info))
    assert list(picked.non_tensor_batch[K.UID]) == ["a", "c", "c"]
    assert [i["agent_output"]["answer"] for i in picked.non_tensor_batch[K.EXTRA_INFO]] == ["row 0", "row 2", "row 2"]


def test_the_plain_openai_example_agent_searches_and_answers(engine, retrieval_url, monkeypatch) -> None:
    """example/openai_agents/search_agent.py through the endpoint: its search call runs against the BM25
    server, its tool message is the tool protocol's rendering (veRL SearchTool's text, cut to 256
    characters), inserted masked; it returns a dict."""
    from search_r1.llm_agent import tools
    from search_r1.search.client import RetrievalClient

    monkeypatch.setenv("SEARCH_R1_RETRIEVAL_URL", retrieval_url)
    settings = agents.AgentSettings(path=str(EXAMPLE))
    agent = agents.load_agent(settings)
    results, counters = agents.run_agents(agent, _endpoint(engine), _rows(["Where was Eldriqui Kabel born?"]), settings)
    (result,) = results
    assert result.error is None and set(result.output) == {"answer", "turns"}
    (sample,) = result.samples
    completion, inserted, _ = sample.turns[0]
    call = json.loads(engine[0].decode(completion).split("<tool_call>")[1].split("</tool_call>")[0])
    hits = RetrievalClient(retrieval_url, topk=2).retrieve(call["arguments"]["query_list"])
    expected = tools.truncate_tool_response(tools.render_search_results(hits), 256, "middle")[0]
    assert expected in engine[0].decode(inserted)
    assert counters["prefix_breaks"] == 0 and len(sample.turns) == result.output["turns"] >= 2


def test_load_agent_refuses_what_it_cannot_run(tmp_path) -> None:
    file = tmp_path / "agent.py"
    file.write_text("def agent(base_url, row):\n    return {}\n")
    with pytest.raises(TypeError, match="openai_agent.name: 'agent' .* must be an async function"):
        agents.load_agent(agents.AgentSettings(path=str(file)))
    with pytest.raises(AttributeError, match="defines no 'run'"):
        agents.load_agent(agents.AgentSettings(path=str(file), name="run"))
    with pytest.raises(ValueError, match="openai_agent.concurrency"):
        agents.AgentSettings(path=str(file), concurrency=0)


def test_batched_client_sends_one_engine_call_per_wave() -> None:
    """Sync mode: requests of the running agents go out together (one call), each cut to its own budget."""
    calls: list[tuple[int, int]] = []

    def generate_batch(prompts, length):
        calls.append((len(prompts), length))
        return [list(range(100, 100 + length)) for _ in prompts], [[-0.5] * length for _ in prompts]

    async def main():
        client = BatchedClient(generate_batch, response_length=10, running=lambda: 3, linger_s=5.0)
        return await asyncio.gather(*(client.generate([1, 2], budget, 0) for budget in (2, 7, 4)))

    completions = asyncio.run(main())
    assert calls == [(3, 7)]
    assert [len(c.token_ids) for c in completions] == [2, 7, 4]
    assert Counter(len(c.log_probs) for c in completions) == Counter({2: 1, 7: 1, 4: 1})


def test_the_smolagents_example_runs_through_the_endpoint(engine, retrieval_url, monkeypatch) -> None:
    """example/openai_agents/smolagents_agent.py (a framework agent, run in a thread as smolagents blocks)
    completes a row through the endpoint; its re-rendered history shows as prefix breaks, every completion a
    sample of the row."""
    pytest.importorskip("smolagents")
    from search_r1.llm_agent.openai_endpoint.engines import StepEngineClient

    monkeypatch.setenv("SEARCH_R1_RETRIEVAL_URL", retrieval_url)
    tok, step_engine = engine
    endpoint = Endpoint(tok, StepEngineClient(step_engine, 96), EndpointLimits(max_prompt_length=1500,
                                                                               max_response_length=400),
                        frozenset([tok.eos_token_id]))
    settings = agents.AgentSettings(path=str(EXAMPLE.parent / "smolagents_agent.py"), timeout=300)
    results, counters = agents.run_agents(agents.load_agent(settings), endpoint,
                                          _rows(["Where was Eldriqui Kabel born?"]), settings)
    (result,) = results
    assert result.error is None and "answer" in result.output
    assert counters["completions"] >= 2 and counters["samples"] == counters["prefix_breaks"] + 1


def test_async_mode_results_come_back_reindexed_with_the_engines_log_prob_flag() -> None:
    """rollout.mode=async (generate_agent_samples on the workers): each result's row is its index in the batch,
    the rows' and the shards' counters are summed, and the workers' log-prob flag reaches the manager (vLLM with
    truncated sampling gives log-probs that are not the actor's: rollout correction must hear of it)."""
    from types import SimpleNamespace

    sent = {}

    class Group:
        def generate_agent_samples(self, batch: DataProto) -> DataProto:
            sent["batch"] = batch
            results = np.empty(3, dtype=object)
            results[:] = [agents.RowResult(row=0, completions=2), agents.RowResult(row=1, error="timed out after 5 s"),
                          agents.RowResult(row=0, completions=1)]   # two shards: local row indices
            shard = np.empty(3, dtype=object)
            shard[:] = [{"context_exceeded": 1}, {}, {"context_exceeded": 2}]
            return DataProto.from_dict(tensors={rollout.AGENT_ROW: batch.batch[rollout.AGENT_ROW]},
                                       non_tensors={rollout.AGENT_RESULTS: results,
                                                    rollout.AGENT_ENDPOINT_COUNTERS: shard},
                                       meta_info={K.META_ROLLOUT_LOG_PROBS_MATCH_ACTOR: False})

    manager = SimpleNamespace(actor_rollout_wg=Group(), _log_probs_match_actor=True)
    fields = [{"raw_prompt": [{"role": "user", "content": f"q{i}"}]} for i in range(3)]
    results, counters = rollout._worker_results(manager, fields, {K.META_STOP: ["</tool_call>"]}, {"path": "a.py"})
    assert [r.row for r in results] == [0, 1, 2]
    assert counters["completions"] == 3 and counters["failures"] == 1 and counters["timeouts"] == 1
    assert counters["context_exceeded"] == 3
    assert manager._log_probs_match_actor is False
    assert list(sent["batch"].non_tensor_batch[rollout.AGENT_FIELDS]) == fields
    assert sent["batch"].meta_info[rollout.AGENT_SETTINGS] == {"path": "a.py"}
