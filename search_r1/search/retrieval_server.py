"""The retrieval server: FastAPI over a dense (FAISS) or BM25 retriever.

HTTP contract (DESIGN §3.1, unchanged from the original Search-R1 so its clients work):
``POST /retrieve {"queries": [...], "topk": k, "return_scores": bool}`` ->
``{"result": [[hit, ...], ...]}``; ``GET /health``.

Differences from the original: concurrent requests are coalesced into one batched
search (``coalescer.Coalescer``; ``--no_coalesce`` turns it off), repeated
(query, topk) pairs are answered from an LRU cache, every request is checked against
``ServerLimits`` (4xx with a message, never a crash; an over-long query is truncated, not
refused: dense to ``--max_length`` tokens as the original's encoder did, BM25 to
``--max_query_chars`` characters), at most ``--max_pending_queries`` queries wait for a
search (beyond it: 503 at once, with ``Retry-After``, which both clients honour), and it
binds 127.0.0.1 by default.

    python -m search_r1.search.retrieval_server --index_path index/bm25 \\
        --corpus_path example/corpus.jsonl --retriever_name bm25 --topk 3
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import random
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import asynccontextmanager, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __name__ == "__main__" and not __package__:
    # Run as a file, as the original's `python search_r1/search/<script>.py ...` did:
    # make the repository root importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

if "torch" not in sys.modules:
    # The encoder (torch) and the index (FAISS) each bring an OpenMP runtime whose idle threads
    # spin by default; with more than one thread they spin against each other and against the
    # event loop. Measured on 2 cores, 2 threads, 5k passages, MiniLM: one 128-query request
    # 26 q/s spinning vs 199 q/s passive (docs/retriever.md "Throughput"). Must precede the
    # first import of torch; an explicit OMP_WAIT_POLICY wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse  # noqa: E402

from search_r1.search.coalescer import Coalescer  # noqa: E402
from search_r1.search.corpus import IdIndex  # noqa: E402
from search_r1.search.documents import paginate, snippet  # noqa: E402
from search_r1.search.retrievers import BaseRetriever, build_retriever  # noqa: E402
from search_r1.search.schema import (  # noqa: E402
    Hit,
    OpenRequest,
    RetrieveRequest,
    ServerLimits,
    quote_id,
    validate_request,
)
from search_r1.search.serving import configure_logging, install_request_errors, read_json_body  # noqa: E402

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class ServerConfig:
    """Serving behaviour, independent of which retriever answers."""

    default_topk: int = 3
    limits: ServerLimits = field(default_factory=ServerLimits)
    coalesce: bool = True
    max_wait_ms: float = 5.0
    max_batch_queries: int = 512
    cache_size: int = 10_000
    # Queries waiting for or in a search; a request that would pass it is answered 503 + Retry-After
    # at once (0: no bound). A request alone on an idle server is always searched.
    max_pending_queries: int = 16_384
    # Added to every /retrieve answer, to emulate a web-search API's latency in benchmarks (off: 0):
    # a fixed delay plus a uniform random one in [0, jitter).
    simulate_latency_ms: float = 0.0
    simulate_latency_jitter_ms: float = 0.0
    # Search results as snippets (0: off, the whole passage, byte for byte): each hit's `contents`
    # is its title line and the first line of its text cut to this many characters
    # (documents.snippet); POST /open still returns the whole passage. The browse demo's setting.
    snippet_chars: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.default_topk <= self.limits.max_topk:
            raise ValueError(f"default_topk must be in [1, max_topk={self.limits.max_topk}], got {self.default_topk}")
        if self.cache_size < 0:
            raise ValueError(f"cache_size must be >= 0, got {self.cache_size}")
        if self.max_pending_queries < 0:
            raise ValueError(f"max_pending_queries must be >= 0 (0: no bound), got {self.max_pending_queries}")
        if self.simulate_latency_ms < 0 or self.simulate_latency_jitter_ms < 0:
            raise ValueError("simulate_latency_ms and simulate_latency_jitter_ms must be >= 0, got "
                             f"{self.simulate_latency_ms} and {self.simulate_latency_jitter_ms}")
        if not isinstance(self.snippet_chars, int) or self.snippet_chars < 0:
            raise ValueError(f"snippet_chars must be an integer >= 0 (0: whole passages), got {self.snippet_chars!r}")


class ServerOverloaded(Exception):
    """More queries pending than ``max_pending_queries``: answered 503 with ``Retry-After``."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s


