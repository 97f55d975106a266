"""The tool protocol's per-turn limits, in the sync and the async rollout:

- the decode budget: each engine request asks for what is left of the row's budget of all turns
  (`data.max_response_length`), not the whole budget; a row keeps and counts nothing past its own;
  where the budget does not bind, the rollout is the same whatever the budget;
- one round of tool messages shares `max_obs_length` between its answers (never past it);
- `max_parallel_calls` runs the first calls of a turn and drops the rest (no tool message), as veRL.

A scripted engine stands in for the model (no model can search here); retrieval is the project's
BM25 server over HTTP; the async rollout runs through the real `AsyncEngine`, worker dispatch and
asyncio client.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import yaml

from scripts.bench.rollout import ScriptedRollout
from search_r1.llm_agent import actions, tools
from search_r1.llm_agent.async_generation import run_shard
from search_r1.llm_agent.generation import LLMGenerationManager
from search_r1.search.client import RetrievalClient
from tests.llm_agent.helpers import encode
from tests.llm_agent.test_rollout_behaviours import ScriptedStepEngine
from tests.llm_agent.test_run_async import _Workers
from tests.llm_agent.test_tool_protocol import (
    RECIPE_TOOL_CONFIG,
    call,
    response_of,
    tool_batch,
    tool_gen_config,
    tool_prompt_ids,
)
from verl.utils import batch_keys as K


def _tools(url: str) -> tools.ToolConfig:
    return tools.parse_tool_config(yaml.safe_load(RECIPE_TOOL_CONFIG.format(url=url)))


def _config(url: str, **overrides: Any):
    return tool_gen_config(_tools(url), **overrides)


def _sync(tok: Any, scripts: dict, keys: list[str], config: Any) -> tuple[Any, ScriptedRollout]:
    engine = ScriptedRollout(tok, scripts)
    gen_batch, prompts = tool_batch(tok, keys, _tools(config.search_url).schemas)
    return LLMGenerationManager(tok, engine, config).run_llm_loop(gen_batch, prompts), engine


def _async_shard(tok: Any, scripts: dict, keys: list[str], config: Any) -> tuple[list, list, ScriptedStepEngine]:
    """The worker side of the async rollout on one shard: (rows, per-row counters, the step engine)."""
    engine = ScriptedStepEngine(tok, scripts, config)
    prompts = [tool_prompt_ids(tok, key, _tools(config.search_url).schemas) for key in keys]
    rows, stats, _ = run_shard(tok, config, engine, prompts, 7, frozenset({tok.eos_token_id}))
    return rows, stats, engine


def _rollout(tok: Any, scripts: dict, keys: list[str], config: Any) -> Any:
    """The composed batch, through the driver: sync (one engine call per turn) or async (two rollout
    ranks' generate_trajectories, each running its shard's trajectories as coroutines)."""
    if config.mode == "sync":
        return _sync(tok, scripts, keys, config)[0]
    gen_batch, prompts = tool_batch(tok, keys, _tools(config.search_url).schemas)
    return LLMGenerationManager(tok, _Workers(tok, scripts, config), config).run_llm_loop(gen_batch, prompts)


def _ramble(tok: Any) -> list[int]:
    return encode(tok, "<think> " + "very " * 300 + "</think>")


# --- the decode budget ---------------------------------------------------------------------------


def test_async_requests_ask_for_the_rows_remaining_budget_and_keep_nothing_past_it(tool_tokenizer, retrieval_url):
    """Turn 1 has less left than the turn it would write: the engine is asked for exactly what is left."""
    tok = tool_tokenizer
    search, ramble = encode(tok, call(["capital of France"])), _ramble(tok)
    budget = 300
    config = _config(retrieval_url, max_response_length=budget, max_total_response_length=budget, mode="async")
    rows, stats, engine = _async_shard(tok, {"q1": [search, ramble]}, ["q1"], config)
    row = rows[0]
    (policy0, obs0), (policy1, obs1) = row.turns
    assert policy0 == search and obs0 and not obs1
    left = budget - len(search) - len(obs0)
    assert 0 < left < len(ramble)                              # the budget binds on turn 1
    assert engine.max_tokens == [budget, left]
    assert policy1 == ramble[:left] and row.response_len == budget
    assert row.stop_reason == actions.CONTEXT_FULL
    assert stats[0]["generated_tokens"] == stats[0]["kept_tokens"] == len(search) + left
    assert row.response_log_probs()[-left:] == [-1.0] * left

    # Sync mode asks the same of its engine call (one row) and ends with the same row.
    out, sync_engine = _sync(tok, {"q1": [search, ramble]}, ["q1"], _config(
        retrieval_url, max_response_length=budget, max_total_response_length=budget))
    assert [c["meta_info"][K.META_RESPONSE_LENGTH] for c in sync_engine.calls] == [budget, left]
    assert response_of(out, 0) == row.response()
    assert out.meta_info["generated_tokens"] == len(search) + left


def test_a_sync_call_asks_for_the_largest_remainder_of_its_rows_and_each_keeps_its_own(tool_tokenizer,
                                                                                        retrieval_url):
    """One engine call takes one length: the call carrying rows with different remainders asks for
    the largest (one call a turn, as long as its longest row), and each row keeps and counts only its own."""
    tok = tool_tokenizer
    ramble = _ramble(tok)
    short_call, long_call = encode(tok, call(["Rome"])), encode(tok, call(["capital of France", "Eiffel Tower"]))
    budget = 300
    config = _config(retrieval_url, max_response_length=budget, max_total_response_length=budget)
    out, engine = _sync(tok, {"q1": [short_call, ramble], "q2": [long_call, ramble]}, ["q1", "q2"], config)
    lefts = []
    for row, first in ((0, short_call), (1, long_call)):
        ids, loss = response_of(out, row)
        assert len(ids) == budget and ids[: len(first)] == first
        turn1 = budget - loss[::-1].index(0)          # the tool message ends where turn 1 starts
        lefts.append(budget - turn1)
        assert ids[turn1:] == ramble[: budget - turn1]
    assert lefts[0] != lefts[1]
    assert engine.calls[1]["meta_info"][K.META_RESPONSE_LENGTH] == max(lefts)
    assert out.meta_info["generated_tokens"] == out.meta_info["kept_tokens"] == budget * 2 - sum(
        loss.count(0) for _, loss in (response_of(out, 0), response_of(out, 1)))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_budget_that_does_not_bind_changes_nothing(tool_tokenizer, retrieval_url, mode):
    tok = tool_tokenizer
    eos = tok.eos_token_id
    search = encode(tok, call(["capital of France"]))
    answer = encode(tok, "<think> found </think>\n<answer> Paris </answer>") + [eos]
    scripts = {"q1": [search, answer], "q2": [answer], "q3": [search, search, answer]}
    keys = list(scripts)
    loose = _rollout(tok, scripts, keys, _config(retrieval_url, max_response_length=4000,
                                                 max_total_response_length=4000, mode=mode))
    longest = max(len(response_of(loose, row)[0]) for row in range(len(keys)))
    tight = _rollout(tok, scripts, keys, _config(retrieval_url, max_response_length=longest + 1,
                                                 max_total_response_length=longest + 1, mode=mode))
    for key in (K.RESPONSES, K.LOSS_MASK, K.ATTENTION_MASK, K.ROLLOUT_LOG_PROBS):
        if key in loose.batch.keys():
            assert torch.equal(tight.batch[key], loose.batch[key]), key
    for key in ("stop_reasons", "turns_stats", "valid_search_stats", "tool_calls", "generated_tokens",
                "kept_tokens", "obs_truncated"):
        assert tight.meta_info[key] == loose.meta_info[key], key
    assert loose.meta_info["stop_reasons"][actions.ANSWERED] == 3


def test_async_requests_of_several_rows_each_ask_for_their_own_remainder(tool_tokenizer, retrieval_url):
    tok = tool_tokenizer
    eos = tok.eos_token_id
    search = encode(tok, call(["capital of France"]))
    answer = encode(tok, "<answer> Paris </answer>") + [eos]
    budget = 1000
    config = _config(retrieval_url, max_response_length=budget, max_total_response_length=budget, mode="async")
    scripts = {"q1": [search, answer], "q2": [answer], "q3": [search, search, answer]}
    rows, _, engine = _async_shard(tok, scripts, list(scripts), config)
    asked: dict[int, list[int]] = {}
    prompts = [tool_prompt_ids(tok, key, _tools(retrieval_url).schemas) for key in scripts]
    for (context, _), max_tokens in zip(engine.requests, engine.max_tokens, strict=True):
        row = next(i for i, p in enumerate(prompts) if context[: len(p)] == p)
        asked.setdefault(row, []).append(max_tokens)
    for i, row in enumerate(rows):
        used = [0]
        for policy, obs in row.turns[:-1]:
            used.append(used[-1] + len(policy) + len(obs))
        assert asked[i] == [budget - u for u in used], f"row {i}"
    assert [len(asked[i]) for i in range(3)] == [2, 1, 3]


def test_the_tag_protocol_asks_every_async_request_for_max_response_length(tokenizer, retrieval_url):
    from tests.llm_agent.test_rollout_behaviours import make_config, run_async, search_stream

    config = make_config(retrieval_url, max_turns=2, mode="async", max_response_length=40)
    _, _, engine = run_async(tokenizer, {"q1": [search_stream(tokenizer)] * 3}, ["q1"], config)
    assert engine.max_tokens == [40, 40, 40]


# --- one round of tool messages shares max_obs_length ---------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_long_tool_answers_share_the_observation_room(tool_tokenizer, retrieval_url, mode):
    tok = tool_tokenizer
    eos = tok.eos_token_id
    queries = ("capital of France", "Eiffel Tower")
    two = encode(tok, call([queries[0]]) + "\n" + call([queries[1]])) + [eos]
    answer = encode(tok, "<answer> Paris </answer>") + [eos]
    framing = tools.ChatFraming(tok, _tools(retrieval_url).schemas)
    client = RetrievalClient(retrieval_url, topk=3)
    texts = [tools.render_search_results(client.retrieve([q])) for q in queries]
    pieces = [(encode(tok, text), is_content) for text, is_content in framing.split_observation(texts, True)]
    framing_len = sum(len(ids) for ids, is_content in pieces if not is_content)
    share = 40                        # each answer is far longer than this (checked below)
    max_obs = framing_len + 2 * share + 1
    config = _config(retrieval_url, max_parallel_calls=2, max_tool_response_length=None, max_obs_length=max_obs,
                     max_response_length=4000, max_total_response_length=4000, max_prompt_length=8000, mode=mode)
    out = _rollout(tok, {"q1": [two, answer]}, ["q1"], config)
    ids, loss = response_of(out, 0)
    obs = ids[len(two): len(ids) - len(answer)]
    assert loss == [1] * len(two) + [0] * len(obs) + [1] * len(answer)
    assert all(len(ids) > 2 * share for ids, is_content in pieces if is_content)
    # Each answer keeps its first `share` tokens; the framing (tags, next assistant opening) is whole.
    assert obs == [tok_ for ids, is_content in pieces for tok_ in (ids[:share] if is_content else ids)]
    assert len(obs) == max_obs - 1 <= max_obs
    assert out.meta_info["obs_truncated"] == 1 and out.meta_info["valid_search_stats"] == [2]


# --- max_parallel_calls --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_calls_past_max_parallel_calls_are_not_run(tool_tokenizer, retrieval_url, mode):
    """Three calls, max_parallel_calls=2: the first two are run and answered; the third is not run and
    gets no tool message (veRL's tool agent loop drops it the same way), its text stays in the turn."""
    tok = tool_tokenizer
    eos = tok.eos_token_id
    queries = ("capital of France", "Eiffel Tower", "capital of Germany")
    three = encode(tok, "\n".join(call([q]) for q in queries)) + [eos]
    answer = encode(tok, "<answer> Paris </answer>") + [eos]
    config = _config(retrieval_url, max_parallel_calls=2, max_tool_response_length=None, max_obs_length=2000,
                     max_response_length=4000, max_total_response_length=4000, max_prompt_length=8000, mode=mode)
    out = _rollout(tok, {"q1": [three, answer]}, ["q1"], config)
    client = RetrievalClient(retrieval_url, topk=3)
    texts = [tools.render_search_results(client.retrieve([q])) for q in queries[:2]]
    observation = encode(tok, tools.ChatFraming(tok, _tools(retrieval_url).schemas).observation(texts, True))
    ids, loss = response_of(out, 0)
    assert ids == three + observation + answer
    assert loss == [1] * len(three) + [0] * len(observation) + [1] * len(answer)
    meta = out.meta_info
    assert (meta["tool_calls"], meta["tool_call_errors"], meta["valid_search_stats"]) == (2, 0, [2])
    assert meta["stop_reasons"][actions.ANSWERED] == 1
