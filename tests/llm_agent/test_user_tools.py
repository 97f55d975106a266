"""A tool written against veRL's interface (verl.tools.base_tool.BaseTool, verl.tools.schemas) loads by its
tool config's class_name and answers through the rollout, sync and async, with veRL's lifetime
(create once per trajectory with its create_kwargs, execute per call, parallel calls of a turn at once,
calc_reward and release at the end); its exceptions are counted errors; the built-ins are BaseTools too."""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from search_r1.llm_agent import tools
from search_r1.llm_agent.generation import LLMGenerationManager
from tests.llm_agent.helpers import encode
from tests.llm_agent.test_tool_protocol import response_of, tool_batch, tool_gen_config, tool_prompt_ids
from verl.utils import batch_keys as K

# A tool file as a veRL user writes it: only veRL's import paths.
CAPITAL_TOOL = '''
import asyncio
from typing import Any, Optional
from uuid import uuid4

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from verl.utils.reward_score import search_r1_like_qa_em
from verl.utils.rollout_trace import rollout_trace_op

EVENTS = []


class CapitalTool(BaseTool):
    TABLE = {"France": "Paris", "Germany": "Berlin", "Italy": "Rome"}

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self._instance_dict = {}
        self._in_flight = 0
        self._two = asyncio.Event()

    async def create(self, instance_id: Optional[str] = None, ground_truth: Optional[str] = None, **kwargs):
        instance_id = instance_id or str(uuid4())
        self._instance_dict[instance_id] = {"ground_truth": ground_truth, "found": False}
        EVENTS.append(("create", instance_id, ground_truth))
        return instance_id, ToolResponse()

    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs):
        country = parameters["country"]
        if parameters.get("together"):     # two calls of one turn must be in flight at once
            self._in_flight += 1
            if self._in_flight == 2:
                self._two.set()
            await asyncio.wait_for(self._two.wait(), 20)
        if country == "Atlantis":
            return "not a tool response"
        answer = self.TABLE[country]
        state = self._instance_dict[instance_id]
        hit = search_r1_like_qa_em.em_check(answer, [state["ground_truth"] or ""])
        state["found"] = state["found"] or bool(hit)
        EVENTS.append(("execute", instance_id, country, kwargs.get("unit")))
        return ToolResponse(text=f"The capital of {country} is {answer}."), (0.5 if hit else -0.1), {"lookups": 1}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 1.0 if self._instance_dict[instance_id]["found"] else 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        EVENTS.append(("release", instance_id))
        del self._instance_dict[instance_id]
'''

SCHEMA = {"type": "function", "function": {
    "name": "capital", "description": "The capital of a country.",
    "parameters": {"type": "object", "properties": {"country": {"type": "string", "description": "A country"}},
                   "required": ["country"]}}}


def write_tool(folder: Path, url: str, class_name: str = "capital_tool.py:CapitalTool") -> Path:
    (folder / "capital_tool.py").write_text(CAPITAL_TOOL)
    config = {"tools": [
        {"class_name": "verl.tools.search_tool.SearchTool", "config": {"retrieval_service_url": url, "topk": 2},
         "tool_schema": {"type": "function", "function": {"name": "search", "description": "Search.", "parameters": {
             "type": "object", "properties": {"query_list": {"type": "array", "items": {"type": "string"}}},
             "required": ["query_list"]}}}},
        {"class_name": class_name, "config": {"type": "native", "max_calls_per_row": 4}, "tool_schema": SCHEMA},
    ]}
    path = folder / "tools.yaml"
    path.write_text(json.dumps(config))          # JSON is YAML
    return path


def call_text(*calls: tuple[str, dict]) -> str:
    return "".join("<tool_call>\n" + json.dumps({"name": n, "arguments": a}) + "\n</tool_call>" for n, a in calls)


def events_of(config: tools.ToolConfig) -> list:
    from verl.tools.utils.tool_registry import get_tool_class

    return sys.modules[get_tool_class(config.others[0]["class_name"]).__module__].EVENTS


def run_sync(tok, config, scripts, keys, infos, **overrides):
    from scripts.bench.rollout import ScriptedRollout

    engine = ScriptedRollout(tok, scripts)
    gen = tool_gen_config(config, max_parallel_calls=2, max_tool_response_length=None, **overrides)
    gen_batch, prompts = tool_batch(tok, keys, config.schemas)
    gen_batch.non_tensor_batch[K.EXTRA_INFO] = np.array(infos, dtype=object)
    return LLMGenerationManager(tok, engine, gen).run_llm_loop(gen_batch, prompts), gen, engine


def tool_messages(tok, out, row: int) -> list[str]:
    ids, loss = response_of(out, row)
    text = tok.decode([t for t, m in zip(ids, loss, strict=True) if m == 0])
    return [part.split("\n</tool_response>")[0] for part in text.split("<tool_response>\n")[1:]]


