"""Qwen3's thinking mode in the tool protocol: a `<tool_call>` the model drafts inside its
`<think>…</think>` is not a call (the bug veRL users reported against Qwen3), and the chat template's
thinking switch (veRL's `data.apply_chat_template_kwargs.enable_thinking`) reaches every rendering:
the prompts and the turns the tool protocol appends."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from search_r1.llm_agent import tools
from search_r1.search.client import RetrievalClient
from tests.llm_agent.helpers import encode, with_template
from tests.llm_agent.test_tool_protocol import RECIPE_TOOL_CONFIG, response_of, run_tool, tool_gen_config
from verl.trainer.main_ppo import compose_config
from verl.utils.dataset.rl_dataset import RLHFDataset, chat_template_kwargs, prompt_to_text
from verl.utils.tiny_model import QWEN3_CHAT_TEMPLATE

EMPTY_THINK = "<think>\n\n</think>\n\n"


@pytest.fixture
def tool_config(tmp_path, retrieval_url) -> tools.ToolConfig:
    """veRL's search tool config (the recipe's file) against the real BM25 server."""
    path = tmp_path / "search_tool_config.yaml"
    path.write_text(RECIPE_TOOL_CONFIG.format(url=retrieval_url))
    return tools.load_tool_config(path)


def _call(query: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "search", "arguments": {"query_list": [query]}}) + "\n</tool_call>"


@pytest.mark.parametrize(("text", "queries"), [
    # drafted inside the reasoning, made after it: one call, the one made
    (f"<think> I could write {_call('draft')} but first </think>\n{_call('made')}", ["made"]),
    # still thinking at the end of the turn (no </think>): nothing is called
    (f"<think> maybe {_call('draft')} hmm", []),
    # the template opened <think> in the prompt: what precedes the first </think> is reasoning
    (f"plan: {_call('draft')} </think>\n{_call('made')}", ["made"]),
    # two reasoning spans around a call, and no reasoning at all
    (f"<think>a</think>{_call('one')}<think>{_call('draft')}</think>{_call('two')}", ["one", "two"]),
    (_call("plain"), ["plain"]),
    # a tag cannot form across a dropped span
    (f"<tool_<think>x</think>call>{json.dumps({'name': 'search', 'arguments': {'query_list': ['q']}})}</tool_call>",
     []),
])
def test_a_tool_call_inside_the_reasoning_is_not_made(text: str, queries: list[str]) -> None:
    calls = tools.parse_tool_calls(text, ["search"])
    assert [c.arguments["query_list"][0] for c in calls if isinstance(c, tools.ToolCall)] == queries
    assert all(isinstance(c, tools.ToolCall) for c in calls)


def test_the_thinking_switch_reaches_the_prompt_and_the_next_turns_opening(tokenizer, tool_config) -> None:
    tok = with_template(tokenizer, QWEN3_CHAT_TEMPLATE)
    prompt = [{"role": "user", "content": "Question: where?"}]
    assert not prompt_to_text(prompt, tok).endswith(EMPTY_THINK)
    assert prompt_to_text(prompt, tok, chat_template_kwargs={"enable_thinking": False}).endswith(EMPTY_THINK)
    assert prompt_to_text(prompt, tok, tool_config.schemas, {"enable_thinking": False}).endswith(EMPTY_THINK)
    framing = tools.ChatFraming(tok, tool_config.schemas, {"enable_thinking": False})
    assert framing.observation(["passages"], ended_with_eos=False).endswith("<|im_start|>assistant\n" + EMPTY_THINK)
    assert not tools.ChatFraming(tok, tool_config.schemas).observation(["p"], False).endswith(EMPTY_THINK)


def test_verls_key_composes_and_a_bad_value_is_refused_naming_it(tokenizer, tmp_path) -> None:
    cfg = compose_config(["+data.apply_chat_template_kwargs.enable_thinking=false"])
    assert chat_template_kwargs(cfg) == {"enable_thinking": False}
    assert chat_template_kwargs(compose_config([])) == {}
    with pytest.raises(ValueError, match="data.apply_chat_template_kwargs must be a mapping"):
        chat_template_kwargs(compose_config(["data.apply_chat_template_kwargs=5"]))
    # The dataset renders its prompts with it.
    tok = with_template(tokenizer, QWEN3_CHAT_TEMPLATE)
    path = tmp_path / "rows.parquet"
    pd.DataFrame({"data_source": ["nq"], "prompt": [[{"role": "user", "content": "Question: where?"}]],
                  "reward_model": [{"style": "rule", "ground_truth": {"target": ["x"]}}],
                  "extra_info": [{"split": "train", "index": 0}]}).to_parquet(path)
    plain = RLHFDataset(str(path), tok)[0]["input_ids"]
    thinking_off = RLHFDataset(str(path), tok, chat_template_kwargs={"enable_thinking": False})[0]["input_ids"]
    empty_think = encode(tok, EMPTY_THINK)
    assert thinking_off[-len(empty_think):].tolist() == empty_think
    assert plain[-len(empty_think):].tolist() != empty_think


def test_a_qwen3_turn_that_drafts_a_call_while_thinking_runs_only_the_call_it_makes(
        tokenizer, tool_config, retrieval_url) -> None:
    """max_parallel_calls=2: no stop string, the turn runs to its end and its one call outside the
    reasoning is made (with max_parallel_calls=1 the engine's stop at the first </tool_call>, the
    drafted one, ends the turn inside the reasoning: no call is made, the row ends; docs/models.md)."""
    tok = with_template(tokenizer, QWEN3_CHAT_TEMPLATE)
    eos = tok.eos_token_id
    thinking = encode(tok, f"<think> I might call {_call('Eiffel Tower')} but no. </think>\n{_call('capital of France')}")
    answer = encode(tok, "<answer> Paris </answer>") + [eos]
    config = tool_gen_config(tool_config, max_parallel_calls=2, chat_template_kwargs={"enable_thinking": False})
    out, engine = run_tool(tok, {"q1": [thinking + [eos], answer]}, ["q1"], config, do_sample=True)
    assert out.meta_info["tool_calls"] == 1 and out.meta_info["tool_call_errors"] == 0
    hits = RetrievalClient(retrieval_url, topk=3).retrieve(["capital of France"])
    found = tools.truncate_tool_response(tools.render_search_results(hits), 256, "middle")[0]
    framing = tools.ChatFraming(tok, tool_config.schemas, {"enable_thinking": False})
    observation = encode(tok, framing.observation([found], ended_with_eos=True))
    ids, loss = response_of(out, 0)
    assert ids == thinking + [eos] + observation + answer
    assert loss == [1] * (len(thinking) + 1) + [0] * len(observation) + [1] * len(answer)
    # The next turn opened as the prompt did: with the empty reasoning block of enable_thinking=false.
    assert tok.decode(observation).endswith(EMPTY_THINK)

    # One call a turn: the stop string ends the turn at the drafted call; it is not made.
    out, _ = run_tool(tok, {"q1": [thinking + [eos], answer]}, ["q1"], tool_gen_config(tool_config), do_sample=True)
    assert out.meta_info["tool_calls"] == 0
