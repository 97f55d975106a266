"""Rollout behaviours that decide what is trained, in the tag protocol (the default):

- the async rollout never searches on the final turn (budget notice, the row stops), as sync mode;
- per-request sampling seeds differ across the turns of a row and across rows;
- a context cut on two or more turns marks `context_cut_mask` from the FIRST cut on;
- a newest turn longer than the room left in the rolling context keeps its TAIL in what the engine is sent.

A scripted engine stands in for the model (no model can search here); the retriever is the project's
BM25 server over HTTP, and the async rollout runs through the real `AsyncEngine` and asyncio client.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from scripts.bench.rollout import ScriptedRollout
from search_r1.llm_agent import actions
from search_r1.llm_agent.async_generation import run_shard
from search_r1.llm_agent.generation import GenerationConfig, LLMGenerationManager
from search_r1.llm_agent.tensor_helper import left_pad
from tests.llm_agent.helpers import encode, make_gen_batch, prompt_ids
from verl.utils import batch_keys as K
from verl.workers.rollout.async_engine import Completion, request_max_tokens


def make_config(url: str, **overrides: Any) -> GenerationConfig:
    fields = dict(max_turns=3, max_start_length=256, max_prompt_length=4096, max_response_length=64,
                  max_obs_length=1024, search_url=url, topk=2, retrieval_timeout=5.0, retrieval_max_retries=0)
    fields.update(overrides)
    return GenerationConfig(**fields)


class ScriptedStepEngine:
    """A continuous-batching step engine (`async_engine.StepEngine`) that replays scripts: each
    step finishes every request in flight, cut at the request's `max_tokens` as a real engine cuts
    it. Records each request's (prompt ids, seed) and its decode budget (`max_tokens`)."""

    def __init__(self, tokenizer: Any, scripts: dict[str, list[list[int]]], config: GenerationConfig) -> None:
        self.scripted = ScriptedRollout(tokenizer, scripts)
        self.meta = {K.META_RESPONSE_LENGTH: config.max_response_length, K.META_EOS_TOKEN_ID: tokenizer.eos_token_id,
                     K.META_STOP: list(config.stop)}
        self.requests: list[tuple[list[int], int]] = []
        self.max_tokens: list[int] = []
        self._in_flight: dict[str, tuple[list[int], int]] = {}

    def add(self, request_id: str, prompt_ids: list[int], seed: int, max_tokens: int | None = None) -> None:
        budget = request_max_tokens(request_id, max_tokens, self.meta[K.META_RESPONSE_LENGTH])
        self.requests.append((list(prompt_ids), seed))
        self.max_tokens.append(budget)
        self._in_flight[request_id] = (list(prompt_ids), budget)

    def has_unfinished(self) -> bool:
        return bool(self._in_flight)

    def step(self) -> list[tuple[str, Completion]]:
        done = [(rid, self.scripted.emit(ids, {**self.meta, K.META_RESPONSE_LENGTH: budget}))
                for rid, (ids, budget) in self._in_flight.items()]
        self._in_flight.clear()
        return [(rid, Completion(token_ids=ids, log_probs=[-1.0] * len(ids))) for rid, ids in done]

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._in_flight.pop(rid, None)


def run_async(tokenizer: Any, scripts: dict[str, list[list[int]]], keys: list[str], config: GenerationConfig,
              call_seed: int = 7) -> tuple[list[Any], list[Counter[str]], ScriptedStepEngine]:
    engine = ScriptedStepEngine(tokenizer, scripts, config)
    prompts = [prompt_ids(tokenizer, key) for key in keys]
    rows, stats, _ = run_shard(tokenizer, config, engine, prompts, call_seed,
                               frozenset({tokenizer.eos_token_id}))
    return rows, stats, engine


def search_stream(tokenizer: Any, query: str = "capital of France") -> list[int]:
    return encode(tokenizer, f"<think> look it up </think><search> {query} </search>")


# --- 2: the final turn never searches, in async mode ------------------------------------------

def test_async_rollout_does_not_search_on_the_final_turn(tokenizer, retrieval_url):
    search = search_stream(tokenizer)
    config = make_config(retrieval_url, max_turns=2, mode="async")
    rows, stats, engine = run_async(tokenizer, {"q1": [search] * 5}, ["q1"], config)
    row = rows[0]
    notice = encode(tokenizer, actions.SEARCH_BUDGET_NOTICE)
    assert len(engine.requests) == 3          # max_turns searching turns + the final one, then nothing
    assert row.n_turns == 3 and row.n_searches == 2
    assert row.stop_reason == actions.MAX_TURNS
    final_policy, final_obs = row.turns[-1]
    assert final_policy == search and final_obs == notice
    # The two searches before it were run: their observations are <information> blocks.
    for _, obs in row.turns[:2]:
        assert tokenizer.decode(obs).lstrip().startswith("<information>")
    assert stats[0]["search_failures"] == 0


