"""The tool protocol (veRL upstream's Search-R1 recipe): its text rules, and the generation manager
running it against a scripted engine and a real BM25 server over HTTP."""

from __future__ import annotations

import json

import pytest
import requests
import torch

from scripts.bench.rollout import ScriptedRollout
from search_r1.llm_agent import actions, tools
from search_r1.llm_agent.generation import GenerationConfig, LLMGenerationManager
from search_r1.search.client import RetrievalClient
from search_r1.search.schema import Hit
from tests.conftest import free_port
from tests.llm_agent.helpers import encode, with_template
from verl.protocol import DataProto
from verl.utils import batch_keys as K

# veRL's examples/sglang_multiturn/config/tool_config/search_tool_config.yaml, as its users have it.
RECIPE_TOOL_CONFIG = """\
tools:
  - class_name: verl.tools.search_tool.SearchTool
    config:
      retrieval_service_url: {url}
      num_workers: 120
      rate_limit: 120
      timeout: 30
      type: native
    tool_schema:
      type: function
      function:
        name: search
        description: Searches the web for relevant information based on the given query.
        parameters:
          type: object
          properties:
            query_list:
              type: array
              item:
                type: string
              description: A list of fully-formed semantic queries. The tool will return search results for each query.
          required:
            - query_list
"""


def verl_search_tool_text(api_response: dict) -> str:
    """veRL SearchTool's answer for a successful /retrieve response, re-derived here from its
    documented behaviour (verl/tools/utils/search_r1_like_utils.py) as an independent oracle:
    per query, `Doc {i} (Title: {first line})\\n{other lines}\\n\\n` per hit, stripped; queries
    joined by `\\n---\\n`; JSON {"result": ...} without ASCII escaping."""
    per_query = []
    for hits in api_response["result"]:
        text = ""
        for i, hit in enumerate(hits):
            lines = hit["document"]["contents"].split("\n")
            text += "Doc " + str(i + 1) + " (Title: " + lines[0] + ")\n" + "\n".join(lines[1:]) + "\n\n"
        per_query.append(text.strip())
    return json.dumps({"result": "\n---\n".join(per_query)}, ensure_ascii=False)


@pytest.fixture
def tool_config(tmp_path, retrieval_url) -> tools.ToolConfig:
    path = tmp_path / "search_tool_config.yaml"
    path.write_text(RECIPE_TOOL_CONFIG.format(url=retrieval_url))
    return tools.load_tool_config(path)


# --- text rules -----------------------------------------------------------------------------


def test_recipe_tool_config_loads_with_verl_defaults(tool_config, retrieval_url):
    assert tool_config.tool_names == ["search"]
    settings = tool_config.search_settings()
    assert settings.retrieval_service_url == retrieval_url
    assert (settings.topk, settings.timeout, settings.num_workers, settings.rate_limit) == (3, 30, 120, 120)
    # The schema goes to the chat template exactly as written (veRL's `item:` spelling included).
    assert tool_config.schemas[0]["function"]["parameters"]["properties"]["query_list"]["item"] == {"type": "string"}
    assert tools.ToolConfig.from_dict(tool_config.to_dict()) == tool_config


@pytest.mark.parametrize("edit, names", [
    (lambda t: t.replace("verl.tools.search_tool.SearchTool", "verl.tools.gsm8k_tool.Gsm8kTool"), "class_name"),
    (lambda t: t.replace("      retrieval_service_url: {url}\n", ""), "retrieval_service_url"),
    (lambda t: t.replace("      timeout: 30", "      timeout: 30\n      timout: 5"), "timout"),
    (lambda t: t.replace("      type: native", "      type: mcp"), "config.type"),
    (lambda t: t.replace("tools:", "tool:"), "'tools:'"),
])
def test_bad_tool_config_names_the_file_and_key(tmp_path, edit, names):
    path = tmp_path / "tools.yaml"
    path.write_text(edit(RECIPE_TOOL_CONFIG).format(url="http://127.0.0.1:1/retrieve"))
    with pytest.raises(ValueError) as err:
        tools.load_tool_config(path)
    assert str(path) in str(err.value) and names in str(err.value)