INFOS = [{"tools_kwargs": {"capital": {"create_kwargs": {"ground_truth": "Paris"},
                                       "execute_kwargs": {"unit": "city"}}}},
         {"tools_kwargs": {"capital": {"create_kwargs": {"ground_truth": "Rome"}}}}]


def scripts_for(tok):
    eos = tok.eos_token_id
    answer = encode(tok, "<answer> Paris </answer>") + [eos]
    both = encode(tok, call_text(("capital", {"country": "France", "together": True}),
                                 ("capital", {"country": "Germany", "together": True})))
    return {"q1": [both, answer], "q2": [encode(tok, call_text(("capital", {"country": "Germany"}))), answer]}


def test_a_verl_tool_file_answers_through_the_sync_rollout_with_verls_lifetime(tool_tokenizer, retrieval_url,
                                                                               tmp_path):
    tok = tool_tokenizer
    config = tools.load_tool_config(write_tool(tmp_path, retrieval_url))
    assert config.tool_names == ["search", "capital"] and config.budgets == {"capital": 4}
    assert config.others[0]["class_name"] == f"{(tmp_path / 'capital_tool.py').resolve()}:CapitalTool"
    events = events_of(config)
    events.clear()
    out, _, _ = run_sync(tok, config, scripts_for(tok), ["q1", "q2"], INFOS)
    assert tool_messages(tok, out, 0) == ["The capital of France is Paris.", "The capital of Germany is Berlin."]
    assert tool_messages(tok, out, 1) == ["The capital of Germany is Berlin."]
    # once per trajectory: create (with its create_kwargs), the calls (with execute_kwargs), release at the end
    creates = [e for e in events if e[0] == "create"]
    assert sorted(e[2] for e in creates) == ["Paris", "Rome"]
    first = next(e[1] for e in creates if e[2] == "Paris")
    assert [e[2:] for e in events if e[0] == "execute" and e[1] == first] == [("France", "city"), ("Germany", "city")]
    assert sorted(e[1] for e in events if e[0] == "release") == sorted(e[1] for e in creates)
    stats = out.meta_info["tool_stats"]
    assert stats["tools/capital/calls"] == 3 and stats["tools/capital/errors"] == 0
    assert stats["tools/capital/lookups"] == 3
    # step rewards 0.5 - 0.1 (row 1), -0.1 (row 2); calc_reward 1 (row 1 found Paris), 0: per row, (1.4 - 0.1) / 2
    assert stats["tools/capital/reward"] == pytest.approx(0.65)


def test_the_same_tool_answers_the_same_in_async_mode(tool_tokenizer, retrieval_url, tmp_path):
    from search_r1.llm_agent.async_generation import AsyncAgentLoop
    from verl.workers.rollout.async_engine import Completion

    tok = tool_tokenizer
    config = tools.load_tool_config(write_tool(tmp_path, retrieval_url))
    scripts = scripts_for(tok)
    sync_out, gen, engine = run_sync(tok, config, scripts, ["q1", "q2"], INFOS)

    class ScriptedAsyncEngine:
        async def generate(self, prompt_ids, seed, max_tokens=None, follows=None):
            meta = {K.META_RESPONSE_LENGTH: max_tokens, K.META_EOS_TOKEN_ID: tok.eos_token_id, K.META_STOP: list(gen.stop)}
            await asyncio.sleep(0)
            return Completion(token_ids=engine.emit(list(prompt_ids), meta), log_probs=None)

    prompts = [tool_prompt_ids(tok, k, config.schemas) for k in ("q1", "q2")]
    loop = AsyncAgentLoop(LLMGenerationManager(tok, None, gen), ScriptedAsyncEngine(), None,
                          frozenset({tok.eos_token_id}))
    rows, stats = asyncio.run(loop.run(prompts, 0, [{K.EXTRA_INFO: info} for info in INFOS]))
    for i, row in enumerate(rows):
        assert row.response() == response_of(sync_out, i), f"row {i}"
    assert rows[0].tool_rewards == [0.5, -0.1] and rows[0].reward_scores == {"capital": 1.0}
    assert rows[1].tool_rewards == [-0.1] and rows[1].reward_scores == {"capital": 0.0}
    assert rows[0].tool_instances == {}          # released
    assert sum(stats, start=Counter())["tools/capital/calls"] == 3


def test_a_tools_exception_is_that_calls_counted_error(tool_tokenizer, retrieval_url, tmp_path):
    tok = tool_tokenizer
    config = tools.load_tool_config(write_tool(tmp_path, retrieval_url))
    answer = encode(tok, "<answer> Paris </answer>") + [tok.eos_token_id]
    bad = encode(tok, call_text(("capital", {"country": "Mars"}), ("capital", {"country": "Atlantis"})))
    good = encode(tok, call_text(("capital", {"country": "Italy"})))
    out, _, _ = run_sync(tok, config, {"q1": [bad, answer], "q2": [good, answer]}, ["q1", "q2"], INFOS)
    assert tool_messages(tok, out, 0) == ['{"result": "Error: tool \'capital\' failed (KeyError)"}',
                                          '{"result": "Error: tool \'capital\' failed (TypeError)"}']
    assert tool_messages(tok, out, 1) == ["The capital of Italy is Rome."]
    assert out.meta_info["tool_stats"]["tools/capital/errors"] == 2
    assert out.meta_info["stop_reasons"]["answered"] == 2 and out.meta_info["row_errors"] == 0