class BacklogClock:
    """How long a client turned away now should wait: the queries ahead of it (pending, plus those
    turned away in the last ``window_s``, who come back too) over the rate the server can answer.

    That rate is the highest answered-per-second seen in a ``window_s`` window, decaying with a
    ``half_life_s`` of time in which the server answered something (an idle stretch, e.g. a trainer's
    update between two rollouts, does not wear it down): the rate seen now alone falls as soon as the
    turned-away clients wait, and the waits it gives then grow without bound (1,000 clients, a bound
    of 8 behind Ray Serve's proxy: p99 135 s). 0 before anything was answered (no rate to go by: the
    caller's estimate decides). Time comes from ``clock`` (tests pass their own)."""

    def __init__(self, window_s: float = 1.0, max_wait_s: float = 60.0, half_life_s: float = 30.0,
                 clock: Any = time.monotonic) -> None:
        self.window_s, self.max_wait_s, self.half_life_s, self.clock = window_s, max_wait_s, half_life_s, clock
        self._answered: deque[tuple[float, int]] = deque()
        self._turned_away: deque[tuple[float, int]] = deque()
        self._peak_rate, self._peak_at = 0.0, clock()

    def answered(self, n: int) -> None:
        self._add(self._answered, n)

    def turned_away(self, n: int) -> None:
        self._add(self._turned_away, n)

    def rate(self) -> float:
        """The decaying peak of queries answered per second."""
        now = self.clock()
        current = self._total(self._answered, now) / self.window_s
        decayed = self._peak_rate * 0.5 ** ((now - self._peak_at) / self.half_life_s) if current > 0 else self._peak_rate
        self._peak_rate, self._peak_at = max(decayed, current), now
        return self._peak_rate

    def wait_s(self, pending: int) -> float:
        rate = self.rate()
        ahead = pending + self._total(self._turned_away, self.clock())
        return 0.0 if rate <= 0 else min(self.max_wait_s, ahead / rate)

    def _add(self, events: deque[tuple[float, int]], n: int) -> None:
        now = self.clock()
        events.append((now, n))
        self._total(events, now)   # drop what left the window: the deques stay bounded over a run

    def _total(self, events: deque[tuple[float, int]], now: float) -> int:
        while events and events[0][0] < now - self.window_s:
            events.popleft()
        return sum(n for _, n in events)


