"""Both sides of the generation manager's limits, and what the tool protocol carries through a turn:
the rolling context at exactly its room, an observation of exactly max_obs_length tokens, the tool
protocol's budget (a row with no token left stops, one with a token left goes on; a turn is cut to
what is left, log-probs with it), the engine's log-probs in the tool protocol, the retrieval error
in a tool message, the batch's own pad id, and the async rollout's composed statistics.

Fast and offline: scripted engines, in-memory retrieval clients and worker groups.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from scripts.bench.rollout import ScriptedRollout
from search_r1.llm_agent import actions, tools
from search_r1.llm_agent.generation import AGENT_ROWS, AGENT_STATS, LLMGenerationManager
from search_r1.llm_agent.tensor_helper import left_pad
from search_r1.llm_agent.trajectory import _Row
from search_r1.search.schema import Hit
from tests.llm_agent.helpers import encode, make_gen_batch
from tests.llm_agent.test_generation_edges import _AsyncClient, _Client, _row_ids, tags_config, tool_config
from tests.llm_agent.test_tool_protocol import call, response_of, tool_batch
from verl.protocol import DataProto
from verl.utils import batch_keys as K


def _row_with_turns(prompt: list[int], *lengths: int) -> _Row:
    """A row whose turns are `lengths` long (policy ids only), turn t made of the token 100 + t."""
    row = _Row(prompt_ids=list(prompt))
    for t, n in enumerate(lengths):
        row.append_turn([100 + t] * n, [], None)
    return row


# --- the rolling context at its room ----------------------------------------------------------


@pytest.mark.parametrize("room, kept_turns, cut", [
    (12, 3, False),   # all three turns fill the room exactly
    (11, 2, True),    # one token short: the oldest turn goes
    (8, 2, True),     # the two newest fill the room exactly
    (7, 1, True),
])
def test_context_keeps_the_newest_turns_that_fill_the_room_exactly(tokenizer, room, kept_turns, cut):
    prompt = [3, 4, 5]
    manager = LLMGenerationManager(tokenizer, None, tags_config(max_start_length=3, max_prompt_length=3 + room))
    row = _row_with_turns(prompt, 4, 4, 4)
    ids, was_cut = manager._context(row)
    newest = [tok for t in range(3 - kept_turns, 3) for tok in [100 + t] * 4]
    assert (ids, was_cut) == (prompt + newest, cut)


def test_context_keeps_the_tail_of_a_newest_turn_longer_than_the_room(tokenizer):
    manager = LLMGenerationManager(tokenizer, None, tags_config(max_start_length=2, max_prompt_length=5))
    row = _Row(prompt_ids=[3, 4])
    row.append_turn([10, 11, 12, 13], [20], None)
    assert manager._context(row) == ([3, 4, 12, 13, 20], True)


# --- an observation of exactly max_obs_length tokens ----------------------------------------------


def test_notice_of_exactly_max_obs_length_tokens_is_not_truncated(tokenizer):
    notices = (actions.INVALID_ACTION_NOTICE, actions.SEARCH_BUDGET_NOTICE)
    longest = max(notices, key=lambda text: len(encode(tokenizer, text)))
    n = len(encode(tokenizer, longest))
    manager = LLMGenerationManager(tokenizer, None, tags_config(max_obs_length=n))
    assert manager._observation_ids(longest) == (encode(tokenizer, longest), False)
    over = longest + " and more"
    assert manager._observation_ids(over) == (encode(tokenizer, over)[:n], True)


def test_information_block_of_exactly_max_obs_length_tokens_is_not_truncated(tokenizer):
    text = actions.render_observation([Hit.from_contents("0", '"Paris"\n' + "Paris is the capital of France. " * 30, 1.0)])
    body = encode(tokenizer, text[: -len(actions.INFORMATION_CLOSE)])
    close = encode(tokenizer, actions.INFORMATION_CLOSE)
    assert len(body) > 2 * len(encode(tokenizer, actions.INVALID_ACTION_NOTICE))   # every notice fits
    exact = LLMGenerationManager(tokenizer, None, tags_config(max_obs_length=len(body) + len(close)))
    assert exact._observation_ids(text) == (body + close, False)
    short = LLMGenerationManager(tokenizer, None, tags_config(max_obs_length=len(body) + len(close) - 1))
    assert short._observation_ids(text) == (body[:-1] + close, True)


# --- the tool protocol's budget ---------------------------------------------------------------------


def _tool_manager(tok: Any, engine: Any = None, **overrides: Any) -> LLMGenerationManager:
    return LLMGenerationManager(tok, engine, tool_config(**overrides))


@pytest.mark.parametrize("used, expected", [(400, actions.CONTEXT_FULL), (399, None), (398, None)])
def test_tool_row_stops_only_when_no_token_of_its_budget_is_left(tool_tokenizer, used, expected):
    manager = _tool_manager(tool_tokenizer, max_total_response_length=400)
    row = _row_with_turns([3], used)
    assert manager._stop_before_turn(row) == expected


def test_tool_turn_and_its_log_probs_are_cut_to_what_is_left(tool_tokenizer):
    manager = _tool_manager(tool_tokenizer, max_total_response_length=400)
    row = _row_with_turns([3], 397)
    sampled, log_probs = [7, 8, 9, 10, 11], [-0.1, -0.2, -0.3, -0.4, -0.5]
    assert manager._clip_to_budget(row, sampled, log_probs) == ([7, 8, 9], [-0.1, -0.2, -0.3])
    assert manager._clip_to_budget(row, sampled, None) == ([7, 8, 9], None)
    # the tag protocol never cuts by position
    assert LLMGenerationManager(tool_tokenizer, None, tags_config())._clip_to_budget(row, sampled, log_probs) == (
        sampled, log_probs)


class _LogProbRollout(ScriptedRollout):
    """A scripted engine that also reports each sampled id's log-prob: -(position + 1) / 100."""

    def generate_sequences(self, prompts: Any) -> Any:
        out = super().generate_sequences(prompts)
        width = out.batch[K.RESPONSES].shape[1]
        lps = -(torch.arange(width, dtype=torch.float32) + 1) / 100
        out.batch[K.ROLLOUT_LOG_PROBS] = lps.repeat(out.batch[K.RESPONSES].shape[0], 1)
        return out