def test_class_name_forms_and_what_is_refused(tmp_path, monkeypatch, retrieval_url):
    # a module on the path
    (tmp_path / "mytools").mkdir()
    (tmp_path / "mytools" / "__init__.py").write_text("")
    (tmp_path / "mytools" / "capital.py").write_text(CAPITAL_TOOL + textwrap.dedent('''
        class NotATool:
            pass

        class OwnSchema(CapitalTool):
            def get_openai_tool_schema(self):
                return OpenAIFunctionToolSchema.model_validate(
                    {"type": "function", "function": {"name": "own", "description": "Mine."}})
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    entry = {"class_name": "mytools.capital.CapitalTool", "config": {}, "tool_schema": SCHEMA}
    config = tools.parse_tool_config({"tools": [entry]}, source="t.yaml")
    assert config.others == [{"name": "capital", "class_name": "mytools.capital.CapitalTool", "config": {}}]
    own = tools.parse_tool_config({"tools": [{"class_name": "mytools.capital.OwnSchema", "config": {}}]})
    assert own.tool_names == ["own"] and own.schemas[0]["function"]["description"] == "Mine."
    # an absolute file
    (tmp_path / "loose.py").write_text(CAPITAL_TOOL)
    loose = tools.parse_tool_config({"tools": [{**entry, "class_name": f"{tmp_path / 'loose.py'}:CapitalTool"}]})
    assert loose.others[0]["class_name"] == f"{(tmp_path / 'loose.py').resolve()}:CapitalTool"
    for class_name, expected in (
            ("mytools.capital.NotATool", "is not a tool this project can load: not a verl.tools.base_tool.BaseTool"),
            ("mytools.capital.Missing", "mytools.capital defines no class 'Missing'"),
            ("nowhere.Tool", "cannot import 'nowhere.Tool' (ModuleNotFoundError"),
            (f"{tmp_path / 'absent.py'}:Tool", "no file"),
    ):
        with pytest.raises(ValueError, match="t.yaml: tools\\[0\\].class_name: ") as err:
            tools.parse_tool_config({"tools": [{**entry, "class_name": class_name}]}, source="t.yaml")
        assert expected in str(err.value)
    with pytest.raises(ValueError, match=r"tools\[0\].config.type: only 'native'"):
        tools.parse_tool_config({"tools": [{**entry, "config": {"type": "mcp"}}]})
    with pytest.raises(ValueError, match=r"tools\[0\].tool_schema: required \(mytools.capital.CapitalTool gives no"):
        tools.parse_tool_config({"tools": [{"class_name": "mytools.capital.CapitalTool", "config": {}}]})


def test_the_built_in_tools_are_base_tools_and_execute_answers_as_call(retrieval_url, tmp_path):
    from search_r1.llm_agent.mcp_tools import MCPTool
    from search_r1.llm_agent.tool_backends import OpenTool, SerperSearchTool, TavilySearchTool
    from search_r1.search.client import RetrievalClient
    from verl.tools.base_tool import BaseTool
    from verl.tools.search_tool import SearchTool
    from verl.tools.utils.tool_registry import initialize_tools_from_config
    from verl.utils.rollout_trace import rollout_trace_attr

    for cls in (SearchTool, OpenTool, SerperSearchTool, TavilySearchTool, MCPTool):
        assert issubclass(cls, BaseTool), cls
    path = write_tool(tmp_path, retrieval_url)
    built = initialize_tools_from_config(path)
    assert [type(t).__name__ for t in built] == ["SearchTool", "CapitalTool"]
    search = built[0]
    with rollout_trace_attr(step=3, sample_index=1) as spans:
        response, reward, metrics = asyncio.run(search.execute("i", {"query_list": ["Berlin", "Paris"]}))
    hits = RetrievalClient(retrieval_url, topk=2).retrieve(["Berlin", "Paris"], topk=2, return_scores=True)
    assert response.text == tools.render_search_results(hits) and (reward, metrics) == (0.0, {})
    assert [(s["name"], s["step"], s["error"]) for s in spans] == [("SearchTool.execute", 3, None)]
    assert asyncio.run(search.execute("i", {"query_list": []}))[0].text == tools.render_bad_query_list()
    opener = OpenTool("open", {"retrieval_service_url": retrieval_url, "page_size": 150})
    assert asyncio.run(opener.execute("i", {"doc_id": "1", "page": 2}))[0].text == \
        opener.call({"doc_id": "1", "page": 2})
