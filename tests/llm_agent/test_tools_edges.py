"""Edges of the tool protocol's text rules (tools.py) and of its turns (tool_turns.ToolTurns):
tool-config validation and its messages, tool-call parsing, tool-message texts, the chat
framing derived from odd templates, and the cut / answer / append / stop rules of one turn,
checked on exact texts, token ids, masks and counters."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from search_r1.llm_agent import actions, tools
from search_r1.llm_agent.generation_config import GenerationConfig
from search_r1.llm_agent.token_text import TokenText
from search_r1.llm_agent.tool_turns import ToolTurns
from search_r1.llm_agent.trajectory import _Row
from search_r1.search.schema import Hit
from tests.llm_agent.helpers import encode, with_template
from verl.utils.tiny_model import TOOL_CHAT_TEMPLATE

URL = "http://127.0.0.1:1/retrieve"


def search_tool(name: str = "search", **config) -> dict:
    return {"class_name": "verl.tools.search_tool.SearchTool",
            "config": {"retrieval_service_url": URL, **config},
            "tool_schema": {"type": "function", "function": {"name": name, "description": "Searches.",
                                                             "parameters": {"type": "object", "properties": {}}}}}


# A template whose text between turns depends on the tools offered (the tool answer names them).
TOOLS_AWARE_TEMPLATE = TOOL_CHAT_TEMPLATE.replace(
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}",
    "{{ '\n<tool_response tools=' ~ (tools | length if tools else 0) ~ '>\n' + message['content'] "
    "+ '\n</tool_response>' }}")


@pytest.fixture(scope="module")
def aware_tok(tokenizer):
    assert TOOLS_AWARE_TEMPLATE != TOOL_CHAT_TEMPLATE
    return with_template(tokenizer, TOOLS_AWARE_TEMPLATE)


# --- tool config --------------------------------------------------------------------------------


def parse_error(data, source="cfg.yaml") -> str:
    with pytest.raises(ValueError) as err:
        tools.parse_tool_config(data, source=source)
    return str(err.value)


def test_default_source_names_the_tool_config():
    with pytest.raises(ValueError) as err:
        tools.parse_tool_config({"tool": []})
    assert str(err.value) == "<tool config>: expected a top-level 'tools:' list with at least one tool"


def test_parsed_config_keeps_its_source_and_the_search_name():
    config = tools.parse_tool_config({"tools": [search_tool("web_search")]}, source="mine.yaml")
    assert config.source == "mine.yaml"
    assert config.tool_names == ["web_search"] and config.search_name == "web_search"
    assert config.search == {"name": "web_search", "retrieval_service_url": URL, "topk": 3, "timeout": 30.0,
                             "num_workers": 120, "rate_limit": 120, "enable_global_rate_limit": True,
                             "type": "native", "show_doc_ids": False}


def test_schema_type_and_config_type_default_to_the_supported_ones():
    tool = search_tool(topk=1, num_workers=1, rate_limit=1, timeout=1)
    del tool["tool_schema"]["type"]
    assert "type" not in tool["config"]
    config = tools.parse_tool_config({"tools": [tool]})
    settings = config.search_settings()
    assert (settings.topk, settings.num_workers, settings.rate_limit, settings.timeout) == (1, 1, 1, 1)
    assert settings.type == "native" and config.schemas == [tool["tool_schema"]]
    assert tools.parse_tool_config({"tools": [search_tool(timeout=0.5)]}).search_settings().timeout == 0.5


def test_omegaconf_tool_config_is_resolved():
    from omegaconf import OmegaConf

    tool = search_tool()
    tool["config"]["retrieval_service_url"] = "${url}"
    data = OmegaConf.create({"url": "http://10.0.0.1:8000/retrieve", "tools": [tool]})
    config = tools.parse_tool_config(data)
    assert config.search_settings().retrieval_service_url == "http://10.0.0.1:8000/retrieve"
    assert isinstance(config.schemas[0], dict)


def bad(**edits):
    tool = search_tool()
    for key, value in edits.items():
        tool[key] = value
    return tool


def schema_with(**function):
    return {"type": "function", "function": function}


@pytest.mark.parametrize("tools_, message", [
    (["search"], "cfg.yaml: tools[0]: expected a mapping with class_name, config and tool_schema"),
    ([{**search_tool(), "extra": 1}],
     "cfg.yaml: tools[0]: unknown keys ['extra']; known: class_name, config, tool_schema"),
    ([bad(tool_schema=None)], "cfg.yaml: tools[0].tool_schema: expected {type: function, function: {name: ..., "
                              "description: ..., parameters: ...}}"),
    ([bad(tool_schema="search")], "cfg.yaml: tools[0].tool_schema: expected"),
    ([bad(tool_schema={"type": "function"})], "cfg.yaml: tools[0].tool_schema: expected"),
    ([bad(tool_schema={"type": "function", "function": "search"})], "cfg.yaml: tools[0].tool_schema: expected"),
    ([bad(tool_schema=schema_with(name=""))], "cfg.yaml: tools[0].tool_schema: expected"),
    ([bad(tool_schema=schema_with(name=5))], "cfg.yaml: tools[0].tool_schema: expected"),
    ([bad(tool_schema={"type": "retrieval", "function": {"name": "search"}})],
     "cfg.yaml: tools[0].tool_schema.type: only 'function' tools are supported, got 'retrieval'"),
    ([search_tool(), search_tool()],
     "cfg.yaml: tools[1].tool_schema.function.name: tool 'search' is defined twice"),
    ([search_tool(), search_tool("web")],
     "cfg.yaml: tools[1]: only one search tool may be configured (also 'search')"),
    ([bad(config=["retrieval_service_url"])], "cfg.yaml: tools[0].config: expected a mapping"),
    ([search_tool(topk=0)], "cfg.yaml: tools[0].config.topk: must be >= 1, got 0"),
    ([search_tool(rate_limit=-2)], "cfg.yaml: tools[0].config.rate_limit: must be >= 1, got -2"),
    ([search_tool(timeout=0)], "cfg.yaml: tools[0].config.timeout: must be > 0, got 0"),
    ([search_tool(timeout=-1.5)], "cfg.yaml: tools[0].config.timeout: must be > 0, got -1.5"),
])
def test_bad_tool_config_gets_a_clear_error(tools_, message):
    assert parse_error({"tools": tools_}).startswith(message)


def test_invalid_yaml_names_the_file(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text("tools: [\n  - {class_name: x\n")
    with pytest.raises(ValueError) as err:
        tools.load_tool_config(path)
    assert str(err.value).startswith(f"{path}: not valid YAML: ")


def test_loaded_config_source_is_the_file(tmp_path):
    import yaml

    path = tmp_path / "tools.yaml"
    path.write_text(yaml.safe_dump({"tools": [search_tool()]}))
    assert tools.load_tool_config(path).source == str(path)


def test_tool_config_from_an_empty_dict_is_empty():
    config = tools.ToolConfig.from_dict({})
    assert config == tools.ToolConfig() and config.source == "" and config.schemas == []
    assert config.search_name is None and config.search_settings() is None


# --- tool calls ---------------------------------------------------------------------------------


def test_invalid_json_error_quotes_the_json_error():
    (err,) = tools.parse_tool_calls("<tool_call>{'name': 'search'}</tool_call>", ["search"])
    assert err == tools.ToolCallError(
        "Error: the tool call is not valid JSON (Expecting property name enclosed in double quotes); write "
        '{"name": <tool name>, "arguments": {...}} inside <tool_call></tool_call>.')


def test_too_deeply_nested_call_is_an_error_not_a_crash():
    body = "[" * 200_000 + "]" * 200_000
    (err,) = tools.parse_tool_calls(f"<tool_call>{body}</tool_call>", ["search"])
    assert err.message.startswith("Error: the tool call is not valid JSON (nested too deeply); write ")


def test_nameless_call_error_text():
    (err,) = tools.parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>', ["search"])
    assert err.message == ('Error: the tool call must be a JSON object with a string "name" and an '
                           'object "arguments".')


def test_call_without_arguments_has_empty_arguments():
    assert tools.parse_tool_calls('<tool_call>{"name": "search"}</tool_call>', ["search"]) == [
        tools.ToolCall("search", {})]


def test_bad_arguments_do_not_hide_the_calls_after_them():
    text = ('<tool_call>{"name": "search", "arguments": "not json"}</tool_call>'
            '<tool_call>{"name": "search", "arguments": {"query_list": ["a"]}}</tool_call>')
    assert tools.parse_tool_calls(text, ["search"]) == [
        tools.ToolCallError("Error: the \"arguments\" of tool 'search' must be a JSON object."),
        tools.ToolCall("search", {"query_list": ["a"]})]


def test_tool_message_texts():
    assert tools.render_call_error(tools.ToolCallError("Error: boom")) == '{"result": "Error: boom"}'
    assert tools.tool_result("río") == '{"result": "río"}'
    assert tools.render_search_error("down") == '{"result": "Search error: down"}'
    assert tools.render_bad_query_list() == json.dumps({"result": tools.BAD_QUERY_LIST_TEXT})


def test_truncation_defaults_to_the_middle_and_refuses_unknown_sides():
    assert tools.truncate_tool_response("abcdefghij", 4) == ("ab...(truncated)...ij", True)
    with pytest.raises(ValueError) as err:
        tools.truncate_tool_response("abc", 1, "top")
    assert str(err.value) == ("multi_turn.tool_response_truncate_side must be one of ('left', 'right', 'middle'), "
                              "got 'top'")


# --- chat framing -------------------------------------------------------------------------------


class _Proxy:
    """A tokenizer-like object: the chat template and nothing more that is asked for."""

    def __init__(self, tok, **attrs):
        self._tok = tok
        self.chat_template = tok.chat_template
        self.__dict__.update(attrs)

    def apply_chat_template(self, *args, **kwargs):
        return self._tok.apply_chat_template(*args, **kwargs)


class _NoTemplate:
    def __repr__(self):
        return "<NoTemplate tokenizer>"


def test_tokenizer_without_chat_template_is_named():
    with pytest.raises(ValueError) as err:
        tools.ChatFraming(_NoTemplate())
    assert str(err.value) == ("tool calling (multi_turn.enable) needs a tokenizer with a chat template that renders "
                              "tools and 'tool' messages; <NoTemplate tokenizer> has none")
    named = _NoTemplate()
    named.name_or_path, named.chat_template = "org/tiny", None
    with pytest.raises(ValueError, match=r"messages; 'org/tiny' has none$"):
        tools.ChatFraming(named)


def test_template_that_drops_the_assistant_content_is_refused(tokenizer):
    tok = with_template(tokenizer, "{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }}"
                                   "{% endif %}{% endfor %}")
    with pytest.raises(ValueError) as err:
        tools.ChatFraming(tok)
    assert str(err.value) == "the chat template does not render an assistant message's content once, verbatim"


def test_template_without_tool_messages_gets_the_full_message(tokenizer):
    tok = with_template(tokenizer, "{% for m in messages %}{% if m['role'] != 'tool' %}{{ m['content'] }}"
                                   "{% endif %}{% endfor %}")
    with pytest.raises(ValueError) as err:
        tools.ChatFraming(tok)
    assert str(err.value) == ("the chat template does not render 'tool' messages (role 'tool'); tool calling needs one "
                              "that does (e.g. Qwen2.5's)")


def test_template_that_rewrites_the_assistant_turn_before_tools_is_refused(tokenizer):
    template = ("{% for m in messages %}{{ m['role'] + ':' + m['content'] }}"
                "{% if loop.last %}{{ '<end>' }}{% else %}{{ '<next>' }}{% endif %}{% endfor %}")
    with pytest.raises(ValueError) as err:
        tools.ChatFraming(with_template(tokenizer, template))
    assert str(err.value) == ("the chat template renders an assistant turn differently once tool messages follow it; "
                              "tool observations cannot be appended token-exactly")


def test_framing_renders_with_the_tools_offered(aware_tok):
    schemas = tools.parse_tool_config({"tools": [search_tool()]}).schemas
    framing = tools.ChatFraming(aware_tok, schemas)
    msgs = [{"role": "user", "content": "Q"}]
    turn = '<tool_call>\n{"name": "search", "arguments": {"query_list": ["q"]}}\n</tool_call>'
    prompt = aware_tok.apply_chat_template(msgs, tools=schemas, tokenize=False, add_generation_prompt=True)
    whole = aware_tok.apply_chat_template(msgs + [{"role": "assistant", "content": turn},
                                                  {"role": "tool", "content": "R"}],
                                          tools=schemas, tokenize=False, add_generation_prompt=True)
    observation = framing.observation(["R"], ended_with_eos=False)
    assert "<tool_response tools=1>" in observation
    assert prompt + turn + observation == whole


def test_tokenizer_without_eos_text_keeps_the_end_of_turn(tool_tokenizer):
    for attrs in ({}, {"eos_token": None}):
        framing = tools.ChatFraming(_Proxy(tool_tokenizer, **attrs))
        assert framing.observation(["R"], ended_with_eos=True) == framing.observation(["R"], ended_with_eos=False)
        assert framing.observation(["R"], True).startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\nR\n")
    from tokenizers import AddedToken

    framing = tools.ChatFraming(_Proxy(tool_tokenizer, eos_token=AddedToken("<|im_end|>", special=True)))
    assert framing.observation(["R"], True).startswith("<|im_end|>\n")


def test_split_observation_pieces_join_to_the_observation(tool_tokenizer):
    framing = tools.ChatFraming(tool_tokenizer)
    for ended in (False, True):
        pieces = framing.split_observation(["A", "B"], ended)
        assert "".join(text for text, _ in pieces) == framing.observation(["A", "B"], ended)
        assert [(t, c) for t, c in pieces if c] == [("A", True), ("B", True)]
    assert framing.split_observation(["A", "B"], True) == [
        ("\n<|im_start|>user\n<tool_response>\n", False), ("A", True), ("\n</tool_response>\n<tool_response>\n", False),
        ("B", True), ("\n</tool_response><|im_end|>\n<|im_start|>assistant\n", False)]


# --- ToolTurns ----------------------------------------------------------------------------------


def tool_config() -> tools.ToolConfig:
    """Parsed per call, not at import: a mutation run imports this module once per test process, and
    a module-level parse would run under whichever mutant happened to be active then."""
    return tools.parse_tool_config({"tools": [search_tool()]})


def gen_config(**overrides) -> GenerationConfig:
    fields = dict(max_turns=2, max_start_length=1024, max_prompt_length=2048, max_response_length=400,
                  max_total_response_length=400, max_obs_length=300, protocol="tool",
                  tool_config=tool_config().to_dict(), max_assistant_turns=3, retrieval_max_retries=0)
    fields.update(overrides)
    return GenerationConfig(**fields)


def turns(tok, **overrides) -> ToolTurns:
    config = gen_config(**overrides)
    return ToolTurns(TokenText(tok), config)


def call(*queries: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "search", "arguments": {"query_list": list(queries)}}) + "\n</tool_call>"


def framing_len(tok) -> int:
    return len(encode(tok, tools.ChatFraming(tok, tool_config().schemas).observation([""], False)))


def test_max_obs_length_must_leave_room_for_a_tool_answer(tool_tokenizer):
    n = framing_len(tool_tokenizer)
    with pytest.raises(ValueError) as err:
        turns(tool_tokenizer, max_obs_length=n)
    assert str(err.value) == (f"max_obs_length ({n}) leaves no room for a tool answer: the chat template's text "
                              f"around one tool message is {n} tokens")
    assert turns(tool_tokenizer, max_obs_length=n + 1).config.max_obs_length == n + 1


def test_observation_ids_use_the_tools_offered(aware_tok):
    tt = turns(aware_tok)
    res = tt.cut_turn(encode(aware_tok, call("q")), frozenset({aware_tok.eos_token_id}))
    row = _Row(prompt_ids=[])
    tt.apply_turn(row, res, ["R"], Counter(), None)
    obs = row.turns[0][1]
    framing = tools.ChatFraming(aware_tok, tool_config().schemas)
    assert obs == encode(aware_tok, framing.observation(["R"], False))
    assert "<tool_response tools=1>" in aware_tok.decode(obs)


def test_cut_turn_keeps_ids_up_to_the_first_call(tool_tokenizer):
    tt = turns(tool_tokenizer)
    eos = frozenset({tool_tokenizer.eos_token_id})
    first = encode(tool_tokenizer, "<think> t </think>\n" + call("a"))
    for tail in ("\n<|im_end|>\n<|im_start|>user\nmore", "\n" + call("b")):
        res = tt.cut_turn(first + encode(tool_tokenizer, tail), eos)
        assert res.kept_ids == first and res.generated == len(first) + len(encode(tool_tokenizer, tail))
        assert res.calls == (tools.ToolCall("search", {"query_list": ["a"]}),) and res.queries == ("a",)
        assert res.action.kind == "search" and not res.emitted_eos


def test_cut_turn_kinds(tool_tokenizer):
    tt = turns(tool_tokenizer, max_parallel_calls=3)
    eos_id = tool_tokenizer.eos_token_id
    eos = frozenset({eos_id})
    two = encode(tool_tokenizer, call("a", "b") + call("c")) + [eos_id]
    res = tt.cut_turn(two, eos)
    assert res.kept_ids == two and res.emitted_eos and res.queries == ("a", "b", "c")
    assert res.action.kind == "search"
    res = tt.cut_turn(encode(tool_tokenizer, "<answer> Paris </answer>") + [eos_id], eos)
    assert res.action.kind == "answer" and res.calls == () and res.emitted_eos
    res = tt.cut_turn(encode(tool_tokenizer, "<think> hmm"), eos)
    assert res.action.kind == "invalid" and res.calls == () and not res.emitted_eos


def hits(*titles: str) -> list[Hit]:
    return [Hit.from_contents(t, f"{t}\n{t} text", 1.0) for t in titles]


def test_answers_take_each_calls_hits_in_order(tool_tokenizer):
    tt = turns(tool_tokenizer, max_parallel_calls=3, max_tool_response_length=None)
    res = tt.cut_turn(encode(tool_tokenizer, call("a") + call("b") + call("c")), frozenset())
    got = tt.answers(res, [hits("A"), hits("B"), hits("C")], None, Counter())
    assert got == [tools.render_search_results([hits(t)]) for t in "ABC"]


def test_failed_retrieval_messages(tool_tokenizer):
    tt = turns(tool_tokenizer)
    res = tt.cut_turn(encode(tool_tokenizer, call("a")), frozenset())
    assert tt.answers(res, None, "boom", Counter()) == ['{"result": "Search error: boom"}']
    assert tt.answers(res, None, None, Counter()) == [
        '{"result": "Search error: the retrieval server did not answer"}']


def test_answers_are_cut_on_the_configured_side(tool_tokenizer):
    tt = turns(tool_tokenizer, max_tool_response_length=10, tool_response_truncate_side="left")
    res = tt.cut_turn(encode(tool_tokenizer, call("a")), frozenset())
    stats = Counter()
    assert tt.answers(res, None, "boom", stats) == ['{"result":...(truncated)']
    assert stats["tool_response_truncated"] == 1


def apply(tt, row, text, answers, stats, eos=False, log_probs=None):
    ids = encode(tt.text.tokenizer, text) + ([tt.text.tokenizer.eos_token_id] if eos else [])
    res = tt.cut_turn(ids, frozenset({tt.text.tokenizer.eos_token_id}))
    tt.apply_turn(row, res, answers, stats, log_probs)
    return res


def test_apply_turn_counts_over_turns(tool_tokenizer):
    tt = turns(tool_tokenizer)
    row, stats = _Row(prompt_ids=[1]), Counter()
    apply(tt, row, call("a"), ["R1"], stats)
    assert (row.n_valid_actions, row.n_tool_rounds, row.n_searches) == (1, 1, 1)
    apply(tt, row, call("b"), ["R2"], stats)
    assert (row.n_valid_actions, row.n_tool_rounds, row.n_searches, row.stop_reason) == (2, 2, 2, None)
    apply(tt, row, '<tool_call>{"name": "nope"}</tool_call>', ["E"], stats)     # an error call: not valid
    assert (row.n_valid_actions, row.n_tool_rounds, row.n_searches) == (2, 3, 2)
    apply(tt, row, "<answer> Paris </answer>", None, stats, eos=True)
    assert (row.n_valid_actions, row.stop_reason) == (3, actions.ANSWERED)
    assert (stats["tool_calls"], stats["tool_call_errors"]) == (3, 1)


def test_turn_without_call_or_answer_is_not_valid_and_ends_the_row(tool_tokenizer):
    tt = turns(tool_tokenizer)
    row = _Row(prompt_ids=[1])
    apply(tt, row, "<think> no idea", None, Counter(), eos=True)
    assert (row.n_valid_actions, row.stop_reason) == (0, actions.EOS)
    row = _Row(prompt_ids=[1])
    apply(tt, row, "<think> no idea", None, Counter(), eos=False)
    assert (row.n_valid_actions, row.stop_reason) == (0, actions.CONTEXT_FULL)


def test_observation_that_fits_exactly_is_whole_and_not_counted_truncated(tool_tokenizer):
    framing = tools.ChatFraming(tool_tokenizer, tool_config().schemas)
    whole = encode(tool_tokenizer, framing.observation(["Paris is the capital"], False))
    tt = turns(tool_tokenizer, max_obs_length=len(whole))
    row, stats = _Row(prompt_ids=[1]), Counter()
    apply(tt, row, call("a"), ["Paris is the capital"], stats)
    assert row.turns[0][1] == whole and stats["obs_truncated"] == 0


def test_truncated_observations_are_counted_and_keep_the_eos_rule(tool_tokenizer):
    n = framing_len(tool_tokenizer)
    # Two calls a turn: the turn runs to the model's EOS, which the observation does not repeat.
    tt = turns(tool_tokenizer, max_obs_length=n + 3, max_tool_response_length=None, max_parallel_calls=2)
    row, stats = _Row(prompt_ids=[1]), Counter()
    long = "Paris is the capital of France and its largest city. " * 3
    apply(tt, row, call("a"), [long], stats, eos=True)
    obs = row.turns[0][1]
    assert tool_tokenizer.decode(obs).startswith("\n<|im_start|>user\n<tool_response>\n")     # no second <|im_end|>
    assert tool_tokenizer.decode(obs).endswith("\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert len(obs) == n + 3 and stats["obs_truncated"] == 1
    apply(tt, row, call("b"), [long], stats)
    apply(tt, row, call("c"), ["ok"], stats)
    assert stats["obs_truncated"] == 2


def test_observation_reaching_the_budget_ends_the_row(tool_tokenizer):
    framing = tools.ChatFraming(tool_tokenizer, tool_config().schemas)
    turn = encode(tool_tokenizer, call("a"))
    obs = encode(tool_tokenizer, framing.observation(["R"], False))
    for budget, reason, obs_kept in ((len(turn) + len(obs), actions.CONTEXT_FULL, []),
                                     (len(turn) + len(obs) + 1, None, obs)):
        tt = turns(tool_tokenizer, max_total_response_length=budget)
        row = _Row(prompt_ids=[1])
        apply(tt, row, call("a"), ["R"], Counter())
        assert row.turns == [(turn, obs_kept)] and row.stop_reason == reason
        assert row.n_tool_rounds == (0 if reason else 1)
        assert tt.remaining(row) == budget - row.response_len


def test_apply_turn_keeps_the_engines_log_probs(tool_tokenizer):
    tt = turns(tool_tokenizer)
    row = _Row(prompt_ids=[1])
    turn = encode(tool_tokenizer, call("a"))
    lps = [-0.5] * len(turn)
    apply(tt, row, call("a"), ["R"], Counter(), log_probs=lps)
    assert row.response_log_probs() == lps + [0.0] * len(row.turns[0][1])


def test_remaining_budget(tool_tokenizer):
    tt = turns(tool_tokenizer, max_total_response_length=50)
    row = _Row(prompt_ids=[1])
    assert tt.remaining(row) == 50
    row.append_turn(list(range(10)), [])
    assert tt.remaining(row) == 40
    row.append_turn(list(range(40)), [])
    assert tt.remaining(row) == 0
    row.append_turn([1, 2], [])
    assert tt.remaining(row) == 0
