"""AsyncRetrievalClient against real local HTTP servers: the sync client's retry, timeout and
chunking rules, many concurrent coroutines, and the same hits as the sync client from the
project's own BM25 server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import pytest
from fastapi import FastAPI
from urllib3.exceptions import ConnectTimeoutError

from search_r1.search.async_client import AsyncRetrievalClient
from search_r1.search.client import (
    RetrievalBadRequest,
    RetrievalClient,
    RetrievalTimeout,
    RetrievalUnavailable,
    retrying_session,
)
from search_r1.search.schema import RetrieveRequest
from tests.conftest import free_port
from tests.search.test_client import ScriptedServer, make_scripted_app


@pytest.fixture
def scripted(serve: Callable[[FastAPI], AbstractContextManager[str]]) -> Iterator[tuple[ScriptedServer, str]]:
    script = ScriptedServer()
    with serve(make_scripted_app(script)) as base:
        yield script, base + "/retrieve"


async def _retrieve(url: str, queries: list[str], **settings) -> list:
    async with AsyncRetrievalClient(url, **settings) as client:
        return await client.retrieve(queries)


def test_retries_5xx_until_the_server_recovers(scripted: tuple[ScriptedServer, str]) -> None:
    script, url = scripted
    script.fail_first = 2
    hits = asyncio.run(_retrieve(url, ["alpha", "beta"], topk=2, max_retries=3, backoff_factor=0.01))
    assert script.calls == 3
    assert [[h.doc_id for h in per_q] for per_q in hits] == [["alpha#0", "alpha#1"], ["beta#0", "beta#1"]]
    assert hits[0][0].title == "alpha" and hits[0][0].score == 1.0


def test_gives_up_with_unavailable_after_the_retry_budget(scripted: tuple[ScriptedServer, str]) -> None:
    script, url = scripted
    script.fail_first = 100
    with pytest.raises(RetrievalUnavailable) as info:
        asyncio.run(_retrieve(url, ["q"], max_retries=2, backoff_factor=0.01))
    assert script.calls == 3  # the first try and two retries
    assert info.value.status == 503 and info.value.url == url and "scripted failure 3" in info.value.message


def test_does_not_retry_a_bad_request(scripted: tuple[ScriptedServer, str]) -> None:
    script, url = scripted
    script.fail_first, script.fail_status = 100, 400
    with pytest.raises(RetrievalBadRequest) as info:
        asyncio.run(_retrieve(url, ["q"], max_retries=3, backoff_factor=0.01))
    assert script.calls == 1 and info.value.status == 400 and "scripted failure 1" in str(info.value)


def test_splits_a_large_batch_and_keeps_query_order(scripted: tuple[ScriptedServer, str]) -> None:
    script, url = scripted
    queries = [f"q{i}" for i in range(10)]
    hits = asyncio.run(_retrieve(url, queries, topk=1, max_batch_queries=4))
    assert sorted(script.batch_sizes) == [2, 4, 4]   # sent concurrently: arrival order is free
    assert [per_q[0].doc_id for per_q in hits] == [f"q{i}#0" for i in range(10)]
    assert asyncio.run(_retrieve(url, [])) == [] and script.calls == 3


def test_slow_server_raises_timeout_without_retrying(scripted: tuple[ScriptedServer, str]) -> None:
    script, url = scripted
    script.delay_s = 1.5
    start = time.monotonic()
    with pytest.raises(RetrievalTimeout) as info:
        asyncio.run(_retrieve(url, ["q"], timeout=0.3, max_retries=3, backoff_factor=0.01))
    assert time.monotonic() - start < 1.4
    # A request the client gave up on may reach a loaded server's handler late: give it time to be
    # counted, then there is exactly one (no retry after a timeout).
    deadline = time.monotonic() + 5.0
    while script.calls == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert info.value.status is None and script.calls == 1


def test_unreachable_server_raises_unavailable_after_retries() -> None:
    url = f"http://127.0.0.1:{free_port()}/retrieve"
    with pytest.raises(RetrievalUnavailable) as info:
        asyncio.run(_retrieve(url, ["q"], max_retries=1, backoff_factor=0.01, timeout=2.0))
    assert info.value.status is None and "after 1 retries" in info.value.message


def test_concurrent_coroutines_each_get_their_own_answer(scripted: tuple[ScriptedServer, str]) -> None:
    script, url = scripted

    async def many() -> list:
        async with AsyncRetrievalClient(url, topk=1, pool_size=8) as client:
            return await asyncio.gather(*(client.retrieve([f"t{i}"]) for i in range(32)))

    answers = asyncio.run(many())
    assert [a[0][0].doc_id for a in answers] == [f"t{i}#0" for i in range(32)]
    assert script.calls == 32 and script.batch_sizes == [1] * 32


def test_same_hits_as_the_sync_client_from_the_bm25_server(
        bm25_retriever, serve: Callable[[FastAPI], AbstractContextManager[str]]) -> None:
    from search_r1.search.retrieval_server import create_app

    queries = ["photosynthesis in plants", "glacier ice", "lighthouse", "honeybee colony", "telescope lens"]
    with serve(create_app(bm25_retriever)) as base:
        url = base + "/retrieve"
        expected = RetrievalClient(url, topk=3).retrieve(queries)

        async def one_by_one() -> list:
            async with AsyncRetrievalClient(url, topk=3) as client:
                return [hits[0] for hits in await asyncio.gather(*(client.retrieve([q]) for q in queries))]

        assert asyncio.run(one_by_one()) == expected
    assert all(expected)


def test_rejects_bad_settings_naming_them() -> None:
    with pytest.raises(ValueError, match="pool_size"):
        AsyncRetrievalClient("http://127.0.0.1:1/retrieve", pool_size=0)
    with pytest.raises(ValueError, match="http"):
        AsyncRetrievalClient("127.0.0.1:8000/retrieve")
    with pytest.raises(TypeError):
        asyncio.run(_retrieve("http://127.0.0.1:1/retrieve", "one query"))  # type: ignore[arg-type]


def test_waiting_for_a_pooled_connection_is_not_a_server_timeout(
        serve: Callable[[FastAPI], AbstractContextManager[str]]) -> None:
    """Far more coroutines than pooled connections: a request's wait for a free connection is
    not held against its timeout, so no search fails and none is retried. (Unbounded, httpx
    queued all of them in its pool, woke every waiter at each free connection and gave up with
    PoolTimeout: 996 of these 1000 failed on the 2-core development VM.)"""
    delay_s, pool, n_requests, timeout_s = 0.02, 4, 1000, 1.0
    assert delay_s < timeout_s < (n_requests / pool) * delay_s
    calls = 0
    app = FastAPI()

    @app.post("/retrieve")
    async def slow(request: RetrieveRequest) -> dict:
        nonlocal calls
        calls += 1
        await asyncio.sleep(delay_s)
        return {"result": [[{"id": q, "contents": f'"{q}"\nbody'}] for q in request.queries]}

    async def many(url: str) -> list:
        async with AsyncRetrievalClient(url, topk=1, pool_size=pool, timeout=timeout_s,
                                        max_retries=2, backoff_factor=0.01) as client:
            return await asyncio.gather(*(client.retrieve([f"q{i}"]) for i in range(n_requests)))

    with serve(app) as base:
        answers = asyncio.run(many(base + "/retrieve"))
    assert [a[0][0].doc_id for a in answers] == [f"q{i}" for i in range(n_requests)]
    assert calls == n_requests   # no request was retried


@pytest.mark.parametrize("timeout", [0.5, 3.0])
def test_the_doubling_backoff_never_waits_past_the_timeout_in_either_client(timeout: float) -> None:
    # refused 12 times in a row, a client slept backoff_factor * 2**12 s (34 min at 0.5) before its next try
    client = AsyncRetrievalClient("http://127.0.0.1:9/retrieve", max_retries=16, backoff_factor=0.5, timeout=timeout)
    waits = [client._wait_before_retry(retry, None, ConnectionError("refused")) for retry in range(16)]
    assert waits[:2] == [min(0.5, timeout), min(1.0, timeout)]
    assert max(waits) == timeout and waits[-1] == timeout
    retry = retrying_session(max_retries=16, backoff_factor=0.5, timeout=timeout).get_adapter("http://x").max_retries
    for _ in range(12):
        retry = retry.increment("POST", "/retrieve", error=ConnectTimeoutError("refused"))
    assert retry.get_backoff_time() == timeout
