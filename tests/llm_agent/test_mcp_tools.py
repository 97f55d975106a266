"""MCP tools in the rollout: the project's MCP server (search_r1/search/mcp_server.py, in front of
the real BM25 retrieval server) started for real over stdio and over streamable HTTP, its tools
listed into the tool config and called from the sync and async rollouts."""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from search_r1.llm_agent import mcp_tools, tool_backends, tools
from search_r1.llm_agent.generation import LLMGenerationManager
from search_r1.search.client import RetrievalClient
from tests.conftest import free_port
from tests.llm_agent.helpers import encode
from tests.llm_agent.test_multi_tools import call_text, observations
from tests.llm_agent.test_tool_protocol import response_of, run_tool, tool_gen_config, tool_prompt_ids
from verl.utils import batch_keys as K

MCP_CLASS = "search_r1.llm_agent.mcp_tools.MCPTool"
SERVER = Path(__file__).resolve().parents[2] / "search_r1" / "search" / "mcp_server.py"


@pytest.fixture(scope="module")
def mcp_http_url(retrieval_url) -> Iterator[str]:
    from search_r1.search.mcp_server import build_server
    from search_r1.search.serving import serve_in_background

    app = build_server(retrieval_url, page_size=150).streamable_http_app()
    with serve_in_background(app) as base:
        yield f"{base}/mcp"


def mcp_config(transport: str, retrieval_url: str, http_url: str | None, **extra) -> dict:
    if transport == "stdio":
        config = {"transport": "stdio", "command": [sys.executable, str(SERVER), "--retrieval_url", retrieval_url,
                                                     "--page_size", "150"]}
    else:
        config = {"transport": "http", "url": http_url}
    return {**config, "timeout": 20, **extra}


@pytest.mark.parametrize("transport", ["http", "stdio"])
def test_mcp_search_and_open_through_the_rollout_sync_and_async(transport, tool_tokenizer, retrieval_url,
                                                                mcp_http_url):
    from search_r1.llm_agent.async_generation import AsyncAgentLoop
    from verl.workers.rollout.async_engine import Completion

    tok = tool_tokenizer
    eos = tok.eos_token_id
    mcp = mcp_config(transport, retrieval_url, mcp_http_url, tools=["search", "open"], max_calls_per_row=2)
    config = tools.parse_tool_config({"tools": [{"class_name": MCP_CLASS, "config": mcp}]}, source="mcp.yaml")
    assert config.tool_names == ["search", "open"] and config.search_name is None
    assert config.budgets == {"search": 2, "open": 2}
    assert config.schemas[1]["function"]["parameters"]["required"] == ["doc_id"]
    prompt = tok.decode(tool_prompt_ids(tok, "q1", config.schemas))
    assert '"name": "open"' in prompt and "doc_id" in prompt     # the listed schemas reach the template

    search = encode(tok, call_text("search", {"query_list": ["Eiffel Tower"]}))
    open_ = encode(tok, call_text("open", {"doc_id": "1", "page": 2}))
    missing = encode(tok, call_text("open", {"doc_id": "nope"}))
    answer = encode(tok, "<answer> 1889 </answer>") + [eos]
    scripts = {"q1": [search, open_, answer], "q2": [missing, open_, open_, answer]}
    gen = tool_gen_config(config, max_tool_response_length=None, max_obs_length=900, max_response_length=2000,
                          max_total_response_length=2000, max_prompt_length=4000, max_assistant_turns=5)
    assert gen.search_url is None      # no native search tool: nothing goes to /retrieve from the rollout
    out, engine = run_tool(tok, scripts, ["q1", "q2"], gen)

    found, opened = observations(tok, out, 0)
    hits = RetrievalClient(retrieval_url, topk=3).retrieve(["Eiffel Tower"])
    assert found == tools.render_search_results(hits, show_doc_ids=True)
    direct = tool_backends.OpenTool("open", {"retrieval_service_url": retrieval_url, "page_size": 150})
    assert opened == direct.call({"doc_id": "1", "page": 2})
    error, opened_again, over_budget = observations(tok, out, 1)
    assert json.loads(error)["result"] == "Error: Error executing tool open: no document with id 'nope'"
    assert opened_again == opened
    assert "may be called at most 2 times per trajectory" in over_budget
    stats = out.meta_info["tool_stats"]
    assert (stats["tools/search/calls"], stats["tools/open/calls"], stats["tools/open/errors"]) == (1, 4, 2)
    assert stats["tools/open/latency_ms"] > 0 and out.meta_info["stop_reasons"]["answered"] == 2

    class ScriptedAsyncEngine:
        async def generate(self, prompt_ids, seed, max_tokens=None, follows=None):
            meta = {K.META_RESPONSE_LENGTH: max_tokens, K.META_EOS_TOKEN_ID: eos, K.META_STOP: list(gen.stop)}
            await asyncio.sleep(0)
            return Completion(token_ids=engine.emit(list(prompt_ids), meta), log_probs=None)

    async def main():
        prompts = [tool_prompt_ids(tok, k, config.schemas) for k in ("q1", "q2")]
        loop = AsyncAgentLoop(LLMGenerationManager(tok, None, gen), ScriptedAsyncEngine(), None, frozenset({eos}))
        return await loop.run(prompts, call_seed=0)

    rows, per_row = asyncio.run(main())
    for i, row in enumerate(rows):
        assert row.response() == response_of(out, i), f"row {i}"
    total = sum(per_row, start=Counter())
    assert {k: total[k] for k in stats if not k.endswith("latency_ms")} == \
        {k: v for k, v in stats.items() if not k.endswith("latency_ms")}


