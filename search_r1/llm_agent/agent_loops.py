"""Rolling rows out through agent loops (veRL's `AgentLoopBase`, verl/experimental/agent_loop/).

Each row runs the loop its `agent_name` names (else `rollout.agent.default_agent_loop`, else the
protocol's own: `search_r1_agent` for tags, `tool_agent` for tool calls) as a coroutine. The loop calls
the engine through its `server_manager.generate(request_id=, prompt_ids=, sampling_params=)`:

- async mode (a rollout worker, `run_shard`): `EngineServer`, the worker's continuous-batching engine;
  each request samples with its own seed (the request's `seed`, else one derived from the call, the row
  and the request's position in the row, so what a row samples does not depend on timing);
- sync mode (the driver): `BatchedServer` gathers the requests of every row still running and sends
  them as one `generate_sequences` call per round, as the sync rollout makes one call per turn.

`max_tokens` (or `max_new_tokens`) and `stop` of a request's sampling_params are honoured (an engine
that ran past a stop string is cut there by token position); other sampling keys are the run's.

The protocol loops (`tool_agent`, `search_r1_agent`) run the generation manager's own turn rules for
their row (`run_protocol_row`, through async_generation.AsyncAgentLoop); their rows are what the
batched sync rollout makes. A loop of your own returns an AgentLoopOutput, checked and turned into the
row record every rollout composes (`_Row`): ids within the vocabulary, mask of 0/1 as long as the ids,
the prompt within the initial prompt's bound, the response cut to the response bound (counted in
`agent_loop_truncated`). A loop that raises or returns something else is that row's counted error
(`row_errors`): the row keeps its prompt and gets no response. The rows come back with their tools'
step rewards, an interaction's scores and the loop's `reward_score` and `extra_fields` (row_outputs.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from search_r1.llm_agent import actions
from search_r1.llm_agent.async_generation import AsyncAgentLoop, request_seed, run_shard
from search_r1.llm_agent.generation import (
    LLMGenerationManager,
    eos_token_ids,
    prompts_of,
    row_fields,
    tools_kwargs_of,
)
from search_r1.llm_agent.row_outputs import attach_row_outputs
from search_r1.llm_agent.token_text import TokenText
from search_r1.llm_agent.trajectory import _Row
from verl.utils import batch_keys as K

logger = logging.getLogger(__name__)

# A protocol loop hands its row record and counters back through its output's extra_fields under these keys.
ROW_KEY, STATS_KEY = "__search_r1_row__", "__search_r1_stats__"
PROTOCOL_LOOPS = {"tags": "search_r1_agent", "tool": "tool_agent"}


def loop_name(config: Any, fields: dict) -> str:
    """The agent loop of a row: its `agent_name`, else `default_agent_loop`, else the protocol's."""
    name = fields.get(K.AGENT_NAME)
    if isinstance(name, str) and name:
        return name
    return config.default_agent_loop or PROTOCOL_LOOPS[config.protocol]


def uses_agent_loops(config: Any, fields: Sequence[dict]) -> bool:
    """Whether any row runs a loop other than its protocol's own, or talks to an interaction (it answers the
    row between its turns): then each row runs as its loop's coroutine."""
    if config.interaction_config_path and (not fields or any(_interaction_kwargs(f) for f in fields)):
        return True
    own = PROTOCOL_LOOPS[config.protocol]
    return any(loop_name(config, f) != own for f in fields) if fields else \
        (config.default_agent_loop or own) != own


def _interaction_kwargs(fields: dict) -> dict:
    info = fields.get(K.EXTRA_INFO)
    kwargs = info.get("interaction_kwargs") if isinstance(info, dict) else None
    return kwargs if isinstance(kwargs, dict) else {}


def response_bound(config: Any) -> int:
    """Tokens a row's response may hold: the tool protocol's budget, or the tag protocol's turns and
    observations (`max_turns + 1` turns, `max_turns` observations)."""
    if config.max_total_response_length is not None:
        return int(config.max_total_response_length)
    return (config.max_turns + 1) * config.max_response_length + config.max_turns * config.max_obs_length


def loop_sampling_params(meta: dict[str, Any]) -> dict[str, Any]:
    """veRL's sampling_params for a loop's `run` (informative here: the engine samples with the run's)."""
    greedy = not bool(meta.get(K.META_DO_SAMPLE, True))
    return {"temperature": 0.0 if greedy else float(meta.get(K.META_TEMPERATURE, 1.0)), "top_p": 1.0, "top_k": -1,
            "repetition_penalty": 1.0, "logprobs": True}


