"""Asynchronous multi-turn rollout: one coroutine per trajectory (`rollout.mode=async`).

Each trajectory runs generate -> cut and parse -> search -> append on its own, against a
continuous-batching engine (`verl.workers.rollout.async_engine.AsyncEngine`) and the
asyncio retrieval client, so a row that searches does not wait for the batch's slowest
generation, and the engine never idles while some rows still have turns to go.

The rules are the sync manager's, called, not copied: the rolling context
(`_context`), the cut at the first action (`_cut_turn`), observations (an `<open>` too), stop rules and the
final no-search turn (`_apply_turn`), and their per-row guards (a row's unexpected exception is
that row's counted error, `row_errors`, never the shard's). Only the order in which rows advance differs; each
row sees exactly what it would see in sync mode. This runs inside each rollout worker on
its shard of rows (`ActorRolloutRefWorker.generate_trajectories`); the driver composes the
batch with the sync manager's `_compose_final_output`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from search_r1.llm_agent.generation import LLMGenerationManager, tools_kwargs_of
from search_r1.llm_agent.trajectory import _Row, _TurnResult
from verl.utils import batch_keys as K

# Request seed = f(call seed, row, turn): what a row samples does not depend on timing.
_ROW_STRIDE = 1_000_003
_TURN_STRIDE = 7_919


def request_seed(call_seed: int, row: int, turn: int) -> int:
    return (int(call_seed) * _ROW_STRIDE + row * _TURN_STRIDE + turn) % (2**63 - 1)


class AsyncAgentLoop:
    """Rolls out every row of a shard as its own coroutine; `run` returns the rows and their counters."""

    def __init__(self, manager: LLMGenerationManager, engine: Any, client: Any | None,
                 eos_token_ids: frozenset[int]) -> None:
        self.manager = manager
        self.engine = engine
        self.client = client
        self.eos_token_ids = eos_token_ids

    async def _act(self, res: _TurnResult, stats: Counter[str], row: _Row | None = None) -> str | list[str]:
        """The observation answering the turn's action; its queries go in one request of this
        trajectory's own, and a failed request becomes an observation (counted). Tool protocol: the
        other tools' calls run concurrently on this event loop, with `row`'s instances."""
        from search_r1.search.client import RetrievalError

        if self.manager._open is not None and res.action.kind == "open":   # the open tag: a blocking call
            return await asyncio.to_thread(self.manager._observation_for, res, [], None, stats)
        queries = list(res.queries)
        hits, error = [], None
        if queries:
            if self.client is None:
                raise ValueError("GenerationConfig.search_url (retriever.url) is required when the policy searches")
            try:
                hits = await self.client.retrieve(queries, topk=self.manager.config.topk, return_scores=True)
            except RetrievalError as err:
                hits, error = None, str(err)
                stats["search_failures"] += self.manager._n_searches(res)
            if hits is not None and len(hits) != len(queries):
                raise ValueError(f"retrieval returned {len(hits)} result lists for {len(queries)} queries")
        others = None
        if self.manager._tool is not None:   # tools other than search: their async execute (blocking ones in threads)
            others = await self.manager._tool.run_calls(res, stats, row)
        return self.manager._observation_for(res, hits, error, stats, others)

    async def trajectory(self, row: _Row, index: int, call_seed: int) -> Counter[str]:
        manager = self.manager
        config = manager.config
        stats: Counter[str] = Counter()
        retrieval_s = 0.0
        previous = None          # this trajectory's last completion: its next request follows it
        if manager._tool is not None:
            await manager._tool.start_row(row, stats)
        interaction = manager._tool.interaction_of(row) if manager._tool is not None else None
        if interaction is not None:
            await interaction.start_interaction(row.request_id, **row.interaction_kwargs)
        for turn in range(manager._turn_limit()):
            is_final = turn == config.max_turns
            row.stop_reason = manager._stop_before_turn(row)
            if not row.active:
                break
            context, cut = self.manager._context(row)
            stats["context_cuts"] += int(cut)
            if cut and row.cut_from < 0:
                row.cut_from = row.response_len
            completion = await self.engine.generate(context, seed=request_seed(call_seed, index, turn),
                                                    max_tokens=manager._response_length([row]), follows=previous)
            previous = completion
            sampled, log_probs = manager._clip_to_budget(row, list(completion.token_ids), completion.log_probs)
            res = manager._limit_calls(row, manager._cut_turn(sampled, self.eos_token_ids, stats))
            observation = None
            if manager._runs_action(row, res, is_final):
                start = time.perf_counter()
                observation = await self._act(res, stats, row)
                retrieval_s += time.perf_counter() - start
            elif interaction is not None and manager._tool.wants_user_turn(row, res):
                reply = await manager._tool.user_reply(interaction, row, res, stats)
                if reply is not None:   # the interaction's user message answers the turn (masked, as a tool's)
                    observation, res = [reply], dataclasses.replace(res, role="user")
            stats["generated_tokens"] += res.generated
            stats["kept_tokens"] += len(res.kept_ids)
            manager._apply_turn(row, res, observation, is_final, stats, log_probs)
            if not row.active:
                break
        if manager._tool is not None:
            await manager._tool.finish_row(row, stats)
        if interaction is not None:
            await interaction.finalize_interaction(row.request_id)
        stats["retrieval_ms"] += round(retrieval_s * 1000)
        return stats

    async def run(self, prompts: Sequence[list[int]], call_seed: int, fields: Sequence[dict] | None = None
                  ) -> tuple[list[_Row], list[Counter[str]]]:
        """`fields`: each row's non-tensor fields (its extra_info.tools_kwargs are its tools' kwargs)."""
        rows = [_Row(prompt_ids=list(ids)) for ids in prompts]
        for row, row_fields in zip(rows, fields or [{}] * len(rows), strict=True):
            row.tools_kwargs = tools_kwargs_of(row_fields.get(K.EXTRA_INFO) or {})
        stats = await asyncio.gather(*(self.trajectory(row, i, call_seed) for i, row in enumerate(rows)))
        return rows, list(stats)


def run_shard(tokenizer: Any, config: Any, step_engine: Any, prompts: Sequence[list[int]], call_seed: int,
              eos_token_ids: frozenset[int], fields: Sequence[dict] | None = None
              ) -> tuple[list[_Row], list[Counter[str]], int]:
    """Worker side: roll out `prompts` with one coroutine each; returns (rows, per-row counters,
    engine steps). `config` is the driver's GenerationConfig; `fields` each row's non-tensor fields
    (generation.row_fields)."""
    from verl.workers.rollout.async_engine import AsyncEngine

    manager = LLMGenerationManager(tokenizer, None, config)

    async def main() -> tuple[list[_Row], list[Counter[str]], int]:
        engine = AsyncEngine(step_engine)
        client = None
        if config.search_url:
            from search_r1.search.serve_client import open_async_retrieval_client

            client = open_async_retrieval_client(config.search_url, topk=config.topk, timeout=config.retrieval_timeout,
                                          max_retries=config.retrieval_max_retries,
                                          pool_size=config.retrieval_concurrency)
        try:
            rows, stats = await AsyncAgentLoop(manager, engine, client, eos_token_ids).run(prompts, call_seed, fields)
        finally:
            if client is not None:
                await client.aclose()
        return rows, stats, engine.steps

    return asyncio.run(main())