def test_missing_tool_config_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="tool_config_path: no file"):
        tools.load_tool_config(tmp_path / "nope.yaml")


def test_tool_calls_are_parsed_and_malformed_ones_become_errors():
    text = ('<think> two </think>\n<tool_call>\n{"name": "search", "arguments": {"query_list": ["a", "b"]}}\n'
            '</tool_call>\n<tool_call>{"name": "search", "arguments": "{\\"query_list\\": [\\"c\\"]}"}</tool_call>'
            '<tool_call>{"name": "search", "arguments": {"query_list": ["x"]</tool_call>'
            '<tool_call>{"name": "browse", "arguments": {}}</tool_call>'
            '<tool_call>["search"]</tool_call>'
            '<tool_call>{"name": "search", "arguments": [1]}</tool_call>'
            '<tool_call>{"name": "search", "arguments": {"query_list": ["never closed"]}}')
    calls = tools.parse_tool_calls(text, ["search"])
    assert calls[0] == tools.ToolCall("search", {"query_list": ["a", "b"]})
    assert calls[1] == tools.ToolCall("search", {"query_list": ["c"]})     # arguments as a JSON string
    assert [type(c) for c in calls[2:]] == [tools.ToolCallError] * 4   # the unclosed call is no call
    assert "not valid JSON" in calls[2].message
    assert "unknown tool 'browse'" in calls[3].message and "['search']" in calls[3].message
    assert '"name"' in calls[4].message and "must be a JSON object" in calls[5].message
    assert tools.parse_tool_calls("<answer> Paris </answer>", ["search"]) == []


@pytest.mark.parametrize("arguments, queries", [
    ({"query_list": ["a ", " b"]}, ["a", "b"]), ({"query_list": []}, None), ({"query_list": "a"}, None),
    ({"query_list": ["a", ""]}, None), ({"query_list": ["a", 3]}, None), ({}, None),
])
def test_search_arguments_must_be_a_list_of_queries(arguments, queries):
    assert tools.search_queries(tools.ToolCall("search", arguments)) == queries


def test_search_text_equals_verl_search_tool_for_the_same_hits(retrieval_url):
    """The same server answer, through veRL's formatting and through ours (with our client)."""
    queries = ["capital of France", "Eiffel Tower", "río Spree ünïcode"]
    raw = requests.post(retrieval_url, json={"queries": queries, "topk": 2, "return_scores": True}, timeout=10).json()
    hits = RetrievalClient(retrieval_url, topk=2).retrieve(queries)
    ours = tools.render_search_results(hits)
    assert ours == verl_search_tool_text(raw)
    assert json.loads(ours)["result"].startswith('Doc 1 (Title: "Paris")\nParis is the capital')
    # Edge cases no corpus line reaches: no newline in contents, non-ASCII kept, an empty hit list.
    odd = [[Hit.from_contents("7", "Zürich only a title", 1.0)], []]
    raw_odd = {"result": [[{"document": {"id": "7", "contents": "Zürich only a title"}, "score": 1.0}], []]}
    assert tools.render_search_results(odd) == verl_search_tool_text(raw_odd)
    assert tools.render_search_results([]) == json.dumps({"result": "No search results found."})


@pytest.mark.parametrize("side, expected", [
    ("left", "abcd...(truncated)"), ("right", "(truncated)...wxyz"), ("middle", "ab...(truncated)...yz"),
])
def test_tool_response_truncation_follows_verl(side, expected):
    text = "abcdefghijklmnopqrstuvwxyz"
    assert tools.truncate_tool_response(text, 4, side) == (expected, True)
    assert tools.truncate_tool_response(text, 26, side) == (text, False)