def cut_at_stop(text: TokenText, ids: list[int], log_probs: list[float] | None, stop: Sequence[str]
                ) -> tuple[list[int], list[float] | None]:
    """`ids` up to the token completing the first stop string (by position; all of them when none occurs)."""
    stop = [s for s in stop if s]
    if not stop or not ids or not any(s in text.decode(ids) for s in stop):
        return ids, log_probs
    kept = text.shortest_prefix(ids, lambda t: any(s in t for s in stop))
    return kept, None if log_probs is None else log_probs[: len(kept)]


def _max_tokens(sampling_params: dict, response_length: int) -> int:
    value = sampling_params.get("max_tokens", sampling_params.get("max_new_tokens"))
    return response_length if value is None else max(1, min(int(value), response_length))


# --- the engine, as a loop's server_manager sees it ---------------------------------------------------


@dataclass
class RolloutContext:
    """What the protocol loops share in one rollout call: the manager's rules, the retrieval client."""

    manager: LLMGenerationManager
    client: Any
    eos_token_ids: frozenset[int]
    call_seed: int


class RowServerManager:
    """veRL's `server_manager` for one row's loop: `await generate(request_id=, prompt_ids=, sampling_params=)`."""

    def __init__(self, server: Any, context: RolloutContext, row_index: int) -> None:
        self.server = server
        self.context = context
        self.row_index = row_index

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data: Any = None, video_data: Any = None) -> Any:
        if image_data or video_data:
            raise ValueError("rollouts here are text-only: image_data / video_data are not supported")
        return await self.server.request(self.row_index, str(request_id), [int(t) for t in prompt_ids],
                                         dict(sampling_params or {}))