class HitCache:
    """LRU of (query, topk) -> hits; lives on the event loop, so no lock is needed."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[tuple[str, int], list[Hit]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, query: str, topk: int) -> list[Hit] | None:
        key = (query, topk)
        found = self._items.get(key)
        if found is None:
            self.misses += 1
            return None
        self._items.move_to_end(key)
        self.hits += 1
        return found

    def put(self, query: str, topk: int, hits: list[Hit]) -> None:
        if self.capacity == 0:
            return
        self._items[(query, topk)] = hits
        self._items.move_to_end((query, topk))
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)


class RetrievalService:
    """Cache in front of the coalescer in front of the retriever."""

    def __init__(self, retriever: BaseRetriever, config: ServerConfig) -> None:
        self.retriever = retriever
        self.config = config
        self.cache = HitCache(config.cache_size)
        self.coalescer = Coalescer(
            retriever.search_batch,
            enabled=config.coalesce,
            max_wait_s=config.max_wait_ms / 1000.0,
            max_batch_queries=config.max_batch_queries,
        )
        self.rejected = 0
        self.truncated_queries = 0
        self.pending_queries = 0
        self.overloaded = 0
        self.requests_in_flight = 0
        self.backlog = BacklogClock()
        self._id_index: Future[IdIndex] | None = None

    def id_index(self) -> Future[IdIndex]:
        """The corpus's id -> row map for /open, built in a thread from the first call on (the app's
        start-up makes that call): the event loop never waits on the build, only an /open does."""
        if self._id_index is None:
            self._id_index = IdIndex.build_in_background(self.retriever.corpus)
        return self._id_index

    async def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        delay_ms = self.config.simulate_latency_ms + self.config.simulate_latency_jitter_ms * random.random()
        if delay_ms > 0:
            # an emulated web-search API: every request waits, cached or not, and its queries count as
            # pending meanwhile (a slow backend fills the bound as a slow index does)
            with self._pending(len(queries)):
                await asyncio.sleep(delay_ms / 1000.0)
        results: list[list[Hit] | None] = [self.cache.get(q, topk) for q in queries]
        missing = [i for i, r in enumerate(results) if r is None]
        if missing:
            with self._pending(len(missing)):
                try:
                    found = await self.coalescer.search([queries[i] for i in missing], topk)
                finally:
                    self.backlog.answered(len(missing))
            for i, hits in zip(missing, found, strict=True):
                results[i] = hits
                self.cache.put(queries[i], topk, hits)
        return results  # type: ignore[return-value]

    async def answer(self, body: RetrieveRequest) -> dict:
        """The body of a 200 answer to ``body``; raises ``RequestError`` / ``ServerOverloaded``."""
        valid = validate_request(body, self.config.limits, self.config.default_topk)
        self.truncated_queries += valid.truncated
        self.requests_in_flight += 1
        try:
            results = await self.search(valid.queries, valid.topk)
        finally:
            self.requests_in_flight -= 1
        if self.config.snippet_chars:
            n = self.config.snippet_chars
            results = [[Hit.from_contents(hit.doc_id, snippet(hit.contents, n), hit.score) for hit in hits]
                       for hits in results]
        return {"result": [[hit.to_wire(valid.return_scores) for hit in hits] for hits in results]}

    @contextmanager
    def _pending(self, n: int) -> Iterator[None]:
        """`n` queries admitted (``_admit``) and counted as pending for the block's duration."""
        self._admit(n)
        self.pending_queries += n
        try:
            yield
        finally:
            self.pending_queries -= n

    def _admit(self, n: int) -> None:
        """Refuse `n` more queries when they would pass the bound (never on an idle server)."""
        bound = self.config.max_pending_queries
        if not bound or self.pending_queries == 0 or self.pending_queries + n <= bound:
            return
        self.overloaded += 1
        self.backlog.turned_away(n)
        # The queries ahead of a returning client: those pending and those turned away just now (they
        # come back too), at the rate the server has been answering. Told to come back together, the
        # turned-away clients would find the bound full again (1,000 clients, a bound of 8, 8 retries
        # each through Ray Serve's proxy: 360 of 4,000 requests gave up).
        wait = max(self.coalescer.drain_time_s(self.pending_queries), self.backlog.wait_s(self.pending_queries))
        retry_after = max(1, math.ceil(wait))
        raise ServerOverloaded(
            f"server overloaded: {self.pending_queries} queries pending, {n} more would pass "
            f"max_pending_queries={bound}; retry after {retry_after} s", retry_after)

    def _id_index_state(self) -> dict:
        future = self._id_index
        if future is None or not future.done():
            return {"state": "building" if future else "not started"}
        if future.exception() is not None:
            return {"state": f"failed: {type(future.exception()).__name__}"}
        return {"state": "ready", "duplicate_ids": future.result().num_duplicates}

    def health(self) -> dict:
        return {
            "status": "ok",
            "retriever": self.retriever.kind,
            "corpus_size": len(self.retriever.corpus),
            "default_topk": self.config.default_topk,
            "coalesce": self.config.coalesce,
            "limits": asdict(self.config.limits),
            "max_pending_queries": self.config.max_pending_queries,
            "pending_queries": self.pending_queries,
            "requests_in_flight": self.requests_in_flight,
            "id_index": self._id_index_state(),
            "simulate_latency_ms": [self.config.simulate_latency_ms, self.config.simulate_latency_jitter_ms],
            "counters": {
                **self.coalescer.stats.as_dict(),
                "cache_hits": self.cache.hits,
                "cache_misses": self.cache.misses,
                "rejected": self.rejected,
                "overloaded": self.overloaded,
                "truncated_queries": self.truncated_queries,
            },
        }