def test_chat_framing_is_what_the_template_renders_for_the_whole_conversation(tool_tokenizer, tool_config):
    framing = tools.ChatFraming(tool_tokenizer, tool_config.schemas)
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    prompt = tool_tokenizer.apply_chat_template(msgs, tools=tool_config.schemas, tokenize=False,
                                                add_generation_prompt=True)
    turn = '<tool_call>\n{"name": "search", "arguments": {"query_list": ["q"]}}\n</tool_call>'
    whole = tool_tokenizer.apply_chat_template(
        msgs + [{"role": "assistant", "content": turn}, {"role": "tool", "content": "R"}],
        tools=tool_config.schemas, tokenize=False, add_generation_prompt=True)
    assert prompt + turn + framing.observation(["R"], ended_with_eos=False) == whole
    assert prompt + turn + "<|im_end|>" + framing.observation(["R"], ended_with_eos=True) == whole
    assert "search" in prompt and "query_list" in prompt    # the schema reached the model


def test_a_template_without_tool_messages_is_refused(tokenizer):
    with pytest.raises(ValueError, match="does not render 'tool' messages"):
        tools.ChatFraming(with_template(tokenizer, "{% for m in messages %}{% if m['role'] != 'tool' %}"
                                         "{{ m['content'] }}{% endif %}{% endfor %}"))




# --- the manager in the tool protocol ------------------------------------------------------------


SYSTEM = "You are a helpful and harmless assistant."


def tool_prompt_ids(tok, key: str, schemas) -> list[int]:
    text = tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                    {"role": "user", "content": f"Answer. Question: {key}?"}],
                                   tools=schemas, tokenize=False, add_generation_prompt=True)
    return encode(tok, text)


def tool_batch(tok, keys, schemas, **meta):
    from search_r1.llm_agent.tensor_helper import left_pad, position_ids_from_mask

    ids, mask = left_pad([tool_prompt_ids(tok, k, schemas) for k in keys], tok.pad_token_id)
    return DataProto.from_dict(tensors={K.INPUT_IDS: ids, K.ATTENTION_MASK: mask,
                                        K.POSITION_IDS: position_ids_from_mask(mask)}, meta_info=dict(meta)), ids


def tool_gen_config(tools_: tools.ToolConfig, **overrides) -> GenerationConfig:
    fields = dict(max_turns=2, max_start_length=1024, max_prompt_length=2048, max_response_length=400,
                  max_total_response_length=400, max_obs_length=300, protocol="tool",
                  tool_config=tools_.to_dict(), max_assistant_turns=3, retrieval_max_retries=0)
    fields.update(overrides)
    return GenerationConfig(**fields)


def call(queries) -> str:
    return ('<think> look it up </think>\n<tool_call>\n'
            + json.dumps({"name": "search", "arguments": {"query_list": queries}}) + '\n</tool_call>')


def expected_observation(tok, framing, texts, ended_with_eos=False) -> list[int]:
    """The observation as the manager builds it when it fits: the whole text tokenized once."""
    return encode(tok, framing.observation(texts, ended_with_eos))


def response_of(out, row: int) -> tuple[list[int], list[int]]:
    n = int(out.batch[K.ATTENTION_MASK][row, out.batch[K.PROMPTS].shape[1]:].sum())
    return out.batch[K.RESPONSES][row, :n].tolist(), out.batch[K.LOSS_MASK][row, :n].tolist()


def run_tool(tok, scripts, keys, config, **meta):
    engine = ScriptedRollout(tok, scripts)
    schemas = tools.ToolConfig.from_dict(config.tool_config).schemas
    gen_batch, prompts = tool_batch(tok, keys, schemas, **meta)
    out = LLMGenerationManager(tok, engine, config).run_llm_loop(gen_batch, prompts)
    return out, engine