def _tool_run(tok: Any, engine: Any, keys: list[str], client: Any = None, **overrides: Any) -> Any:
    manager = LLMGenerationManager(tok, engine, tool_config(**overrides), retrieval_client=client)
    schemas = tools.ToolConfig.from_dict(manager.config.tool_config).schemas
    return manager.run_llm_loop(*tool_batch(tok, keys, schemas))


def test_tool_rollout_keeps_the_engines_log_probs_on_policy_tokens(tool_tokenizer):
    tok = tool_tokenizer
    search = encode(tok, call(["capital of France"]))
    answer = encode(tok, "<answer> Paris </answer>") + [tok.eos_token_id]
    out = _tool_run(tok, _LogProbRollout(tok, {"q1": [search, answer]}), ["q1"], client=_Client())
    ids, loss = response_of(out, 0)
    assert out.meta_info["stop_reasons"][actions.ANSWERED] == 1
    expected = [-(i + 1) / 100 for i in range(len(search))] + [0.0] * (len(ids) - len(search) - len(answer)) + [
        -(i + 1) / 100 for i in range(len(answer))]
    got = out.batch[K.ROLLOUT_LOG_PROBS][0, : len(ids)].tolist()
    assert got == pytest.approx(expected)
    assert loss.count(0) == len(ids) - len(search) - len(answer) > 0


def test_tool_turn_longer_than_a_rows_remaining_budget_is_cut_at_it(tool_tokenizer):
    """Two rows share one engine call whose length is the longer remainder: the row with less
    left keeps only what fits, and its log-probs with it."""
    tok = tool_tokenizer
    search = encode(tok, call(["capital of France"]))
    ramble = encode(tok, "<think> " + "very " * 120 + "</think>")
    short = encode(tok, "<think> ok </think>")
    budget = 300
    out = _tool_run(tok, _LogProbRollout(tok, {"q1": [search, ramble], "q2": [short]}), ["q1", "q2"],
                    client=_Client(), max_response_length=budget, max_total_response_length=budget,
                    max_obs_length=200)
    ids, loss = response_of(out, 0)
    assert len(ids) == budget and out.meta_info["stop_reasons"][actions.CONTEXT_FULL] == 2
    first_two = len(ids) - loss[::-1].index(0)        # the call and its tool message
    assert ids[first_two:] == ramble[: budget - first_two]
    assert out.batch[K.ROLLOUT_LOG_PROBS][0, first_two:budget].tolist() == pytest.approx(
        [-(i + 1) / 100 for i in range(budget - first_two)])


def test_failed_retrieval_tool_message_names_the_error(tool_tokenizer):
    tok = tool_tokenizer
    search = encode(tok, call(["capital of France"]))
    answer = encode(tok, "<answer> Paris </answer>") + [tok.eos_token_id]
    out = _tool_run(tok, ScriptedRollout(tok, {"q1": [search, answer]}), ["q1"], client=_Client(fail=True))
    ids, loss = response_of(out, 0)
    observation = tok.decode([t for t, m in zip(ids, loss, strict=True) if m == 0])
    assert "Search error: index exploded" in observation
    assert out.meta_info["search_failures"] == 1


