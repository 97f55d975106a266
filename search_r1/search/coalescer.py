"""Coalesce concurrent search requests into one batched encode + search.

During RL rollouts hundreds of trajectories each ask for one query at about the same
time. Encoding them one by one wastes the encoder (and the GPU); this batcher waits a
short, bounded time (``max_wait_s``, or until ``max_batch_queries`` queries are queued),
runs ONE ``search_fn`` call for every queued query in a worker thread, and answers each
request with its own slice, in order. While a batch runs, the next one fills up, so
the wait only costs latency when the server is idle.

With ``enabled=False`` every request is searched alone (the baseline the benchmark
compares against); both modes share one worker thread so the comparison is fair.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from search_r1.search.schema import Hit

SearchFn = Callable[[list[str], int], list[list[Hit]]]


@dataclass
class _Pending:
    queries: list[str]
    topk: int
    future: asyncio.Future


@dataclass
class CoalescerStats:
    """Counters exposed on /health."""

    requests: int = 0
    queries: int = 0
    searches: int = 0
    searched_queries: int = 0
    largest_batch: int = 0
    errors: int = 0

    def as_dict(self) -> dict[str, float]:
        return {
            "requests": self.requests,
            "queries": self.queries,
            "searches": self.searches,
            "searched_queries": self.searched_queries,
            "largest_batch": self.largest_batch,
            "mean_batch": self.searched_queries / self.searches if self.searches else 0.0,
            "errors": self.errors,
        }


class Coalescer:
    """Asyncio front for a blocking ``search_fn``; call ``start`` inside the running loop."""

    def __init__(
        self,
        search_fn: SearchFn,
        enabled: bool = True,
        max_wait_s: float = 0.005,
        max_batch_queries: int = 512,
    ) -> None:
        if max_wait_s < 0 or max_batch_queries < 1:
            raise ValueError(
                f"max_wait_s must be >= 0 and max_batch_queries >= 1, got {max_wait_s}, {max_batch_queries}"
            )
        self.search_fn = search_fn
        self.enabled = enabled
        self.max_wait_s = max_wait_s
        self.max_batch_queries = max_batch_queries
        self.stats = CoalescerStats()
        # One thread: searches never run concurrently, so torch/FAISS get all cores.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="search")
        self._queue: asyncio.Queue[_Pending] | None = None
        self._task: asyncio.Task | None = None
        self._last_search_s = max_wait_s

    async def start(self) -> None:
        if self.enabled and self._task is None:
            self._queue = asyncio.Queue()
            self._task = asyncio.create_task(self._run(), name="coalescer")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        """Hits for ``queries`` (in order), possibly computed together with other requests."""
        self.stats.requests += 1
        self.stats.queries += len(queries)
        loop = asyncio.get_running_loop()
        if not self.enabled:
            self._record_batch(len(queries))
            started = loop.time()
            try:
                hits = await loop.run_in_executor(self._executor, self.search_fn, queries, topk)
            except Exception:
                self.stats.errors += 1
                raise
            self._last_search_s = loop.time() - started
            return hits
        if self._queue is None:
            raise RuntimeError("Coalescer.start() was not awaited before search()")
        pending = _Pending(queries=queries, topk=topk, future=loop.create_future())
        await self._queue.put(pending)
        return await pending.future

    def drain_time_s(self, pending_queries: int) -> float:
        """About how long `pending_queries` take to search: batches of ``max_batch_queries``
        (one query each without coalescing), each as long as the last search took."""
        per_batch = self.max_batch_queries if self.enabled else 1
        return -(-pending_queries // per_batch) * self._last_search_s

    def _record_batch(self, n: int) -> None:
        self.stats.searches += 1
        self.stats.searched_queries += n
        self.stats.largest_batch = max(self.stats.largest_batch, n)

    async def _collect(self) -> list[_Pending]:
        """Block for one request, then gather more until the wait or size bound is hit."""
        assert self._queue is not None
        batch = [await self._queue.get()]
        n = len(batch[0].queries)
        loop = asyncio.get_running_loop()
        # Waiting longer than a search takes gains nothing: requests arriving meanwhile
        # queue up for the next batch anyway. Cheap searches (BM25 on small corpora) thus wait less.
        deadline = loop.time() + min(self.max_wait_s, self._last_search_s)
        while n < self.max_batch_queries:
            if not self._queue.empty():
                item = self._queue.get_nowait()
            else:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    item = await asyncio.wait_for(self._queue.get(), remaining)
                except asyncio.TimeoutError:  # a distinct class before Python 3.11
                    break
            batch.append(item)
            n += len(item.queries)
        return batch

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._collect()
            # Identical queries (n_agent samples of one prompt often agree) are searched once.
            unique: dict[str, int] = {}
            for pending in batch:
                for q in pending.queries:
                    unique.setdefault(q, len(unique))
            topk = max(p.topk for p in batch)
            self._record_batch(len(unique))
            started = loop.time()
            try:
                hits = await loop.run_in_executor(self._executor, self.search_fn, list(unique), topk)
                self._last_search_s = loop.time() - started
            except Exception as err:
                if len(batch) == 1:
                    self.stats.errors += 1
                    if not batch[0].future.done():
                        batch[0].future.set_exception(err)
                    continue
                # One bad request must not fail the others it was batched with: retry alone.
                for pending in batch:
                    await self._search_alone(pending)
                continue
            for pending in batch:
                if not pending.future.done():  # the client may have gone away
                    # Best-first order makes the top-k of a larger search the top-k answer.
                    pending.future.set_result([hits[unique[q]][: pending.topk] for q in pending.queries])

    async def _search_alone(self, pending: _Pending) -> None:
        loop = asyncio.get_running_loop()
        self._record_batch(len(pending.queries))
        try:
            hits = await loop.run_in_executor(self._executor, self.search_fn, pending.queries, pending.topk)
        except Exception as err:  # answered to this request only; the batcher keeps serving
            self.stats.errors += 1
            if not pending.future.done():
                pending.future.set_exception(err)
            return
        if not pending.future.done():
            pending.future.set_result(hits)