def test_tool_rollout_keeps_sampled_ids_and_masks_tool_messages(tool_tokenizer, tool_config, retrieval_url):
    tok = tool_tokenizer
    eos = tok.eos_token_id
    ramble = encode(tok, "<|im_end|>\n<|im_start|>user\n<tool_response>\nmade up\n</tool_response>")
    search = encode(tok, call(["capital of France", "Eiffel Tower"]))
    answer = encode(tok, "<think> found </think>\n<answer> Paris </answer>") + [eos]
    malformed = encode(tok, '<tool_call>{"name": "search", "arguments": {"query_list": ["x"]</tool_call>')
    scripts = {"q1": [search + ramble, answer + ramble], "q2": [malformed, answer], "q3": [answer]}
    config = tool_gen_config(tool_config)
    out, engine = run_tool(tok, scripts, ["q1", "q2", "q3"], config, do_sample=True)

    framing = tools.ChatFraming(tok, tool_config.schemas)
    hits = RetrievalClient(retrieval_url, topk=3).retrieve(["capital of France", "Eiffel Tower"])
    found = tools.truncate_tool_response(tools.render_search_results(hits), 256, "middle")[0]
    error = tools.parse_tool_calls(tok.decode(malformed), ["search"])[0]
    expected = {
        0: [(search, 1), (expected_observation(tok, framing, [found]), 0), (answer, 1)],
        1: [(malformed, 1), (expected_observation(tok, framing, [tools.render_call_error(error)]), 0), (answer, 1)],
        2: [(answer, 1)],
    }
    for row, segments in expected.items():
        ids, loss = response_of(out, row)
        assert ids == [t for seg, _ in segments for t in seg], f"row {row}"
        assert loss == [m for seg, m in segments for _ in seg], f"row {row}"
    meta = out.meta_info
    assert meta["stop_reasons"]["answered"] == 3 and meta["turns_stats"] == [2, 2, 1]
    assert meta["tool_calls"] == 2 and meta["tool_call_errors"] == 1 and meta["valid_search_stats"] == [1, 0, 0]
    assert meta["tool_response_truncated"] == 1      # veRL's 256-character default cut the two queries' passages
    assert meta["generated_tokens"] == meta["kept_tokens"]   # the engine stopped at </tool_call>
    first = engine.calls[0]["meta_info"]
    assert first[K.META_STOP] == ["</tool_call>"] and first[K.META_RESPONSE_LENGTH] == 400
    # Each row's context for its next turn is its prompt and its own response ids, nothing re-encoded.
    second_contexts = engine.calls[1]["contexts"]
    prompt0 = tool_prompt_ids(tok, "q1", tool_config.schemas)
    assert second_contexts[0] == prompt0 + response_of(out, 0)[0][: -len(answer)]


def test_calls_past_max_assistant_turns_are_not_run(tool_tokenizer, tool_config):
    tok = tool_tokenizer
    search = encode(tok, call(["capital of France"]))
    config = tool_gen_config(tool_config, max_assistant_turns=2)
    out, engine = run_tool(tok, {"q1": [search, search, search]}, ["q1"], config)
    ids, loss = response_of(out, 0)
    assert out.meta_info["stop_reasons"]["max_turns"] == 1 and out.meta_info["turns_stats"] == [2]
    assert ids[-len(search):] == search and loss[-len(search):] == [1] * len(search)   # no tool message after it
    assert out.meta_info["valid_search_stats"] == [1] and len(engine.calls) == 2


def test_max_user_turns_bounds_tool_rounds(tool_tokenizer, tool_config):
    tok = tool_tokenizer
    search = encode(tok, call(["capital of France"]))
    config = tool_gen_config(tool_config, max_assistant_turns=None, max_user_turns=1)
    out, _ = run_tool(tok, {"q1": [search, search, search]}, ["q1"], config)
    assert out.meta_info["turns_stats"] == [2] and out.meta_info["stop_reasons"]["max_turns"] == 1