def test_mcp_config_errors_name_the_entry_and_key(retrieval_url, mcp_http_url):
    entry = {"class_name": MCP_CLASS, "config": {"transport": "http", "url": mcp_http_url, "tools": ["browse"]}}
    with pytest.raises(ValueError, match=r"m\.yaml: tools\[0\]\.config\.tools: the MCP server has no tools "
                                         r"\['browse'\]; it has \['search', 'open'\]"):
        tools.parse_tool_config({"tools": [entry]}, source="m.yaml")
    entry["config"] = {"transport": "pipe"}
    with pytest.raises(ValueError, match=r"tools\[0\]\.config\.transport: one of \['stdio', 'http'\]"):
        tools.parse_tool_config({"tools": [entry]}, source="m.yaml")
    entry["config"] = {"transport": "stdio", "command": "python server.py"}
    with pytest.raises(ValueError, match=r"tools\[0\]\.config\.command: a list of strings"):
        tools.parse_tool_config({"tools": [entry]}, source="m.yaml")
    entry["config"] = {"transport": "http", "url": f"http://127.0.0.1:{free_port()}/mcp", "timeout": 5}
    with pytest.raises(ValueError, match=r"tools\[0\]: could not connect to the MCP server"):
        tools.parse_tool_config({"tools": [entry]}, source="m.yaml")


def test_an_unreachable_mcp_server_answers_calls_with_an_error():
    dead = mcp_tools.MCPTool("search", {"transport": "http", "url": f"http://127.0.0.1:{free_port()}/mcp"})
    text, ok = tool_backends.run_call(dead, {"query_list": ["q"]})
    assert not ok and json.loads(text)["result"].startswith("Error: could not connect to the MCP server")


def test_shipped_web_and_mcp_example_loads_with_the_servers_tools(monkeypatch):
    import yaml

    repo = Path(__file__).resolve().parents[2]
    data = yaml.safe_load((repo / "example/tool_recipe/config/tool_config/web_mcp_tool_config.yaml").read_text())
    data["tools"][1]["config"]["command"][0] = sys.executable     # `python` of the example: this interpreter
    data["tools"][1]["config"]["cwd"] = str(repo)
    config = tools.parse_tool_config(data, source="web_mcp_tool_config.yaml")
    assert config.tool_names == ["web_search", "search", "open"] and config.search_name is None
    assert config.budgets == {"web_search": 4, "search": 8, "open": 8}


def test_a_call_past_its_timeout_is_an_error_and_the_connection_stays_usable(mcp_http_url, retrieval_url):
    config = {"transport": "http", "url": mcp_http_url, "timeout": 0.001}
    text, ok = tool_backends.run_call(mcp_tools.MCPTool("open", config), {"doc_id": "1"})
    assert not ok and json.loads(text)["result"] == "Error: tool 'open' did not answer within 0.001 s"
    text, ok = tool_backends.run_call(mcp_tools.MCPTool("open", {**config, "timeout": 20}), {"doc_id": "1"})
    assert ok and json.loads(text)["result"].startswith("Eiffel Tower\n[doc 1, page 1 of 4")