class _Checked:
    """Checks of a request both servers make: a context the engine can hold."""

    def __init__(self, text: TokenText, response_length: int, max_context: int) -> None:
        self.text = text
        self.response_length = int(response_length)
        self.max_context = int(max_context)
        self.vocab = len(text.tokenizer)

    def check(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise ValueError("generate: prompt_ids is empty")
        if len(prompt_ids) > self.max_context:
            raise ValueError(f"generate: a context of {len(prompt_ids)} tokens is longer than the engine's "
                             f"{self.max_context} (the rollout's prompt bound)")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab:
            raise ValueError(f"generate: prompt_ids hold ids outside the vocabulary [0, {self.vocab})")


class EngineServer(_Checked):
    """Async mode: each request goes to the worker's continuous-batching engine (AsyncEngine) on its own."""

    def __init__(self, engine: Any, text: TokenText, call_seed: int, response_length: int, max_context: int) -> None:
        super().__init__(text, response_length, max_context)
        self.engine = engine
        self.call_seed = call_seed
        self._requests: Counter[int] = Counter()   # requests made per row (the default seed)
        self._previous: dict[str, Any] = {}         # a request id's last completion (the engine's `follows`)

    def begin(self) -> None:
        pass

    def end(self) -> None:
        pass

    async def request(self, row: int, request_id: str, prompt_ids: list[int], params: dict[str, Any]) -> Any:
        from verl.experimental.agent_loop.agent_loop import TokenOutput

        self.check(prompt_ids)
        nth = self._requests[row]
        self._requests[row] += 1
        seed = int(params["seed"]) if params.get("seed") is not None else request_seed(self.call_seed, row, nth)
        completion = await self.engine.generate(prompt_ids, seed=seed,
                                                max_tokens=_max_tokens(params, self.response_length),
                                                follows=self._previous.get(request_id))
        self._previous[request_id] = completion
        ids, log_probs = cut_at_stop(self.text, list(completion.token_ids), completion.log_probs, params.get("stop") or ())
        return TokenOutput(token_ids=ids, log_probs=log_probs)


class BatchedServer(_Checked):
    """Sync mode: the requests of every running row are sent together, one `generate_sequences` call per
    round (per stop-string set): a round is sent once every running row waits on the engine."""

    def __init__(self, generate: Callable[[list[list[int]], dict], tuple[list[list[int]], Any]], meta: dict[str, Any],
                 text: TokenText, response_length: int, max_context: int) -> None:
        super().__init__(text, response_length, max_context)
        self._generate = generate
        self._meta = meta
        self._live = 0
        self._pending: list[tuple[list[int], int, tuple[str, ...], asyncio.Future]] = []
        self._flushing = False
        self.generate_s = 0.0
        self.calls = 0

    def begin(self) -> None:
        self._live += 1

    def end(self) -> None:
        self._live -= 1
        self._maybe_flush()

    async def request(self, row: int, request_id: str, prompt_ids: list[int], params: dict[str, Any]) -> Any:
        self.check(prompt_ids)
        future = asyncio.get_running_loop().create_future()
        stop = tuple(params.get("stop") or ())
        self._pending.append((prompt_ids, _max_tokens(params, self.response_length), stop, future))
        self._maybe_flush()
        return await future

    def _maybe_flush(self) -> None:
        if self._pending and not self._flushing and len(self._pending) >= self._live:
            self._flushing = True
            asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        from verl.experimental.agent_loop.agent_loop import TokenOutput

        pending, self._pending = self._pending, []
        try:
            for stop in dict.fromkeys(p[2] for p in pending):
                group = [p for p in pending if p[2] == stop]
                meta = {**self._meta, K.META_RESPONSE_LENGTH: max(p[1] for p in group), K.META_STOP: list(stop)}
                start = time.perf_counter()
                try:
                    sampled, log_probs = await asyncio.to_thread(self._generate, [p[0] for p in group], meta)
                except Exception as err:   # the engine's failure is every waiting row's
                    for p in group:
                        p[3].set_exception(err)
                    continue
                finally:
                    self.generate_s += time.perf_counter() - start
                    self.calls += 1
                for k, (_, max_tokens, _, future) in enumerate(group):
                    ids = list(sampled[k])[:max_tokens]
                    lps = None if log_probs is None else list(log_probs[k])[: len(ids)]
                    ids, lps = cut_at_stop(self.text, ids, lps, stop)
                    future.set_result(TokenOutput(token_ids=ids, log_probs=lps))
        finally:
            self._flushing = False
            self._maybe_flush()


# --- the protocol loops ----------------------------------------------------------------------------


class _ServerEngine:
    """AsyncAgentLoop's engine (`generate(context, seed, max_tokens, follows)`) over a row's server_manager."""

    def __init__(self, server_manager: Any, request_id: str, sampling_params: dict, stop: Sequence[str]) -> None:
        self.server_manager = server_manager
        self.request_id = request_id
        self.sampling_params = dict(sampling_params)
        self.stop = list(stop)

    async def generate(self, context: list[int], seed: int, max_tokens: int | None = None, follows: Any = None) -> Any:
        from verl.workers.rollout.async_engine import Completion

        out = await self.server_manager.generate(
            request_id=self.request_id, prompt_ids=context,
            sampling_params={**self.sampling_params, "seed": seed, "max_tokens": max_tokens, "stop": self.stop})
        return Completion(token_ids=list(out.token_ids), log_probs=out.log_probs)


async def run_protocol_row(loop: Any, protocol: str, sampling_params: dict, kwargs: dict) -> Any:
    """A protocol loop's `run`: the generation manager's trajectory for this row, as an AgentLoopOutput
    that carries the row record itself (so the rollout's statistics are the manager's)."""
    from search_r1.llm_agent.row_outputs import num_turns
    from verl.experimental.agent_loop.agent_loop import AgentLoopOutput

    server_manager = loop.server_manager
    context = getattr(server_manager, "context", None)
    if not isinstance(context, RolloutContext):
        raise TypeError(f"agent loop {PROTOCOL_LOOPS[protocol]!r} runs inside this project's rollout only")
    manager = context.manager
    row = _Row(prompt_ids=[int(t) for t in kwargs["raw_prompt_ids"]])
    row.tools_kwargs = tools_kwargs_of(kwargs.get(K.EXTRA_INFO) or {})
    row.interaction_kwargs = dict(kwargs.get("interaction_kwargs") or {})
    if row.interaction_kwargs:   # the conversation an interaction is shown starts with the row's messages
        row.messages = [dict(m) for m in (kwargs.get(K.RAW_PROMPT) or [])]
    engine = _ServerEngine(server_manager, row.request_id, sampling_params, manager.config.stop)
    stats = await AsyncAgentLoop(manager, engine, context.client, context.eos_token_ids).trajectory(
        row, server_manager.row_index, context.call_seed)
    ids, mask = row.response()
    return AgentLoopOutput(prompt_ids=list(row.prompt_ids), response_ids=ids, response_mask=mask,
                           response_logprobs=row.response_log_probs(), num_turns=num_turns(row),
                           extra_fields={"tool_rewards": list(row.tool_rewards), "turn_scores": list(row.turn_scores),
                                         ROW_KEY: row, STATS_KEY: stats})


# --- running the loops -----------------------------------------------------------------------------


def _segments(ids: list[int], mask: list[int]) -> list[tuple[list[int], list[int], int]]:
    """(policy ids, environment ids, start of the policy run) of each turn, from the response mask."""
    turns: list[tuple[list[int], list[int], int]] = []
    for position, (tok, m) in enumerate(zip(ids, mask, strict=True)):
        if m == 1 and (not turns or turns[-1][1]):
            turns.append(([], [], position))
        elif not turns:
            turns.append(([], [], position))
        (turns[-1][0] if m == 1 else turns[-1][1]).append(tok)
    return turns


class AgentLoopRunner:
    """Runs each row's agent loop; returns the rows as the rollout composes them, and their counters."""

    def __init__(self, tokenizer: Any, manager: LLMGenerationManager) -> None:
        from omegaconf import OmegaConf

        from verl.experimental.agent_loop import load_agent_loop_config

        self.tokenizer = tokenizer
        self.manager = manager
        self.config = manager.config
        if self.config.agent_loop_config_path:
            load_agent_loop_config(self.config.agent_loop_config_path)
        self.trainer_config = OmegaConf.create(self.config.trainer_config or {})
        self.vocab = len(tokenizer)
        self.bound = response_bound(self.config)

    def _classes(self, names: Sequence[str]) -> dict[str, tuple[type, dict]]:
        from verl.experimental.agent_loop import agent_loop_class

        classes = {}
        for name in dict.fromkeys(names):
            protocol = next((p for p, loop in PROTOCOL_LOOPS.items() if loop == name), None)
            if protocol is not None and protocol != self.config.protocol:
                raise ValueError(f"agent loop {name!r} runs the {protocol} protocol, this run the "
                                 f"{self.config.protocol} protocol (actor_rollout_ref.rollout.multi_turn.enable "
                                 f"{'true' if protocol == 'tool' else 'false'} runs it)")
            classes[name] = agent_loop_class(name)
        return classes

    async def run(self, server: Any, prompts: Sequence[list[int]], fields: Sequence[dict], sampling_params: dict,
                  client: Any, eos: frozenset[int], call_seed: int) -> tuple[list[_Row], list[Counter[str]]]:
        from verl.experimental.agent_loop import DictConfigWrap

        context = RolloutContext(manager=self.manager, client=client, eos_token_ids=eos, call_seed=call_seed)
        names = [loop_name(self.config, f) for f in fields]
        classes = self._classes(names)
        data_config = self.trainer_config.get("data", None) or {}

        async def one(i: int) -> tuple[_Row, Counter[str]]:
            stats: Counter[str] = Counter()
            cls, extra = classes[names[i]]
            server.begin()
            try:
                loop = cls(trainer_config=DictConfigWrap(self.trainer_config),
                           server_manager=RowServerManager(server, context, i), tokenizer=self.tokenizer,
                           processor=None, dataset_cls=None, dataset_config=DictConfigWrap(data_config), **extra)
                output = await loop.run(dict(sampling_params), **self._row_kwargs(prompts[i], fields[i], names[i]))
                row, stats = self._to_row(output, names[i], stats)
            except Exception as err:   # noqa: BLE001 - a loop's failure is its row's, counted, never the batch's
                row = _Row(prompt_ids=list(prompts[i]))
                row.stop_reason = actions.AGENT_LOOP
                stats["row_errors"] += 1
                stats[f"row_errors/{type(err).__name__}"] += 1
                logger.error("agent loop %r failed for row %d (%s: %s); the row keeps its prompt, with no response",
                             names[i], i, type(err).__name__, err, exc_info=err)
            finally:
                server.end()
            row.agent_name = names[i]
            stats[f"agent_loop/{names[i]}/rows"] += 1
            return row, stats

        results = await asyncio.gather(*(one(i) for i in range(len(prompts))))
        return [row for row, _ in results], [stats for _, stats in results]

    @staticmethod
    def _row_kwargs(prompt_ids: list[int], fields: dict, name: str) -> dict[str, Any]:
        """The keywords of a loop's run (veRL's: the row's fields, tools_kwargs and interaction_kwargs
        taken up from extra_info), plus `raw_prompt_ids`: the prompt as the dataset tokenized it."""
        info = fields.get(K.EXTRA_INFO) if isinstance(fields.get(K.EXTRA_INFO), dict) else {}
        kwargs = {**fields, K.AGENT_NAME: name, "raw_prompt_ids": list(prompt_ids)}
        kwargs.setdefault("tools_kwargs", dict(info.get("tools_kwargs") or {}))
        kwargs.setdefault("interaction_kwargs", dict(info.get("interaction_kwargs") or {}))
        return kwargs

    def _to_row(self, output: Any, name: str, stats: Counter[str]) -> tuple[_Row, Counter[str]]:
        from verl.experimental.agent_loop.agent_loop import AgentLoopOutput

        if not isinstance(output, AgentLoopOutput):
            raise TypeError(f"agent loop {name!r} returned {type(output).__name__}, not an AgentLoopOutput")
        extra = dict(output.extra_fields)
        row = extra.pop(ROW_KEY, None)
        if row is not None:                      # a protocol loop: the manager's own record
            return row, extra.pop(STATS_KEY, None) or stats
        prompt, ids, mask = list(output.prompt_ids), list(output.response_ids), list(output.response_mask)
        lps = None if output.response_logprobs is None else [float(x) for x in output.response_logprobs]
        if len(ids) != len(mask) or (lps is not None and len(lps) != len(ids)):
            raise ValueError(f"agent loop {name!r}: response_ids ({len(ids)}), response_mask ({len(mask)}) and "
                             f"response_logprobs ({'-' if lps is None else len(lps)}) differ in length")
        if any(m not in (0, 1) for m in mask):
            raise ValueError(f"agent loop {name!r}: response_mask holds values other than 0 and 1")
        if not prompt or len(prompt) > self.config.max_start_length:
            raise ValueError(f"agent loop {name!r}: a prompt of {len(prompt)} tokens (1 to "
                             f"{self.config.max_start_length}, the initial prompt's bound)")
        if any(not 0 <= int(t) < self.vocab for t in prompt + ids):
            raise ValueError(f"agent loop {name!r}: token ids outside the vocabulary [0, {self.vocab})")
        if len(ids) > self.bound:
            ids, mask, lps = ids[: self.bound], mask[: self.bound], None if lps is None else lps[: self.bound]
            stats["agent_loop_truncated"] += 1
        row = _Row(prompt_ids=[int(t) for t in prompt])
        for policy, env, start in _segments([int(t) for t in ids], mask):
            row.append_turn(policy, env, None if lps is None else lps[start: start + len(policy)])
            row.n_turns += int(bool(policy))
        row.n_valid_actions = row.n_turns
        row.stop_reason = actions.AGENT_LOOP
        row.tool_rewards = [float(r) for r in extra.pop("tool_rewards", None) or []]
        row.turn_scores = [float(r) for r in extra.pop("turn_scores", None) or []]
        row.reward_scores = {str(k): float(v) for k, v in (extra.pop("reward_scores", None) or {}).items()}
        row.reward_score = None if output.reward_score is None else float(output.reward_score)
        row.reported_turns = int(output.num_turns) if output.num_turns else None
        row.extra_fields = extra
        kept = sum(mask)
        stats["generated_tokens"] += kept
        stats["kept_tokens"] += kept
        return row, stats


def run_agent_loops_sync(manager: LLMGenerationManager, gen_batch: Any, rows: list[_Row], prompts: torch.Tensor,
                         prompt_mask: torch.Tensor, meta: dict[str, Any]) -> Any:
    """Sync mode with loops other than the protocol's: every row's loop as a coroutine in this process,
    their engine requests gathered into one `generate_sequences` call per round (BatchedServer)."""
    config = manager.config
    if manager.turn_version is not None:
        raise ValueError("a partial rollout (actor_rollout_ref.rollout.partial) brings new weights between the "
                         "protocol's turns, which agent loops of your own do not expose: use the protocol's own "
                         "loop or set rollout.partial=false")
    fields = row_fields(gen_batch, len(rows))
    server = BatchedServer(manager._generate, meta, manager.text, config.max_response_length, config.max_prompt_length)

    async def main() -> tuple[list[_Row], list[Counter[str]]]:
        client = None
        if config.search_url:
            from search_r1.search.serve_client import open_async_retrieval_client

            client = open_async_retrieval_client(config.search_url, topk=config.topk, timeout=config.retrieval_timeout,
                                                 max_retries=config.retrieval_max_retries,
                                                 pool_size=config.retrieval_concurrency)
        try:
            return await AgentLoopRunner(manager.tokenizer, manager).run(
                server, [row.prompt_ids for row in rows], fields, loop_sampling_params(meta), client,
                eos_token_ids(meta), call_seed=0)
        finally:
            if client is not None:
                await client.aclose()

    start = time.perf_counter()
    done, per_row = asyncio.run(main())
    wall = time.perf_counter() - start
    stats: Counter[str] = Counter()
    for counts in per_row:
        stats.update(counts)
    timing = {"generate": wall, "retrieval": stats.pop("retrieval_ms", 0) / 1000.0 / max(1, len(done))}
    prompts, prompt_mask = prompts_of(done, prompts, prompt_mask, manager.tokenizer.pad_token_id)
    output = manager._compose_final_output(done, prompts, prompt_mask, stats, timing)
    attach_row_outputs(output, done)
    return output


class AgentLoopGenerationManager(LLMGenerationManager):
    """The generation manager the trainer uses: rows whose loop is the protocol's own roll out as
    LLMGenerationManager rolls them out (sync: batched turns; async: the workers' coroutines, which run
    any loop, `run_worker_shard`); a sync rollout with other loops runs every row's loop here."""

    def run_llm_loop(self, gen_batch: Any, initial_input_ids: torch.Tensor) -> Any:
        fields = row_fields(gen_batch, int(initial_input_ids.shape[0]))
        if self.config.mode == "async" or not uses_agent_loops(self.config, fields):
            return super().run_llm_loop(gen_batch, initial_input_ids)
        rows, prompt_mask = self._initial_rows(gen_batch, initial_input_ids)
        meta = self._generation_meta(gen_batch)
        self._log_probs_match_actor = True
        with self._engines_awake():
            return run_agent_loops_sync(self, gen_batch, rows, initial_input_ids.long(), prompt_mask, meta)


def run_worker_shard(tokenizer: Any, config: Any, step_engine_for: Callable[[dict], Any], meta: dict[str, Any],
                     prompts: Sequence[list[int]], call_seed: int, eos: frozenset[int], fields: Sequence[dict]
                     ) -> tuple[list[_Row], list[Counter[str]], int]:
    """A rollout worker's async shard (`generate_trajectories`): the protocol's coroutines
    (async_generation.run_shard) when every row uses the protocol's loop, else every row's loop. The
    engine then runs without the protocol's stop strings (a request's own `stop` is cut by position; a
    protocol row is cut at its action as always, only the decoding past it is spent)."""
    if not uses_agent_loops(config, fields):
        return run_shard(tokenizer, config, step_engine_for(meta), prompts, call_seed, eos, fields)
    from verl.workers.rollout.async_engine import AsyncEngine

    manager = LLMGenerationManager(tokenizer, None, config)
    step_engine = step_engine_for({**meta, K.META_STOP: []})

    async def main() -> tuple[list[_Row], list[Counter[str]], int]:
        engine = AsyncEngine(step_engine)
        client = None
        if config.search_url:
            from search_r1.search.serve_client import open_async_retrieval_client

            client = open_async_retrieval_client(config.search_url, topk=config.topk, timeout=config.retrieval_timeout,
                                                 max_retries=config.retrieval_max_retries,
                                                 pool_size=config.retrieval_concurrency)
        try:
            server = EngineServer(engine, manager.text, call_seed, config.max_response_length, config.max_prompt_length)
            rows, stats = await AgentLoopRunner(tokenizer, manager).run(
                server, [list(p) for p in prompts], list(fields), loop_sampling_params(meta), client, eos, call_seed)
        finally:
            if client is not None:
                await client.aclose()
        return rows, stats, engine.steps

    return asyncio.run(main())


__all__ = ["PROTOCOL_LOOPS", "AgentLoopGenerationManager", "AgentLoopRunner", "BatchedServer", "EngineServer",
           "RolloutContext", "RowServerManager", "cut_at_stop", "loop_name", "loop_sampling_params", "response_bound",
           "run_agent_loops_sync", "run_protocol_row", "run_worker_shard", "uses_agent_loops"]