def test_response_budget_covers_all_turns_and_tool_messages(tool_tokenizer, tool_config):
    tok = tool_tokenizer
    search = encode(tok, call(["capital of France"]))
    budget = len(search) + 20     # the tool message does not fit after the call
    config = tool_gen_config(tool_config, max_response_length=budget, max_total_response_length=budget)
    out, _ = run_tool(tok, {"q1": [search, search]}, ["q1"], config)
    ids, _ = response_of(out, 0)
    assert ids == search and out.meta_info["stop_reasons"]["context_full"] == 1
    # A turn longer than what is left is cut by position at the budget.
    long_turn = encode(tok, "<think> " + "very " * 200 + "</think>")
    config = tool_gen_config(tool_config, max_response_length=30, max_total_response_length=30)
    out, _ = run_tool(tok, {"q1": [long_turn]}, ["q1"], config)
    assert response_of(out, 0)[0] == long_turn[:30] and out.meta_info["stop_reasons"]["context_full"] == 1


def test_parallel_calls_run_to_eos_and_each_gets_a_tool_message(tool_tokenizer, tool_config, retrieval_url):
    tok = tool_tokenizer
    eos = tok.eos_token_id
    two = encode(tok, call(["capital of France"]) + "\n" + call(["Eiffel Tower"])) + [eos]
    answer = encode(tok, "<answer> Paris </answer>") + [eos]
    config = tool_gen_config(tool_config, max_parallel_calls=2, max_tool_response_length=None, max_obs_length=2000,
                             max_response_length=4000, max_total_response_length=4000, max_prompt_length=8000)
    out, engine = run_tool(tok, {"q1": [two, answer]}, ["q1"], config)
    assert engine.calls[0]["meta_info"][K.META_STOP] == []
    framing = tools.ChatFraming(tok, tool_config.schemas)
    client = RetrievalClient(retrieval_url, topk=3)
    texts = [tools.render_search_results(client.retrieve([q])) for q in ("capital of France", "Eiffel Tower")]
    ids, loss = response_of(out, 0)
    # The model wrote EOS itself, so the template's end-of-turn token is not added a second time.
    obs = expected_observation(tok, framing, texts, ended_with_eos=True)
    assert ids == two + obs + answer and loss == [1] * len(two) + [0] * len(obs) + [1] * len(answer)
    assert out.meta_info["valid_search_stats"] == [2]


def test_failed_retrieval_becomes_a_search_error_tool_message(tool_tokenizer, tool_config):
    tok = tool_tokenizer
    dead = tools.ToolConfig.from_dict({**tool_config.to_dict(), "search": {
        **tool_config.search, "retrieval_service_url": f"http://127.0.0.1:{free_port()}/retrieve", "timeout": 2}})
    search = encode(tok, call(["capital of France", "Eiffel Tower"]))
    answer = encode(tok, "<answer> Paris </answer>") + [tok.eos_token_id]
    out, _ = run_tool(tok, {"q1": [search, answer]}, ["q1"], tool_gen_config(dead))
    ids, loss = response_of(out, 0)
    observation = tok.decode([t for t, m in zip(ids, loss, strict=True) if m == 0])
    assert '{"result": "Search error: ' in observation
    assert out.meta_info["stop_reasons"]["answered"] == 1
    # One failed call (of two queries) is one failed search of one: the failure fraction is per search.
    assert out.meta_info["search_failures"] == 1 and out.meta_info["valid_search_stats"] == [1]
    from verl.trainer.ppo.metric_utils import compute_env_metrics

    assert compute_env_metrics(out.meta_info)["env/search_failure_fraction"] == 1.0


