"""The driver side of the async rollout (`rollout.mode=async`): `LLMGenerationManager._run_async`.

The manager calls `actor_rollout_wg.generate_trajectories(batch)` once and composes the rows that
come back. Here that group is in-process: the real @register dispatch (split over two rollout
ranks, padded, concatenated, unpadded) calls `ActorRolloutRefWorker.generate_trajectories` itself
on stand-in ranks whose engine replays scripts, so the worker's real coroutine loop
(`async_generation.run_shard`, `AsyncEngine`, the asyncio retrieval client) runs against the
project's BM25 server over HTTP. No Ray, no model: what is checked is what `_run_async` owns —
the composed batch equals sync mode's for the same script, the per-row counters add up, the
timings, the log-prob flag, the config sent to the workers, the row count.

Also: a search tool call whose `query_list` is not a list of queries is answered with veRL
SearchTool's error text, in both modes.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import yaml

from scripts.bench.rollout import ScriptedRollout
from search_r1.llm_agent import actions, tools
from search_r1.llm_agent.generation import (
    AGENT_STATS,
    META_AGENT_CONFIG,
    GenerationConfig,
    LLMGenerationManager,
)
from tests.conftest import free_port
from tests.llm_agent.helpers import encode, make_gen_batch
from tests.llm_agent.test_rollout_behaviours import ScriptedStepEngine, make_config
from tests.llm_agent.test_tool_protocol import (
    RECIPE_TOOL_CONFIG,
    call,
    response_of,
    tool_batch,
    tool_gen_config,
)
from tests.single_controller.test_decorator import InProcessGroup
from verl.protocol import DataProto
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import MeshRank
from verl.utils import batch_keys as K
from verl.workers.fsdp_workers import ROLLOUT_MESH, ActorRolloutRefWorker
from verl.workers.rollout_role import RolloutRole

RANKS = 2
# Three prompts of different lengths (left padding) over two ranks: the dispatch pads one row and drops it.
KEYS = ["searches_then_answers", "never_answers", "eos"]


# --- the trainer's actor-rollout group, in process ------------------------------------------------


class _ScriptedRollout:
    """The rank's `rollout`: a step engine per call (as vllm_rollout.step_engine), and its log-prob flag."""

    def __init__(self, tokenizer: Any, scripts: dict[str, list[list[int]]], config: GenerationConfig,
                 log_probs_match_actor: bool) -> None:
        self.tokenizer, self.scripts, self.config = tokenizer, scripts, config
        self.log_probs_match_actor = log_probs_match_actor
        self.engines: list[ScriptedStepEngine] = []

    def step_engine(self, meta: dict) -> ScriptedStepEngine:
        self.engines.append(ScriptedStepEngine(self.tokenizer, self.scripts, self.config))
        return self.engines[-1]


class _RolloutRank(RolloutRole, Worker):
    """One rollout rank running the worker's own rollout role (`generate_trajectories` and what it calls;
    what it reads of the worker: role, tokenizer, eos ids, TP size, the open generation phase, `rollout`)."""

    _require = ActorRolloutRefWorker._require

    def __init__(self, rank: int, tokenizer: Any, rollout: _ScriptedRollout) -> None:
        super().__init__()
        self.role, self._is_rollout, self._rollout_tp = "actor_rollout", True, 1
        self.tokenizer, self.eos_token_ids, self.rollout = tokenizer, [tokenizer.eos_token_id], rollout
        self._phase_depth = 1             # the trainer holds the engines awake around the rollout
        self.set_mesh_rank(ROLLOUT_MESH, MeshRank(rank, RANKS))


class _Workers:
    """What the manager sees of the actor-rollout worker group; records each call's (batch, output).
    `edit` changes the collected output before the manager gets it (a misbehaving worker)."""

    def __init__(self, tokenizer: Any, scripts: dict[str, list[list[int]]], config: GenerationConfig,
                 log_probs_match_actor: bool = True, edit: Callable[[DataProto], DataProto] | None = None) -> None:
        self.rollouts = [_ScriptedRollout(tokenizer, scripts, config, log_probs_match_actor) for _ in range(RANKS)]
        self.group = InProcessGroup([_RolloutRank(r, tokenizer, ro) for r, ro in enumerate(self.rollouts)])
        self.edit = edit
        self.calls: list[tuple[DataProto, DataProto]] = []

    def generate_trajectories(self, batch: DataProto) -> DataProto:
        out = self.group.generate_trajectories(batch)
        if self.edit is not None:
            out = self.edit(out)
        self.calls.append((batch, out))
        return out


class _SyncScripted(ScriptedRollout):
    """Sync mode's engine: the same scripts, with the step engine's log-prob (-1.0) for each sampled id."""

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        out = super().generate_sequences(prompts)
        width = out.batch[K.RESPONSES].shape[1]
        out.batch[K.ROLLOUT_LOG_PROBS] = -1.0 * out.batch[K.ATTENTION_MASK][:, -width:].float()
        return out


# --- the script -----------------------------------------------------------------------------------