# --- 7: per-request seeds --------------------------------------------------------------------

def test_async_request_seeds_differ_across_turns_and_rows(tokenizer, retrieval_url):
    search = search_stream(tokenizer)
    config = make_config(retrieval_url, max_turns=3, mode="async")
    keys = ["q1", "q2", "q3"]
    _, _, engine = run_async(tokenizer, {k: [search] * 5 for k in keys}, keys, config, call_seed=7)
    assert len(engine.requests) == 3 * 4      # 3 rows x (3 searching turns + the final one)
    seeds = [seed for _, seed in engine.requests]
    by_row: dict[str, list[int]] = {}
    for ids, seed in engine.requests:
        key = next(k for k in keys if ids[: len(prompt_ids(tokenizer, k))] == prompt_ids(tokenizer, k))
        by_row.setdefault(key, []).append(seed)
    assert all(len(set(row_seeds)) == 4 for row_seeds in by_row.values()), by_row  # across turns
    assert len(set(seeds)) == len(seeds), by_row                                   # and across rows
    # The seeds follow the call seed (a new rollout samples anew) and not the timing (same call, same seeds).
    _, _, again = run_async(tokenizer, {k: [search] * 5 for k in keys}, keys, config, call_seed=7)
    assert sorted(seed for _, seed in again.requests) == sorted(seeds)
    _, _, other = run_async(tokenizer, {k: [search] * 5 for k in keys}, keys, config, call_seed=8)
    assert not set(seed for _, seed in other.requests) & set(seeds)