def test_async_failed_retrieval_tool_message_names_the_error(tool_tokenizer):
    import asyncio

    from search_r1.llm_agent.async_generation import AsyncAgentLoop

    tok = tool_tokenizer
    manager = _tool_manager(tok, mode="async")
    res = manager._tool.cut_turn(encode(tok, call(["capital of France"])), frozenset({tok.eos_token_id}))
    stats: Counter[str] = Counter()
    answers = asyncio.run(AsyncAgentLoop(manager, None, _AsyncClient(fail=True), frozenset())._act(res, stats))
    assert len(answers) == 1 and "Search error: index exploded" in answers[0]
    assert stats["search_failures"] == 1


# --- the engine meta and the composed batch ----------------------------------------------------------


def test_the_batchs_pad_id_is_sent_to_the_engine(tokenizer):
    answer = encode(tokenizer, "<answer> Paris </answer>")
    engine = ScriptedRollout(tokenizer, {"alpha": [answer]})
    other_pad = tokenizer.pad_token_id + 1
    gen_batch, prompts = make_gen_batch(tokenizer, ["alpha"], pad_token_id=other_pad)
    LLMGenerationManager(tokenizer, engine, tags_config()).run_llm_loop(gen_batch, prompts)
    assert engine.calls[0]["meta_info"][K.META_PAD_TOKEN_ID] == other_pad


def test_rollout_log_probs_are_right_padded_with_zeros(tokenizer):
    manager = LLMGenerationManager(tokenizer, None, tags_config())
    rows = [_Row(prompt_ids=[3, 4]), _Row(prompt_ids=[3, 4])]
    rows[0].append_turn([10, 11, 12], [20], [-0.5, -0.25, -0.125])
    rows[1].append_turn([13], [], [-2.0])
    prompts, prompt_mask = left_pad([r.prompt_ids for r in rows], tokenizer.pad_token_id)
    out = manager._compose_final_output(rows, prompts, prompt_mask, Counter(), {})
    assert out.batch[K.ROLLOUT_LOG_PROBS].tolist() == [[-0.5, -0.25, -0.125, 0.0], [-2.0, 0.0, 0.0, 0.0]]
    assert out.batch[K.ROLLOUT_LOG_PROBS].dtype == torch.float32


class _TrajectoryGroup:
    """A worker group whose generate_trajectories returns fixed rows and per-row counters."""

    def __init__(self, rows: list[_Row], stats: list[dict], match: bool | None = None) -> None:
        self.rows, self.stats, self.match = rows, stats, match

    def generate_trajectories(self, batch: Any) -> Any:
        meta = {} if self.match is None else {K.META_ROLLOUT_LOG_PROBS_MATCH_ACTOR: self.match}
        return DataProto.from_dict(non_tensors={AGENT_ROWS: self.rows, AGENT_STATS: self.stats}, meta_info=meta)


def _answered_row(prompt: list[int], policy: list[int]) -> _Row:
    row = _Row(prompt_ids=list(prompt))
    row.append_turn(policy, [], None)
    row.n_turns, row.stop_reason = 1, actions.ANSWERED
    return row


def test_async_rollout_of_one_row_reports_its_retrieval_wait(tokenizer):
    gen_batch, prompts = make_gen_batch(tokenizer, ["alpha"])
    row = _answered_row(prompts[0].tolist(), [10, 11])
    group = _TrajectoryGroup([row], [{"retrieval_ms": 750, "search_failures": 1, "generated_tokens": 2}])
    out = LLMGenerationManager(tokenizer, group, tags_config(mode="async")).run_llm_loop(gen_batch, prompts)
    assert out.meta_info["timing_s"]["retrieval"] == pytest.approx(0.75)
    assert out.meta_info["search_failures"] == 1 and out.meta_info["generated_tokens"] == 2
    assert out.meta_info[K.META_ROLLOUT_LOG_PROBS_MATCH_ACTOR] is True
    assert _row_ids(out, 0) == [10, 11]


def test_async_rollout_averages_the_retrieval_wait_and_passes_the_engines_match_flag(tokenizer):
    gen_batch, prompts = make_gen_batch(tokenizer, ["alpha", "beta"])
    rows = [_answered_row([t for t in p.tolist() if t != tokenizer.pad_token_id], [10]) for p in prompts]
    stats = [{"retrieval_ms": 500}, {"retrieval_ms": 1500}]
    manager = LLMGenerationManager(tokenizer, _TrajectoryGroup(rows, stats, match=False), tags_config(mode="async"))
    out = manager.run_llm_loop(gen_batch, prompts)
    assert out.meta_info["timing_s"]["retrieval"] == pytest.approx(1.0)
    assert out.meta_info[K.META_ROLLOUT_LOG_PROBS_MATCH_ACTOR] is False
    with pytest.raises(ValueError, match=r"^generate_trajectories returned 1 rows for 2 prompts$"):
        LLMGenerationManager(tokenizer, _TrajectoryGroup(rows[:1], stats[:1]), tags_config(mode="async")).run_llm_loop(
            gen_batch, prompts)