def _scripts(tokenizer: Any) -> dict[str, list[list[int]]]:
    """One row searches then answers; one writes no action, then searches until the final turn
    (max_turns); one stops at EOS. Searches run on past `</search>` (no engine stop strings): the
    manager cuts them."""
    search = encode(tokenizer, "<think> look it up </think><search> capital of France </search>"
                               "<information> made up </information>")
    invalid = encode(tokenizer, "<think> hmm </think>")
    answer = encode(tokenizer, "<answer> Paris </answer>")
    eos = encode(tokenizer, "<think> I know </think> Paris") + [tokenizer.eos_token_id]
    return dict(zip(KEYS, [[search, answer], [invalid, search, search], [eos]], strict=True))


def _config(tokenizer: Any, url: str, **overrides: Any) -> GenerationConfig:
    """max_turns=2; observations cut at 100 tokens; the rolling context holds the prompt and one
    turn, so the last turn of 'never_answers' is sampled from a cut context."""
    longest_turn = max(len(encode(tokenizer, "<think> look it up </think><search> capital of France </search>")) + 100,
                       len(encode(tokenizer, "<think> hmm </think>" + actions.INVALID_ACTION_NOTICE)))
    prompt = make_gen_batch(tokenizer, KEYS)[1].shape[1]      # the longest prompt
    fields: dict[str, Any] = dict(max_turns=2, max_obs_length=100, stop=(), max_start_length=prompt + 1,
                                  max_prompt_length=prompt + longest_turn + 5)
    fields.update(overrides)
    return make_config(url, **fields)


def _rollout(tokenizer: Any, config: GenerationConfig, workers: Any) -> DataProto:
    gen_batch, prompts = make_gen_batch(tokenizer, KEYS, do_sample=False)
    return LLMGenerationManager(tokenizer, workers, config).run_llm_loop(gen_batch, prompts)


def _dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}/retrieve"


COMPOSED = (K.PROMPTS, K.RESPONSES, K.INPUT_IDS, K.ATTENTION_MASK, K.POSITION_IDS, K.INFO_MASK, K.LOSS_MASK,
            K.CONTEXT_CUT_MASK, K.ROLLOUT_LOG_PROBS)


# --- _run_async -----------------------------------------------------------------------------------


@pytest.mark.parametrize("retriever", ["bm25", "down"])
def test_async_rollout_composes_the_batch_sync_mode_composes(tokenizer, retrieval_url, retriever):
    url = retrieval_url if retriever == "bm25" else _dead_url()
    scripts = _scripts(tokenizer)
    workers = _Workers(tokenizer, scripts, _config(tokenizer, url, mode="async"))
    start = time.perf_counter()
    out = _rollout(tokenizer, _config(tokenizer, url, mode="async"), workers)
    wall = time.perf_counter() - start
    sync_engine = _SyncScripted(tokenizer, scripts)
    sync = _rollout(tokenizer, _config(tokenizer, url), sync_engine)

    # Every rank rolled out its shard (3 rows + 1 padding row over 2 ranks), and the result is unpadded.
    assert [len(r.engines) for r in workers.rollouts] == [1, 1]
    assert [len(e.requests) for r in workers.rollouts for e in r.engines] == [2 + 3, 1 + 2]
    # The engines were sent what sync mode sends (prompts without their padding, the same rolling contexts).
    sent = {tuple(ids) for r in workers.rollouts for e in r.engines for ids, _ in e.requests}
    assert sent == {tuple(ids) for c in sync_engine.calls for ids in c["contexts"]}
    assert set(out.batch.keys()) == set(COMPOSED)
    for key in COMPOSED:
        assert torch.equal(out.batch[key], sync.batch[key]), key
    assert int(out.batch[K.CONTEXT_CUT_MASK].sum()) > 0            # the comparison covers a cut row
    assert (out.batch[K.ATTENTION_MASK][:, 0] == 0).any()           # and left-padded prompts

    failed = retriever == "down"
    meta = out.meta_info
    expected = {
        "turns_stats": [2, 3, 1],
        "active_mask": [False, True, False],                       # never_answers ran out of turns
        "valid_action_stats": [2, 2, 0],
        "valid_search_stats": [1, 1, 0],
        "search_failures": 2 if failed else 0,
        "obs_truncated": 0 if failed else 2,                       # the passages, not the failure notice
        "context_cuts": 1,
        "tool_calls": 0, "tool_call_errors": 0, "tool_response_truncated": 0,
        "generated_tokens": sum(len(stream) for turns in scripts.values() for stream in turns),
        "kept_tokens": int(out.batch[K.LOSS_MASK].sum()),
        "stop_reasons": {actions.ANSWERED: 1, actions.EOS: 1, actions.MAX_TURNS: 1, actions.CONTEXT_FULL: 0,
                         actions.INVALID_ACTION: 0},
        K.META_ROLLOUT_LOG_PROBS_MATCH_ACTOR: True,
    }
    assert {k: meta[k] for k in expected} == expected
    assert {k: sync.meta_info[k] for k in expected} == expected
    assert meta["generated_tokens"] > meta["kept_tokens"]         # the engine wrote past </search>

    # 'generate' is the rollout's wall time; 'retrieval' the rows' mean wait for the retriever.
    batch_sent, worker_out = workers.calls[0]
    waits_ms = [stats.get("retrieval_ms", 0) for stats in worker_out.non_tensor_batch[AGENT_STATS]]
    assert waits_ms[2] == 0 and (failed or sum(waits_ms) > 0)     # the rows that searched over HTTP waited
    assert set(meta["timing_s"]) == {"generate", "retrieval"}
    assert meta["timing_s"]["retrieval"] == sum(waits_ms) / 1000.0 / len(KEYS)
    assert meta["timing_s"]["retrieval"] <= meta["timing_s"]["generate"] <= wall
    # The driver's config reaches the workers whole.
    assert batch_sent.meta_info[META_AGENT_CONFIG] == dataclasses.asdict(_config(tokenizer, url, mode="async"))
    assert len(batch_sent) == len(KEYS)