def create_app(retriever: BaseRetriever, config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app serving ``retriever``; importable so tests can run it under uvicorn."""
    config = config or ServerConfig()
    service = RetrievalService(retriever, config)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        service.id_index()
        await service.coalescer.start()
        yield
        await service.coalescer.stop()

    app = FastAPI(title="Search-R1 retrieval server", lifespan=lifespan)
    app.state.service = service

    def _count_rejected() -> None:
        service.rejected += 1

    install_request_errors(app, on_reject=_count_rejected)

    @app.exception_handler(ServerOverloaded)
    async def _overloaded(_: Request, err: ServerOverloaded) -> JSONResponse:
        return JSONResponse(status_code=503, content={"detail": err.message},
                            headers={"Retry-After": str(err.retry_after_s)})

    @app.exception_handler(Exception)
    async def _failed(_: Request, err: Exception) -> JSONResponse:
        logger.exception("search failed", exc_info=err)
        return JSONResponse(status_code=500, content={"detail": f"search failed: {type(err).__name__}: {err}"})

    @app.post("/retrieve")
    async def retrieve(request: Request) -> JSONResponse:
        body = await read_json_body(request, RetrieveRequest, config.limits.max_body_bytes)
        return JSONResponse(await service.answer(body))

    @app.get("/health")
    async def health() -> dict:
        return service.health()

    @app.post("/open")
    async def open_document(request: Request) -> JSONResponse:
        """A passage by id, paginated: {"doc_id", "page": 1, "page_size": 2000 characters} ->
        {"id", "title", "text", "page", "num_pages"}; an unknown id is a 404, a bad page a 400."""
        body = await read_json_body(request, OpenRequest, config.limits.max_body_bytes)
        building = service.id_index()
        index = building.result() if building.done() else await asyncio.wrap_future(building)
        row = index.row(body.doc_id)
        if row is None:
            return JSONResponse(status_code=404, content={"detail": f"no document with id {quote_id(body.doc_id)}"})
        contents = retriever.corpus.get_fields([row])[1][0]
        hit = Hit.from_contents(body.doc_id, contents, 0.0)
        try:
            page = paginate(hit.text if hit.title else contents, body.page, body.page_size)
        except ValueError as err:
            return JSONResponse(status_code=400, content={"detail": str(err)})
        return JSONResponse({"id": body.doc_id, "title": hit.title, **page.to_dict()})

    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    """The command line (also what `retriever.server_args` of a Ray Serve application is checked against)."""
    p = argparse.ArgumentParser(description="Serve a retrieval index over HTTP (Search-R1 API).")
    p.add_argument("--index_path", default="./index/bm25", help="FAISS .index file or BM25 folder")
    p.add_argument("--corpus_path", default="./data/corpus.jsonl")
    p.add_argument("--topk", type=int, default=3, help="hits per query when a request gives no topk")
    p.add_argument("--retriever_name", default="e5", help="bm25, e5, bge, or another dense encoder name")
    p.add_argument("--retriever_model", default="intfloat/e5-base-v2", help="encoder name or path (dense)")
    p.add_argument("--faiss_gpu", action="store_true", default=False, help="shard the FAISS index over GPUs")
    p.add_argument("--pooling_method", default="auto", choices=["auto", "mean", "cls", "pooler"])
    p.add_argument("--max_length", type=int, default=256, help="encoder max tokens per query (longer: truncated)")
    p.add_argument(
        "--use_fp16", action=argparse.BooleanOptionalAction, default=None,
        help="encoder in fp16 (default: yes on a GPU, as the original server; always fp32 on CPU)",
    )
    p.add_argument("--encode_batch_size", type=int, default=512, help="queries per encoder call (original: 512)")
    p.add_argument(
        "--num_threads", type=int, default=0,
        help="CPU threads for torch and FAISS (0: library default); 1 is fastest on a busy machine",
    )
    p.add_argument(
        "--encode_workers", type=int, default=1,
        help="CPU: threads that encode parts of a batch side by side (one core each); 1 on a shared machine",
    )
    p.add_argument("--switch_interval_ms", type=float, default=0.5, help="Python GIL switch interval")
    p.add_argument("--corpus_cache_dir", default=None, help="where the corpus Arrow store is cached")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--max_queries_per_request", type=int, default=ServerLimits.max_queries_per_request,
        help="more queries in one request answer 413; the original trainer sends a whole turn at once "
             "(its GRPO recipe: 512 prompts x 5 = 2,560)",
    )
    p.add_argument(
        "--max_query_chars", type=int, default=ServerLimits.max_query_chars,
        help="a longer query is cut to this many characters (not refused); dense retrievers also "
             "keep only the first --max_length tokens",
    )
    p.add_argument("--max_topk", type=int, default=ServerLimits.max_topk)
    p.add_argument(
        "--max_body_bytes", type=int, default=ServerLimits.max_body_bytes,
        help="a larger request body answers 413 (default 16 MiB: 4,096 queries of 2,048 characters, twice over)",
    )
    p.add_argument("--no_coalesce", action="store_true", default=False, help="search each request alone")
    p.add_argument("--coalesce_wait_ms", type=float, default=5.0)
    p.add_argument("--coalesce_max_queries", type=int, default=512)
    p.add_argument("--cache_size", type=int, default=10_000, help="LRU entries; 0 disables the cache")
    p.add_argument(
        "--max_pending_queries", type=int, default=ServerConfig.max_pending_queries,
        help="queries waiting for a search; beyond it a request answers 503 with Retry-After at once "
             "(0: no bound)",
    )
    p.add_argument(
        "--simulate_latency_ms", type=float, default=0.0,
        help="benchmarks: delay every /retrieve answer this long, to emulate a web-search API (default: off)",
    )
    p.add_argument(
        "--snippet_chars", type=int, default=0,
        help="search results as snippets: each passage's title line and the first line of its text cut to "
             "this many characters (POST /open returns the whole passage); 0: whole passages (default)",
    )
    p.add_argument(
        "--simulate_latency_jitter_ms", type=float, default=0.0,
        help="benchmarks: plus a uniform random delay in [0, this) per request",
    )
    return p


def set_num_threads(n: int) -> None:
    """Bound torch and FAISS thread pools: oversubscribed OpenMP threads spin and stall."""
    import faiss
    import torch

    torch.set_num_threads(n)
    faiss.omp_set_num_threads(n)


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    limits = ServerLimits(
        max_queries_per_request=args.max_queries_per_request,
        max_query_chars=args.max_query_chars,
        max_topk=args.max_topk,
        max_body_bytes=args.max_body_bytes,
    )
    return ServerConfig(
        default_topk=args.topk,
        limits=limits,
        coalesce=not args.no_coalesce,
        max_wait_ms=args.coalesce_wait_ms,
        max_batch_queries=args.coalesce_max_queries,
        cache_size=args.cache_size,
        max_pending_queries=args.max_pending_queries,
        simulate_latency_ms=args.simulate_latency_ms,
        simulate_latency_jitter_ms=args.simulate_latency_jitter_ms,
        snippet_chars=args.snippet_chars,
    )


def retriever_from_args(args: argparse.Namespace) -> BaseRetriever:
    """The retriever the command line asks for, with its process settings (threads, GIL switch
    interval) applied: the standalone server and each Ray Serve replica build it the same way."""
    if args.num_threads > 0:
        set_num_threads(args.num_threads)
    # The search thread re-takes the GIL after every torch op; with the default 5 ms
    # switch interval a busy event loop makes it wait on each one (a GIL convoy).
    sys.setswitchinterval(args.switch_interval_ms / 1000.0)
    return build_retriever(
        retriever_name=args.retriever_name,
        index_path=args.index_path,
        corpus_path=args.corpus_path,
        retriever_model=args.retriever_model,
        faiss_gpu=args.faiss_gpu,
        pooling=args.pooling_method,
        max_length=args.max_length,
        use_fp16=args.use_fp16,
        batch_size=args.encode_batch_size,
        corpus_cache_dir=args.corpus_cache_dir,
        encode_workers=args.encode_workers,
    )


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    configure_logging()
    args = parse_args(argv)
    config = config_from_args(args)
    retriever = retriever_from_args(args)
    logger.info(
        "serving %s retriever over %d passages on http://%s:%d (coalesce=%s)",
        retriever.kind, len(retriever.corpus), args.host, args.port, config.coalesce,
    )
    uvicorn.run(create_app(retriever, config), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