class CohortStepEngine(ScriptedStepEngine):
    """A scripted engine that reports cohorts (as the HF engine does: the step a request joined at)
    and records, per request, the cohort it said it follows and the one it was given."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.steps = 0
        self.after: dict[str, int] = {}
        self.cohort: dict[str, int] = {}

    def add(self, request_id: str, prompt_ids: list[int], seed: int, max_tokens: int | None = None,
            after_cohort: int = -1) -> None:
        super().add(request_id, prompt_ids, seed)
        self.after[request_id], self.cohort[request_id] = after_cohort, self.steps

    def step(self) -> list[tuple[str, Completion]]:
        self.steps += 1
        return [(rid, Completion(c.token_ids, c.log_probs, self.cohort[rid])) for rid, c in super().step()]


def test_each_async_turn_follows_its_trajectorys_previous_completion(tokenizer, retrieval_url):
    """The engine may hold a turn back until the requests it joined with last time are done (sync
    mode's turn boundary): for that it must know which completion the request continues."""
    search = search_stream(tokenizer)
    config = make_config(retrieval_url, max_turns=2, mode="async")
    keys = ["q1", "q2"]
    engine = CohortStepEngine(tokenizer, {k: [search] * 5 for k in keys}, config)
    run_shard(tokenizer, config, engine, [prompt_ids(tokenizer, k) for k in keys], 7,
              frozenset({tokenizer.eos_token_id}))
    by_row: dict[int, list[str]] = {}
    for rid, (ids, _) in zip(engine.after, engine.requests, strict=True):
        row = next(i for i, k in enumerate(keys) if ids[: len(prompt_ids(tokenizer, k))] == prompt_ids(tokenizer, k))
        by_row.setdefault(row, []).append(rid)
    assert sorted(len(rids) for rids in by_row.values()) == [3, 3]
    for rids in by_row.values():
        assert engine.after[rids[0]] == -1
        assert [engine.after[r] for r in rids[1:]] == [engine.cohort[r] for r in rids[:-1]]


# --- 3: context_cut_mask from the first cut --------------------------------------------------

def _two_cut_setup(tokenizer: Any, retrieval_url: str, mode: str) -> tuple[GenerationConfig, int, list[int]]:
    """A config whose rolling context holds the prompt and ONE turn: turns 2 and 3 (of 0..3) are
    sampled from cut contexts. Returns (config, turn length, search stream)."""
    search = search_stream(tokenizer)
    probe = make_config(retrieval_url, max_turns=1)
    out = LLMGenerationManager(tokenizer, ScriptedRollout(tokenizer, {"q1": [search] * 3}), probe).run_llm_loop(
        *make_gen_batch(tokenizer, ["q1"]))
    loss = out.batch[K.LOSS_MASK][0].tolist()
    first_obs_end = next(i for i in range(len(search), len(loss)) if loss[i] == 1)
    turn_len = first_obs_end          # search + its <information> block
    prompt = prompt_ids(tokenizer, "q1")
    config = make_config(retrieval_url, max_turns=3, max_start_length=len(prompt) + 1,
                         max_prompt_length=len(prompt) + turn_len + 5, mode=mode)
    return config, turn_len, search


def test_context_cut_mask_starts_at_the_first_of_several_cuts_sync(tokenizer, retrieval_url):
    config, turn_len, search = _two_cut_setup(tokenizer, retrieval_url, "sync")
    out = LLMGenerationManager(tokenizer, ScriptedRollout(tokenizer, {"q1": [search] * 5}), config).run_llm_loop(
        *make_gen_batch(tokenizer, ["q1"]))
    meta = out.meta_info
    assert meta["context_cuts"] == 2 and meta["turns_stats"] == [4]
    loss = out.batch[K.LOSS_MASK][0]
    cut_mask = out.batch[K.CONTEXT_CUT_MASK][0]
    first_cut = 2 * turn_len          # turn 2 is the first sampled from a cut context
    assert cut_mask[:first_cut].sum() == 0
    assert cut_mask[first_cut:].tolist() == loss[first_cut:].tolist()
    assert int(cut_mask.sum()) == 2 * len(search)   # turns 2 and 3, both sampled from cut contexts


def test_context_cut_mask_starts_at_the_first_of_several_cuts_async(tokenizer, retrieval_url):
    config, turn_len, search = _two_cut_setup(tokenizer, retrieval_url, "async")
    rows, stats, _ = run_async(tokenizer, {"q1": [search] * 5}, ["q1"], config)
    assert stats[0]["context_cuts"] == 2 and rows[0].n_turns == 4
    assert rows[0].cut_from == 2 * turn_len
    manager = LLMGenerationManager(tokenizer, None, config)
    prompts, prompt_mask = left_pad([rows[0].prompt_ids], tokenizer.pad_token_id)
    out = manager._compose_final_output(rows, prompts, prompt_mask, Counter(), {})
    cut_mask = out.batch[K.CONTEXT_CUT_MASK][0]
    assert cut_mask[: 2 * turn_len].sum() == 0 and int(cut_mask.sum()) == 2 * len(search)


# --- 8: an over-long newest turn keeps its tail ----------------------------------------------

def test_newest_turn_longer_than_the_room_keeps_its_tail(tokenizer, retrieval_url):
    search = search_stream(tokenizer)
    prompt = prompt_ids(tokenizer, "q1")
    room = 12                         # far less than one search turn with its <information> block
    config = make_config(retrieval_url, max_turns=1, max_start_length=len(prompt) + 1,
                         max_prompt_length=len(prompt) + room)
    answer = encode(tokenizer, "<answer> Paris </answer>")
    engine = ScriptedRollout(tokenizer, {"q1": [search, answer]})
    # The cut context has lost the <information> opening the scripted engine counts turns by,
    # so turn 1 is found by the row's history instead: a context ending in the closing tag.
    engine.emit = _emit_by_context_end(engine, tokenizer, search, answer)   # type: ignore[method-assign]
    out = LLMGenerationManager(tokenizer, engine, config).run_llm_loop(*make_gen_batch(tokenizer, ["q1"]))
    n = int(out.batch[K.ATTENTION_MASK][0, out.batch[K.PROMPTS].shape[1]:].sum())
    response = out.batch[K.RESPONSES][0, :n].tolist()
    assert response[n - len(answer):] == answer
    turn0 = response[: n - len(answer)]      # search + its <information> block
    assert len(turn0) > room and turn0[: len(search)] == search
    sent = engine.calls[1]["contexts"][0]
    assert sent == prompt + turn0[-room:]
    assert tokenizer.decode(sent).endswith(actions.INFORMATION_CLOSE)
    assert out.meta_info["context_cuts"] == 1


def _emit_by_context_end(engine: ScriptedRollout, tokenizer: Any, search: list[int], answer: list[int]):
    def emit(context: list[int], meta: dict[str, Any]) -> list[int]:
        text = tokenizer.decode(context, skip_special_tokens=False)
        return answer if text.endswith(actions.INFORMATION_CLOSE) else search
    return emit
