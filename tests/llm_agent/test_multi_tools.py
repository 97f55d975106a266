"""Several tools in one tool config: `search` and `open` (a passage by doc_id from the real BM25
server's POST /open), their schemas in the chat template, dispatch by name, per-tool budgets and
metrics, through the rollout sync and async (scripted engines)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest
import requests

from search_r1.llm_agent import tool_backends, tools
from search_r1.llm_agent.generation import LLMGenerationManager
from tests.llm_agent.helpers import encode
from tests.llm_agent.test_tool_protocol import response_of, run_tool, tool_gen_config, tool_prompt_ids
from verl.utils import batch_keys as K

OPEN_SCHEMA = {"type": "function", "function": {
    "name": "open", "description": "Opens a passage by the doc_id a search result gave, one page at a time.",
    "parameters": {"type": "object", "properties": {"doc_id": {"type": "string"}, "page": {"type": "integer"}},
                   "required": ["doc_id"]}}}
SEARCH_SCHEMA = {"type": "function", "function": {
    "name": "search", "description": "Searches the corpus.",
    "parameters": {"type": "object", "properties": {"query_list": {"type": "array", "items": {"type": "string"}}},
                   "required": ["query_list"]}}}


def two_tools(url: str, open_budget: int | None = None, page_size: int = 150) -> tools.ToolConfig:
    open_config = {"retrieval_service_url": url, "page_size": page_size, "timeout": 5}
    if open_budget is not None:
        open_config["max_calls_per_row"] = open_budget
    return tools.parse_tool_config({"tools": [
        {"class_name": "verl.tools.search_tool.SearchTool",
         "config": {"retrieval_service_url": url, "show_doc_ids": True, "topk": 2}, "tool_schema": SEARCH_SCHEMA},
        {"class_name": "search_r1.llm_agent.tool_backends.OpenTool", "config": open_config,
         "tool_schema": OPEN_SCHEMA},
    ]}, source="two.yaml")


def call_text(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def observations(tok, out, row: int) -> list[str]:
    """The tool messages of a row, in order (the masked segments' `<tool_response>` bodies)."""
    ids, loss = response_of(out, row)
    text = tok.decode([t for t, m in zip(ids, loss, strict=True) if m == 0])
    return [part.split("\n</tool_response>")[0] for part in text.split("<tool_response>\n")[1:]]


def test_config_with_two_tools_renders_both_schemas_and_refuses_bad_entries(tool_tokenizer, retrieval_url):
    config = two_tools(retrieval_url, open_budget=2)
    assert config.tool_names == ["search", "open"] and config.search_name == "search"
    assert config.others == [{"name": "open", "class_name": "search_r1.llm_agent.tool_backends.OpenTool",
                              "config": {"retrieval_service_url": retrieval_url, "page_size": 150, "timeout": 5,
                                         "max_calls_per_row": 2}}]
    assert config.budgets == {"open": 2}
    assert tools.ToolConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    prompt = tool_tokenizer.decode(tool_prompt_ids(tool_tokenizer, "q1", config.schemas))
    assert '"name": "search"' in prompt and '"name": "open"' in prompt and "doc_id" in prompt
    bad = {"tools": [{"class_name": "search_r1.llm_agent.tool_backends.OpenTool",
                      "config": {"retrieval_service_url": retrieval_url, "pages": 3}, "tool_schema": OPEN_SCHEMA}]}
    with pytest.raises(ValueError, match=r"tools\[0\]\.config: unknown keys \['pages'\]"):
        tools.parse_tool_config(bad, source="bad.yaml")
    bad["tools"][0]["config"] = {"retrieval_service_url": retrieval_url, "max_calls_per_row": 0}
    with pytest.raises(ValueError, match=r"config\.max_calls_per_row: must be an integer >= 1"):
        tools.parse_tool_config(bad)
    bad["tools"][0]["config"] = {}
    with pytest.raises(ValueError, match="needs retrieval_service_url"):
        tools.parse_tool_config(bad)
    bad["tools"][0]["class_name"] = "verl.tools.gsm8k_tool.Gsm8kTool"
    with pytest.raises(ValueError, match="class_name: 'verl.tools.gsm8k_tool.Gsm8kTool' is not a tool.*OpenTool"):
        tools.parse_tool_config(bad)


def test_open_endpoint_pages_a_passage_and_names_bad_requests(retrieval_url):
    base = retrieval_url.removesuffix("/retrieve")
    first = requests.post(f"{base}/open", json={"doc_id": "1", "page": 1, "page_size": 100}, timeout=10).json()
    body = "The Eiffel Tower is a lattice tower in Paris, built in 1889. " * 8
    assert first == {"id": "1", "title": "Eiffel Tower", "text": body[:100], "page": 1,
                     "num_pages": -(-len(body) // 100)}
    last = requests.post(f"{base}/open", json={"doc_id": "1", "page": first["num_pages"], "page_size": 100},
                         timeout=10).json()
    assert last["text"] == body[(first["num_pages"] - 1) * 100:]
    missing = requests.post(f"{base}/open", json={"doc_id": "nope"}, timeout=10)
    assert missing.status_code == 404 and "no document with id 'nope'" in missing.json()["detail"]
    past = requests.post(f"{base}/open", json={"doc_id": "1", "page": 99}, timeout=10)
    assert past.status_code == 400 and "page must be an integer in [1, 1]" in past.json()["detail"]


def test_search_then_open_through_the_sync_rollout_with_per_tool_metrics(tool_tokenizer, retrieval_url):
    tok = tool_tokenizer
    eos = tok.eos_token_id
    config = two_tools(retrieval_url)
    search = encode(tok, call_text("search", {"query_list": ["Eiffel Tower"]}))
    open_ = encode(tok, call_text("open", {"doc_id": "1", "page": 2}))
    unknown = encode(tok, call_text("browse", {"url": "x"}))
    answer = encode(tok, "<answer> 1889 </answer>") + [eos]
    gen = tool_gen_config(config, max_tool_response_length=None, max_obs_length=600, max_response_length=1500,
                          max_total_response_length=1500, max_prompt_length=4000, max_assistant_turns=5)
    out, _ = run_tool(tok, {"q1": [search, open_, answer], "q2": [unknown, answer]}, ["q1", "q2"], gen)
    found, opened = observations(tok, out, 0)
    assert found.startswith('{"result": "Doc 1 (Title: \\"Eiffel Tower\\") [doc_id: 1]\\n')
    direct = tool_backends.OpenTool("open", config.others[0]["config"]).call({"doc_id": "1", "page": 2})
    assert opened == direct
    assert json.loads(opened)["result"].startswith("Eiffel Tower\n[doc 1, page 2 of 4 (open page 3 for more)]\n")
    [refused] = observations(tok, out, 1)
    assert "unknown tool 'browse'; available tools: ['search', 'open']" in refused
    meta = out.meta_info
    assert meta["stop_reasons"]["answered"] == 2 and meta["tool_calls"] == 3 and meta["tool_call_errors"] == 1
    stats = meta["tool_stats"]
    assert (stats["tools/search/calls"], stats["tools/open/calls"], stats["tools/_unknown/calls"]) == (1, 1, 1)
    assert (stats["tools/search/errors"], stats["tools/open/errors"], stats["tools/_unknown/errors"]) == (0, 0, 1)
    assert stats["tools/open/latency_ms"] > 0
    from verl.trainer.ppo.metric_utils import compute_env_metrics

    metrics = compute_env_metrics(meta)
    assert metrics["tools/open/calls"] == 1.0 and metrics["tools/open/latency_ms_mean"] == stats["tools/open/latency_ms"]


def test_per_tool_budget_answers_the_extra_call_with_an_error(tool_tokenizer, retrieval_url):
    tok = tool_tokenizer
    eos = tok.eos_token_id
    config = two_tools(retrieval_url, open_budget=1)
    open_1 = encode(tok, call_text("open", {"doc_id": "1"}))
    open_2 = encode(tok, call_text("open", {"doc_id": "2"}))
    bad_page = encode(tok, call_text("open", {"doc_id": "2", "page": 0}))
    answer = encode(tok, "<answer> x </answer>") + [eos]
    gen = tool_gen_config(config, max_tool_response_length=None, max_obs_length=600, max_response_length=1500,
                          max_total_response_length=1500, max_prompt_length=4000, max_assistant_turns=5)
    out, _ = run_tool(tok, {"q1": [open_1, open_2, answer], "q2": [bad_page, answer]}, ["q1", "q2"], gen)
    first, second = observations(tok, out, 0)
    assert json.loads(first)["result"].startswith("Eiffel Tower\n[doc 1, page 1 of 4")
    assert json.loads(second)["result"] == ("Error: tool 'open' may be called at most 1 times per trajectory; this "
                                            "call was not run. Answer with what you have or use another tool.")
    [bad] = observations(tok, out, 1)
    assert json.loads(bad)["result"] == "Error: 'page' must be a positive integer, got 0"
    stats = out.meta_info["tool_stats"]
    # row 1: 2 calls (1 over budget); row 2: 1 call (a bad page, answered by the tool as an error)
    assert stats["tools/open/calls"] == 3 and stats["tools/open/errors"] == 2
    assert out.meta_info["tool_call_errors"] == 1 and out.meta_info["stop_reasons"]["answered"] == 2


def test_async_rollout_with_two_tools_equals_sync(tool_tokenizer, retrieval_url):
    from search_r1.llm_agent.async_generation import AsyncAgentLoop
    from search_r1.search.async_client import AsyncRetrievalClient
    from verl.workers.rollout.async_engine import Completion

    tok = tool_tokenizer
    eos = tok.eos_token_id
    config = two_tools(retrieval_url, open_budget=1)
    search = encode(tok, call_text("search", {"query_list": ["capital of Germany"]}))
    open_ = encode(tok, call_text("open", {"doc_id": "2"}))
    answer = encode(tok, "<answer> Berlin </answer>") + [eos]
    scripts = {"q1": [search, open_, open_, answer], "q2": [open_, answer]}
    gen = tool_gen_config(config, max_tool_response_length=None, max_obs_length=600, max_response_length=1500,
                          max_total_response_length=1500, max_prompt_length=4000, max_assistant_turns=5)
    sync_out, engine = run_tool(tok, scripts, ["q1", "q2"], gen)

    class ScriptedAsyncEngine:
        async def generate(self, prompt_ids, seed, max_tokens=None, follows=None):
            meta = {K.META_RESPONSE_LENGTH: max_tokens, K.META_EOS_TOKEN_ID: eos, K.META_STOP: list(gen.stop)}
            await asyncio.sleep(0)
            return Completion(token_ids=engine.emit(list(prompt_ids), meta), log_probs=None)

    async def main():
        client = AsyncRetrievalClient(gen.search_url, topk=gen.topk, timeout=5, max_retries=0)
        try:
            prompts = [tool_prompt_ids(tok, k, config.schemas) for k in ("q1", "q2")]
            loop = AsyncAgentLoop(LLMGenerationManager(tok, None, gen), ScriptedAsyncEngine(), client,
                                  frozenset({eos}))
            return await loop.run(prompts, call_seed=0)
        finally:
            await client.aclose()

    rows, stats = asyncio.run(main())
    for i, row in enumerate(rows):
        assert row.response() == response_of(sync_out, i), f"row {i}"
    total = sum(stats, start=Counter())
    for key in ("tools/open/calls", "tools/open/errors", "tools/search/calls"):
        assert total[key] == sync_out.meta_info["tool_stats"][key], key
    assert total["tools/open/calls"] == 3 and total["tools/open/errors"] == 1


def test_shipped_two_tool_example_loads():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "example/tool_recipe/config/tool_config/search_open_tool_config.yaml"
    config = tools.load_tool_config(path)
    assert config.tool_names == ["search", "open"] and config.budgets == {"search": 8, "open": 8}
    assert config.search_settings().show_doc_ids and config.others[0]["config"]["fetcher"] == "direct"


def test_the_trainer_waits_for_the_retrieval_server_only_when_a_tool_uses_it(retrieval_url):
    from omegaconf import OmegaConf

    from verl.trainer.run_config import Protocol

    cfg = OmegaConf.create({"retriever": {"timeout": 7}})
    web = {"class_name": "search_r1.llm_agent.tool_backends.SerperSearchTool", "config": {}, "tool_schema": SEARCH_SCHEMA}
    only_web = Protocol(True, True, 10, "k", True, False, tools.parse_tool_config({"tools": [web]}), "web.yaml")
    assert not only_web.uses_retrieval_server()
    with pytest.raises(KeyError):
        only_web.retrieval_endpoint(cfg)
    opener = {"class_name": "search_r1.llm_agent.tool_backends.OpenTool",
              "config": {"retrieval_service_url": retrieval_url, "timeout": 3}, "tool_schema": OPEN_SCHEMA}
    with_open = Protocol(True, True, 10, "k", True, False, tools.parse_tool_config({"tools": [{
        **web, "tool_schema": {**SEARCH_SCHEMA, "function": {**SEARCH_SCHEMA["function"], "name": "web"}}}, opener]}),
        "two.yaml")
    assert with_open.uses_retrieval_server()
    assert with_open.retrieval_endpoint(cfg) == (retrieval_url, 3.0, "retrieval_service_url",
                                                 "retrieval_service_url in two.yaml")
    searching = Protocol(True, True, 10, "k", True, False, two_tools(retrieval_url), "s.yaml")
    assert searching.uses_retrieval_server() and searching.retrieval_endpoint(cfg)[:2] == (retrieval_url, 30.0)
