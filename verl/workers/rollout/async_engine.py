"""Continuous batching for the async rollout: requests join and leave the batch between decode steps.

A *step engine* holds the requests in flight and advances every one of them by one token
per `step()`; a request added between two steps joins at the next one, a finished one
leaves at once. `AsyncEngine` puts an asyncio face on it: each trajectory coroutine
awaits `generate(prompt_ids, seed)` and gets its own completion back as soon as it is
done, while the others keep decoding.

    engine = AsyncEngine(rollout.step_engine(params))   # HFRollout or vLLMRollout
    completion = await engine.generate(prompt_ids, seed=1234, max_tokens=100)
    completion.token_ids, completion.log_probs

Each request samples from its own generator seeded by the caller, so what a trajectory
samples does not depend on which other requests shared its decode steps (HF engine) or
on the engine's global RNG (vLLM's per-request seed).

A step engine that says `steps_off_loop = True` (the HF one) is stepped in a worker thread,
so the event loop runs the trajectories' searches while a step decodes: stepped on the loop,
a search's HTTP exchange advanced one loop iteration per decode step, and in the offline
demo a trajectory waited a median 8 and up to 60 decode steps for its search to come back
while the batch decoded without it (docs/rollout.md "Sync and async on a GPU").
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Completion:
    """The ids one request sampled (stop string and EOS included) and each one's log-prob.
    `cohort`: the group of requests it joined the batch with, for engines that batch joins (HF;
    -1 for the others): a trajectory's next request names it (`generate(..., follows=)`)."""

    token_ids: list[int]
    log_probs: list[float]
    cohort: int = -1


def request_max_tokens(request_id: str, max_tokens: int | None, response_length: int) -> int:
    """A request's decode budget: `max_tokens` (the trajectory's remaining budget), at most the
    engine's `response_length`; None: that length."""
    if max_tokens is None:
        return int(response_length)
    if not 1 <= int(max_tokens) <= int(response_length):
        raise ValueError(f"request {request_id}: max_tokens must be in [1, response_length={response_length}], "
                         f"got {max_tokens}")
    return int(max_tokens)


class StepEngine(Protocol):
    """Optionally `steps_off_loop: bool` (default False): its `step` may run in another thread
    (it touches nothing the event loop's coroutines touch; add/abort are called between steps).
    An engine whose completions carry a cohort (>= 0) also takes `add(..., after_cohort=c)`."""

    # max_tokens: this request's decode budget (None: the engine's response_length; see request_max_tokens).
    def add(self, request_id: str, prompt_ids: Sequence[int], seed: int, max_tokens: int | None = None) -> None: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[tuple[str, Completion]]: ...

    def abort(self, request_ids: Sequence[str]) -> None: ...


class AsyncEngine:
    """One asyncio task steps the engine while any request is in flight; requests submitted
    while a step runs are admitted before the next one."""

    def __init__(self, engine: StepEngine) -> None:
        self.engine = engine
        self._pending: list[tuple[str, list[int], int, int | None, int]] = []
        self._futures: dict[str, asyncio.Future[Completion]] = {}
        self._ids = itertools.count()
        self._runner: asyncio.Task[None] | None = None
        self.steps = 0

    async def generate(self, prompt_ids: Sequence[int], seed: int, max_tokens: int | None = None,
                       follows: Completion | None = None) -> Completion:
        """The request's completion: at most `max_tokens` ids (None: the engine's response_length).
        `follows`: the completion this request continues (its trajectory's previous turn), so an
        engine that batches joins can let it in once its own cohort is done, as sync mode would."""
        request_id = str(next(self._ids))
        future: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        self._futures[request_id] = future
        self._pending.append((request_id, list(prompt_ids), int(seed), max_tokens,
                              -1 if follows is None else follows.cohort))
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._run())
        return await future

    async def _run(self) -> None:
        off_loop = bool(getattr(self.engine, "steps_off_loop", False))
        # One thread, so steps never overlap; the engine is only touched between them.
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="step-engine") if off_loop else None
        try:
            while self._pending or self.engine.has_unfinished():
                # Let every trajectory that is ready (a completion just arrived, a search came
                # back) submit its next request, so it joins this step rather than the next.
                await asyncio.sleep(0)
                pending, self._pending = self._pending, []
                for request_id, prompt_ids, seed, max_tokens, cohort in pending:
                    if cohort >= 0:
                        self.engine.add(request_id, prompt_ids, seed, max_tokens=max_tokens, after_cohort=cohort)
                    else:
                        self.engine.add(request_id, prompt_ids, seed, max_tokens=max_tokens)
                if not self.engine.has_unfinished():
                    continue
                if executor is None:
                    finished = self.engine.step()
                else:
                    finished = await asyncio.wrap_future(executor.submit(self.engine.step))
                self.steps += 1
                for request_id, completion in finished:
                    self._futures.pop(request_id).set_result(completion)
        except Exception as err:  # every waiting trajectory hears of it (and re-raises it)
            self._fail_all(err)
        except asyncio.CancelledError:
            if executor is not None:
                executor.shutdown(wait=True)    # the step in flight ends before its requests are aborted
            self._fail_all(None)
            raise
        finally:
            if executor is not None:
                executor.shutdown(wait=False)

    def _fail_all(self, err: Exception | None) -> None:
        """Fail (or, for None, cancel) every request still waiting, and abort them in the engine so
        a later call on the same engine does not find them still decoding."""
        in_flight = [request_id for request_id, future in self._futures.items() if not future.done()]
        if in_flight:
            try:
                self.engine.abort(in_flight)
            except Exception:  # the original failure is what the callers must hear about
                logger.exception("aborting %d in-flight requests failed", len(in_flight))
        for future in self._futures.values():
            if future.done():
                continue
            if err is None:
                future.cancel()
            else:
                future.set_exception(err)
        self._futures.clear()
        self._pending.clear()