def _set_waits(waits_ms: list[int]) -> Callable[[DataProto], DataProto]:
    def edit(out: DataProto) -> DataProto:
        for stats, ms in zip(out.non_tensor_batch[AGENT_STATS], waits_ms, strict=True):
            stats["retrieval_ms"] = ms
        return out
    return edit


def test_retrieval_time_is_the_mean_wait_of_a_row(tokenizer, retrieval_url):
    config = _config(tokenizer, retrieval_url, mode="async")
    workers = _Workers(tokenizer, _scripts(tokenizer), config, edit=_set_waits([1500, 700, 0]))
    out = _rollout(tokenizer, config, workers)
    assert out.meta_info["timing_s"]["retrieval"] == pytest.approx(2.2 / 3)


@pytest.mark.parametrize("reported, expected", [(False, False), (None, True)])
def test_rollout_log_probs_flag_comes_from_the_workers(tokenizer, retrieval_url, reported, expected):
    """A worker whose engine's log-probs are not the actor's quantity makes the batch's flag False;
    a worker that does not say leaves it True."""
    config = _config(tokenizer, retrieval_url, mode="async")

    def drop_flag(out: DataProto) -> DataProto:
        out.meta_info.pop(K.META_ROLLOUT_LOG_PROBS_MATCH_ACTOR)
        return out

    workers = _Workers(tokenizer, _scripts(tokenizer), config, log_probs_match_actor=bool(reported),
                       edit=drop_flag if reported is None else None)
    out = _rollout(tokenizer, config, workers)
    assert out.meta_info[K.META_ROLLOUT_LOG_PROBS_MATCH_ACTOR] is expected
    # A rollout after it starts from True again.
    again = _rollout(tokenizer, config, _Workers(tokenizer, _scripts(tokenizer), config))
    assert again.meta_info[K.META_ROLLOUT_LOG_PROBS_MATCH_ACTOR] is True


def test_workers_returning_another_row_count_is_an_error(tokenizer, retrieval_url):
    config = _config(tokenizer, retrieval_url, mode="async")
    workers = _Workers(tokenizer, _scripts(tokenizer), config, edit=lambda out: out.slice(0, len(out) - 1))
    with pytest.raises(ValueError, match=r"generate_trajectories returned 2 rows for 3 prompts"):
        _rollout(tokenizer, config, workers)


# --- the tool protocol: a search call with a bad query_list -------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_search_call_without_a_query_list_is_answered_with_the_tool_error(tool_tokenizer, mode):
    """The model reads veRL SearchTool's error text; the retriever (here down) is never asked."""
    tok = tool_tokenizer
    tool_config = tools.parse_tool_config(yaml.safe_load(RECIPE_TOOL_CONFIG.format(url=_dead_url())))
    bad = encode(tok, call("capital of France"))          # a string, not a list of queries
    answer = encode(tok, "<answer> Paris </answer>") + [tok.eos_token_id]
    scripts = {"q1": [bad, answer]}
    config = tool_gen_config(tool_config, mode=mode)
    engine: Any = _Workers(tok, scripts, config) if mode == "async" else ScriptedRollout(tok, scripts)
    gen_batch, prompts = tool_batch(tok, ["q1"], tool_config.schemas)
    out = LLMGenerationManager(tok, engine, config).run_llm_loop(gen_batch, prompts)

    ids, loss = response_of(out, 0)
    assert ids[: len(bad)] == bad and ids[len(ids) - len(answer):] == answer
    observation = tok.decode([t for t, m in zip(ids, loss, strict=True) if m == 0])
    message = json.dumps({"result": "Error: 'query_list' is missing, empty, or not a list in parameters."})
    assert observation.count("<tool_response>") == 1
    assert f"<tool_response>\n{message}\n</tool_response>" in observation
    meta = out.meta_info
    assert (meta["tool_calls"], meta["tool_call_errors"], meta["search_failures"]) == (1, 1, 0)
    assert meta["valid_search_stats"] == [0] and meta["stop_reasons"][actions.ANSWERED] == 1