def test_tool_observation_is_shortened_to_max_obs_length_keeping_the_framing(tool_tokenizer, tool_config):
    tok = tool_tokenizer
    search = encode(tok, call(["capital of France"]))
    answer = encode(tok, "<answer> Paris </answer>") + [tok.eos_token_id]
    config = tool_gen_config(tool_config, max_obs_length=60, max_tool_response_length=None)
    out, _ = run_tool(tok, {"q1": [search, answer]}, ["q1"], config)
    ids, loss = response_of(out, 0)
    obs = [t for t, m in zip(ids, loss, strict=True) if m == 0]
    assert len(obs) == 60 and out.meta_info["obs_truncated"] == 1
    assert tok.decode(obs).endswith("\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_tool_config_settings_win_over_retriever_keys(tool_config, retrieval_url):
    config = tool_gen_config(tool_config, search_url="http://elsewhere:1/retrieve", topk=7, num_gpus=8)
    assert (config.search_url, config.topk, config.retrieval_timeout) == (retrieval_url, 3, 30.0)
    assert config.retrieval_concurrency == 15          # 120 in flight over the job, split over 8 workers
    assert config.stop == ("</tool_call>",)
    with pytest.raises(ValueError, match="tool_config_path"):
        tool_gen_config(tool_config, tool_config=None)
    with pytest.raises(ValueError, match="tool_response_truncate_side"):
        tool_gen_config(tool_config, tool_response_truncate_side="top")


def test_tag_protocol_is_unchanged_by_default():
    config = GenerationConfig(max_turns=1, max_start_length=8, max_prompt_length=16, max_response_length=4,
                              max_obs_length=4)
    assert config.protocol == "tags" and config.stop == actions.STOP_STRINGS


def test_async_tool_rollout_equals_sync(tool_tokenizer, tool_config):
    """The async loop (one coroutine per trajectory) applies the same tool rules as the sync loop."""
    import asyncio

    from search_r1.llm_agent.async_generation import AsyncAgentLoop
    from search_r1.llm_agent.generation import _Row
    from search_r1.search.async_client import AsyncRetrievalClient
    from verl.workers.rollout.async_engine import Completion

    tok = tool_tokenizer
    eos = tok.eos_token_id
    search = encode(tok, call(["capital of France"]))
    answer = encode(tok, "<answer> Paris </answer>") + [eos]
    malformed = encode(tok, '<tool_call>{"name": "nope"}</tool_call>')
    scripts = {"q1": [search, answer], "q2": [malformed, search, answer], "q3": [answer]}
    config = tool_gen_config(tool_config)
    sync_out, engine = run_tool(tok, scripts, ["q1", "q2", "q3"], config)

    class ScriptedAsyncEngine:
        async def generate(self, prompt_ids, seed, max_tokens=None, follows=None):
            meta = {K.META_RESPONSE_LENGTH: max_tokens or config.max_response_length, K.META_EOS_TOKEN_ID: eos,
                    K.META_STOP: list(config.stop)}
            await asyncio.sleep(0)
            return Completion(token_ids=engine.emit(list(prompt_ids), meta), log_probs=None)

    manager = LLMGenerationManager(tok, None, config)

    async def main():
        client = AsyncRetrievalClient(config.search_url, topk=config.topk, timeout=5, max_retries=0)
        try:
            prompts = [tool_prompt_ids(tok, k, tool_config.schemas) for k in ("q1", "q2", "q3")]
            loop = AsyncAgentLoop(manager, ScriptedAsyncEngine(), client, frozenset({eos}))
            return await loop.run(prompts, call_seed=0)
        finally:
            await client.aclose()

    rows, stats = asyncio.run(main())
    assert all(isinstance(r, _Row) for r in rows)
    for i, row in enumerate(rows):
        ids, mask = row.response()
        assert (ids, mask) == response_of(sync_out, i), f"row {i}"
    assert sum(s["tool_call_errors"] for s in stats) == sync_out.meta_info["tool_call_errors"] == 1
    assert [r.stop_reason for r in rows] == ["answered"] * 3
    assert torch.is_tensor(sync_out.batch[K.RESPONSES])
