"""The rollout engine as the endpoint calls it: `await generate(prompt_ids, max_tokens, seed, follows)`.

- `StepEngineClient` (rollout.mode=async): the async rollout's continuous batching
  (`verl.workers.rollout.async_engine.AsyncEngine` over the HF or vLLM step engine), one request per
  completion, each with its own seed and decode budget; `follows` lets the HF engine batch a session's
  next request as it batches a trajectory's next turn.
- `BatchedClient` (rollout.mode=sync): requests gathered into one `generate_sequences` call of the
  worker group, sent when every running agent is waiting for a completion (or when none arrived for
  `linger_s`); the call's length is the largest budget among them, and each completion is cut to its
  own budget by position afterwards (what a row sampled past it is dropped), as the sync manager does.

Both return `Completion(token_ids, log_probs)`: the engine's ids, EOS and stop text included.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from verl.workers.rollout.async_engine import AsyncEngine, Completion


class EngineClient(Protocol):
    response_length: int          # the most tokens one request may sample

    async def generate(self, prompt_ids: Sequence[int], max_tokens: int, seed: int,
                       follows: Completion | None = None) -> Completion: ...


class StepEngineClient:
    """An `AsyncEngine` over a step engine (`rollout.step_engine(meta)`); created and used on one event loop."""

    steps_local_engine = True     # the endpoint's loop steps this process's engine (serve_endpoint's shutdown)

    def __init__(self, step_engine: Any, response_length: int) -> None:
        self.engine = AsyncEngine(step_engine)
        self.response_length = int(response_length)

    async def generate(self, prompt_ids: Sequence[int], max_tokens: int, seed: int,
                       follows: Completion | None = None) -> Completion:
        return await self.engine.generate(list(prompt_ids), seed=seed, max_tokens=max_tokens, follows=follows)


@dataclass
class _Waiting:
    prompt_ids: list[int]
    max_tokens: int
    future: asyncio.Future


@dataclass
class BatchedClient:
    """Requests of many sessions as one blocking batch call a wave (sync mode).

    `generate_batch(prompts, response_length) -> (sampled ids, log-probs or None)` runs in a thread;
    `running()` says how many agents are still running (a wave is sent once that many are waiting)."""

    generate_batch: Callable[[list[list[int]], int], tuple[list[list[int]], list[list[float]] | None]]
    response_length: int
    running: Callable[[], int]
    # A wave runs on the workers' engines: a wave still running at shutdown holds the endpoint's thread
    # (its executor) but steps nothing here; serve_endpoint warns instead of raising.
    steps_local_engine = False
    linger_s: float = 0.05
    calls: int = 0
    _queue: list[_Waiting] = field(default_factory=list)
    _dispatcher: asyncio.Task | None = None
    _last_arrival: float = 0.0

    async def generate(self, prompt_ids: Sequence[int], max_tokens: int, seed: int,
                       follows: Completion | None = None) -> Completion:
        future = asyncio.get_running_loop().create_future()
        self._queue.append(_Waiting(list(prompt_ids), int(max_tokens), future))
        self._last_arrival = time.monotonic()
        if self._dispatcher is None or self._dispatcher.done():
            self._dispatcher = asyncio.create_task(self._dispatch())
        return await future

    async def _dispatch(self) -> None:
        while self._queue:
            while len(self._queue) < max(1, self.running()) and time.monotonic() - self._last_arrival < self.linger_s:
                await asyncio.sleep(self.linger_s / 5)
            wave, self._queue = self._queue, []
            length = max(w.max_tokens for w in wave)
            try:
                sampled, log_probs = await asyncio.to_thread(self.generate_batch, [w.prompt_ids for w in wave], length)
                self.calls += 1
            except Exception as err:  # noqa: BLE001 - every request of the wave hears of it
                for w in wave:
                    if not w.future.done():
                        w.future.set_exception(err)
                continue
            for k, w in enumerate(wave):
                ids = list(sampled[k][: w.max_tokens])
                lps = list(log_probs[k][: len(ids)]) if log_probs is not None else [0.0] * len(ids)
                if not w.future.done():
                    w.future.set_result(Completion(ids, lps))


__all__ = ["BatchedClient", "EngineClient", "StepEngineClient"]
