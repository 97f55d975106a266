"""Backpressure: the retrieval server bounds the queries waiting for a search and answers
503 + Retry-After at once beyond the bound; both clients wait what Retry-After says and
resend after a connection reset, so every query is answered (docs/retriever.md)."""

from __future__ import annotations

import asyncio
import re
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from search_r1.search.async_client import AsyncRetrievalClient
from search_r1.search.client import RetrievalClient, RetrievalUnavailable
from search_r1.search.retrieval_server import ServerConfig, create_app
from search_r1.search.schema import Hit
from tests.search.test_client import ScriptedServer, make_scripted_app

Serve = Callable[[FastAPI], AbstractContextManager[str]]


class SlowRetriever:
    """The real BM25 retriever, each search taking `delay_s` longer (a busy index)."""

    def __init__(self, inner: Any, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s
        self.kind, self.corpus = inner.kind, inner.corpus
        self.searched: list[str] = []

    def search_batch(self, queries: list[str], topk: int) -> list[list[Hit]]:
        time.sleep(self.delay_s)
        self.searched.extend(queries)
        return self.inner.search_batch(queries, topk)


# Distinct queries: the server's cache would answer repeats without a search.
QUERIES = [f"who wrote book number {i}" for i in range(40)]


def _overloadable(bm25_retriever: Any) -> tuple[SlowRetriever, FastAPI]:
    slow = SlowRetriever(bm25_retriever, delay_s=0.2)
    return slow, create_app(slow, ServerConfig(max_pending_queries=4, max_batch_queries=2, cache_size=0))


def test_past_the_bound_the_server_answers_503_with_retry_after_and_counts_it(
        bm25_retriever: Any, serve: Serve) -> None:
    slow, app = _overloadable(bm25_retriever)

    async def fire(base: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(client.post(base + "/retrieve", json={"queries": [q], "topk": 2, "return_scores": True})
                                          for q in QUERIES[:20]))

    with serve(app) as base:
        answers = asyncio.run(fire(base))
        health = httpx.get(base + "/health").json()
    refused = [r for r in answers if r.status_code == 503]
    served = [r for r in answers if r.status_code == 200]
    assert refused and served and len(refused) + len(served) == 20
    for r in refused:
        assert int(r.headers["Retry-After"]) >= 1
        assert "max_pending_queries=4" in r.json()["detail"]
    assert health["counters"]["overloaded"] == len(refused)
    assert health["pending_queries"] == 0 and health["max_pending_queries"] == 4
    # nothing refused was searched; everything served was, with the right hits
    assert len(slow.searched) == len(served)
    for q, r in zip(QUERIES[:20], answers, strict=True):
        if r.status_code == 200:
            expected = bm25_retriever.search_batch([q], 2)[0]
            assert [h["document"]["id"] for h in r.json()["result"][0]] == [h.doc_id for h in expected]


def test_a_request_alone_larger_than_the_bound_is_searched(bm25_retriever: Any, serve: Serve) -> None:
    _, app = _overloadable(bm25_retriever)
    with serve(app) as base:
        answer = httpx.post(base + "/retrieve", json={"queries": QUERIES[:10], "topk": 1}, timeout=60)
    assert answer.status_code == 200 and len(answer.json()["result"]) == 10


def test_both_clients_answer_every_query_of_an_overloaded_server(bm25_retriever: Any, serve: Serve) -> None:
    slow, app = _overloadable(bm25_retriever)
    expected = [[h.doc_id for h in hits] for hits in bm25_retriever.search_batch(QUERIES, 2)]

    async def many(url: str) -> list[list[Hit]]:
        async with AsyncRetrievalClient(url, topk=2, max_retries=20, backoff_factor=0.01) as client:
            return [hits for answer in await asyncio.gather(*(client.retrieve([q]) for q in QUERIES))
                    for hits in answer]

    with serve(app) as base:
        got_async = asyncio.run(many(base + "/retrieve"))
        after_async = httpx.get(base + "/health").json()["counters"]["overloaded"]
        with RetrievalClient(base + "/retrieve", topk=2, max_retries=20, backoff_factor=0.01,
                             pool_size=16) as client, ThreadPoolExecutor(16) as pool:
            got_sync = [hits for answer in pool.map(lambda q: client.retrieve([q]), QUERIES) for hits in answer]
        overloaded = httpx.get(base + "/health").json()["counters"]["overloaded"]
    assert after_async > 0 and overloaded > after_async          # both clients were refused and came back
    assert [[h.doc_id for h in hits] for hits in got_async] == expected
    assert [[h.doc_id for h in hits] for hits in got_sync] == expected
    assert sorted(slow.searched) == sorted(QUERIES * 2)          # each query searched once per client


@pytest.mark.parametrize("client_kind", ["sync", "async"])
def test_a_503_is_retried_after_its_retry_after(client_kind: str, serve: Serve) -> None:
    # backoff_factor alone would resend after 10 ms; Retry-After says 1 s
    script = ScriptedServer(fail_first=1, fail_status=503, retry_after="1")
    with serve(make_scripted_app(script)) as base:
        hits = _retrieve(client_kind, base + "/retrieve", max_retries=2, backoff_factor=0.01)
    assert [h.doc_id for h in hits[0]] == ["q#0"] and script.calls == 2
    assert script.call_times[1] - script.call_times[0] >= 0.95


@pytest.mark.parametrize("client_kind", ["sync", "async"])
def test_retry_after_is_capped_at_the_request_timeout(client_kind: str, serve: Serve) -> None:
    script = ScriptedServer(fail_first=1, fail_status=503, retry_after="3600")
    with serve(make_scripted_app(script)) as base:
        started = time.monotonic()
        hits = _retrieve(client_kind, base + "/retrieve", max_retries=2, backoff_factor=0.01, timeout=1.5)
    assert [h.doc_id for h in hits[0]] == ["q#0"]
    assert 1.4 <= script.call_times[1] - script.call_times[0] and time.monotonic() - started < 60


@pytest.mark.parametrize("client_kind", ["sync", "async"])
def test_a_connection_reset_is_resent_and_answered(client_kind: str) -> None:
    with _resetting_server(resets=2) as (server, url):
        hits = _retrieve(client_kind, url, max_retries=3, backoff_factor=0.01)
    assert [h.doc_id for h in hits[0]] == ["1"] and server.requests == 3


@pytest.mark.parametrize("client_kind", ["sync", "async"])
def test_resets_past_the_retry_budget_are_unavailable(client_kind: str) -> None:
    with _resetting_server(resets=10) as (server, url), pytest.raises(RetrievalUnavailable):
        _retrieve(client_kind, url, max_retries=2, backoff_factor=0.01)
    assert server.requests == 3


def _retrieve(client_kind: str, url: str, **settings: Any) -> list[list[Hit]]:
    if client_kind == "sync":
        with RetrievalClient(url, topk=1, **settings) as client:
            return client.retrieve(["q"])

    async def run() -> list[list[Hit]]:
        async with AsyncRetrievalClient(url, topk=1, **settings) as client:
            return await client.retrieve(["q"])

    return asyncio.run(run())


class _ResettingServer(socketserver.ThreadingTCPServer):
    """Reads each request whole, then resets the connection (RST) for the first `resets`
    requests and answers one hit after that."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, resets: int) -> None:
        self.resets, self.requests, self.lock = resets, 0, threading.Lock()
        super().__init__(("127.0.0.1", 0), _ResettingHandler)


class _ResettingHandler(socketserver.BaseRequestHandler):
    server: _ResettingServer

    def handle(self) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = self.request.recv(65536)
            if not chunk:
                return
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(re.search(rb"content-length: *(\d+)", head, re.IGNORECASE).group(1))
        while len(body) < length:
            body += self.request.recv(65536)
        with self.server.lock:
            self.server.requests += 1
            reset = self.server.requests <= self.server.resets
        if reset:
            self.request.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.request.close()
            return
        payload = b'{"result": [[{"document": {"id": "1", "contents": "\\"T\\"\\nbody"}, "score": 1.0}]]}'
        self.request.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                             b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)


@contextmanager
def _resetting_server(resets: int) -> Iterator[tuple[_ResettingServer, str]]:
    server = _ResettingServer(resets)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, f"http://127.0.0.1:{server.server_address[1]}/retrieve"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.slow
# the plain server at a bound of 8, Serve's proxy at the default bound (the two others of the grid add
# no code path: the bound and the server are independent settings; Serve's 503s at a small bound are
# test_ray_serve.py's. Serve's proxy at a bound of 8 took 84 to 227 s here, its p99 ~70 s, where
# the plain server's takes ~30 s.)
@pytest.mark.parametrize(("bound", "serve"), [(8, "none"), (None, "ray")])
def test_a_thousand_concurrent_clients_are_all_answered(bound: int | None, serve: str, tmp_path: Any,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # scripts/bench/retrieval_load.py as documented: `bash retrieval_launch.sh` (example BM25), or the
    # same index as a Ray Serve application (--serve ray: a local Ray in a subprocess, the clients on
    # Serve's HTTP proxy); 1,000 clients x 4 distinct single-query requests.
    import json
    import subprocess
    import sys

    from scripts.bench.retrieval_load import ROOT, main

    monkeypatch.setenv("SEARCH_R1_CACHE", str(tmp_path / "cache"))
    # Each client is its own httpx.AsyncClient, and httpx loads a CA bundle into a new SSL context per
    # client (SSL_CERT_FILE's or certifi's: ~75 ms of CPU each on a loaded 2-core machine, 1,000 of them
    # blocking the clients' event loop and taking the cores from the server). The clients speak plain
    # HTTP to 127.0.0.1 and never use it: an empty SSL_CERT_DIR (looked up lazily: ~5 ms a client)
    # keeps that cost out of a test of the server. The --serve ray subprocess inherits it.
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.setenv("SSL_CERT_DIR", str(tmp_path / "no_certs"))
    (tmp_path / "no_certs").mkdir()
    args = ["--clients", "1000", "--queries", "4"] + ([] if bound is None else ["--max_pending_queries", str(bound)])
    if bound is not None:
        # A bound of 8 turns away ~2,300 requests; on a loaded CI machine the default budget of 8
        # retries once left some unanswered behind Serve's proxy: the test gives them 16.
        args += ["--max_retries", "16"]
    else:
        # Serve's proxy (one process) answers the 1,000 clients' requests in turn: idle here its p99 is
        # ~19 s (docs/retriever.md), but in CI the other xdist workers' vLLM and training runs share the
        # 2 cores, and there the test took 302 s and 1,789 requests hit the bench's 60 s client timeout
        # still queued behind the proxy. What this test asserts is that all are answered and the server
        # ends alive with nothing pending, not a latency (the bench's figure): the clients wait 300 s.
        # And Serve's controller restarts a proxy that misses three health checks in a row (30 s each:
        # search_r1.search.ray_serve.controller_env); at Ray's 10 s it did so mid-load in CI, and 2,380
        # requests were refused (ConnectError) for longer than 8 retries (~26 s of backoff) cover. With
        # 16 (up to ~27 min of backoff, each wait capped at the timeout) a client outlasts such a restart.
        args += ["--timeout", "300", "--max_retries", "16"]
    if serve == "none":
        result = main(args)
    else:   # its own process: this one may hold the session's Ray, and a process is in one Ray at a time
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "retrieval_load.py"), *args,
                               "--serve", "ray"], capture_output=True, text=True, timeout=1200)
        assert proc.returncode == 0, proc.stderr[-4000:]
        result = json.loads(proc.stdout[proc.stdout.rindex('{\n  "server"'):])
        assert result["server"] == "ray_serve" and result["replicas"] == 1
    assert result["answered"] == 4000 and result["failed"] == 0, result["failure_examples"]
    assert result["server_alive_after"] and result["pending_after"] == 0
    # a Serve replica holds more per request in flight (Serve's own request state) than the plain server
    assert result["server_rss_mib"]["growth"] < (200 if serve == "none" else 400)
    if bound is not None:
        assert result["max_pending_queries"] == 8 and result["overloaded_503"] > 0


def test_retry_after_grows_with_the_clients_turned_away_at_the_rate_the_server_can_answer() -> None:
    from search_r1.search.retrieval_server import BacklogClock

    now = [100.0]
    clock = BacklogClock(window_s=2.0, max_wait_s=60.0, half_life_s=30.0, clock=lambda: now[0])
    clock.turned_away(500)
    assert clock.wait_s(pending=8) == 0.0          # nothing answered yet: no rate to go by
    clock.answered(200)                            # 100 queries/s over the 2 s window
    assert clock.wait_s(pending=8) == pytest.approx((8 + 500) / 100)
    clock.turned_away(500)
    assert clock.wait_s(pending=8) == pytest.approx((8 + 1000) / 100)
    # the clients wait, so almost nothing is answered for a while: the rate the server showed it can
    # answer still counts, halving every 30 s, instead of the idle rate of the moment
    now[0] += 30.0
    clock.answered(2)
    assert clock.rate() == pytest.approx(50.0)
    clock.turned_away(100)
    assert clock.wait_s(pending=0) == pytest.approx(100 / 50.0)
    clock.turned_away(10_000)
    assert clock.wait_s(pending=0) == 60.0         # capped
    # an idle stretch (nothing answered: the trainer updates between rollouts) does not wear the rate down
    now[0] += 300.0
    assert clock.rate() == pytest.approx(50.0)


def test_simulated_latency_delays_every_answer_and_fills_the_bound(bm25_retriever: Any, serve: Serve) -> None:
    # --simulate_latency_ms (benchmarks: a web-search API's latency): every request waits, cached or not,
    # and its queries count as pending meanwhile
    app = create_app(bm25_retriever, ServerConfig(simulate_latency_ms=300, simulate_latency_jitter_ms=100,
                                                  max_pending_queries=1))
    with serve(app) as base:
        client = RetrievalClient(f"{base}/retrieve", topk=1, max_retries=0)
        for _ in range(2):                                  # the second one from the cache: delayed all the same
            started = time.monotonic()
            assert client.retrieve(["glacier"])[0]
            assert 0.3 <= time.monotonic() - started < 5.0
        health = httpx.get(f"{base}/health", timeout=10).json()
        assert health["simulate_latency_ms"] == [300.0, 100.0] and health["counters"]["cache_hits"] == 1

        async def two_at_once() -> list[int]:
            async with httpx.AsyncClient(timeout=30) as http:
                answers = await asyncio.gather(*(http.post(f"{base}/retrieve", json={"queries": [q]})
                                                 for q in ("a", "b")))
            return sorted(r.status_code for r in answers)

        assert asyncio.run(two_at_once()) == [200, 503]     # the first one's wait holds the bound of 1
    with pytest.raises(ValueError, match="simulate_latency_ms"):
        ServerConfig(simulate_latency_ms=-1)
