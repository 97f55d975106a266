"""asyncio client for POST /retrieve: the retrieval path of the asynchronous rollout.

In the async rollout every trajectory is its own coroutine and searches when it gets to a
search, so retrieval is many small concurrent requests rather than one batch a turn. This
client behaves as ``RetrievalClient`` does, on an ``httpx.AsyncClient``:

- connection failures (refused, reset while sending or reading) and HTTP 500/502/503/504 are
  retried with exponential backoff (``backoff_factor * 2**(retry - 1)`` seconds before retry
  ``retry``), at most ``max_retries`` times; a 503's ``Retry-After`` (an overloaded server) is
  waited instead when longer, up to ``timeout``; other 5xx answers are not retried;
- 4xx answers are never retried (``RetrievalBadRequest``);
- a read timeout is not retried (``RetrievalTimeout``): the server has the request;
- a long query list goes out in chunks of ``max_batch_queries``, concurrently, and the
  answers are joined in query order;
- the same typed errors, so a failure becomes the same counted observation (DESIGN §4.9);
- at most ``pool_size`` requests are in flight: the others wait for a free connection
  *before* their request starts, so that wait is never counted against ``timeout`` (the
  server's time to answer) and never becomes a failed search.

One client belongs to one event loop (httpx's connection pool does); ``aclose()`` it, or
use ``async with``. Needs ``httpx`` (extra ``retriever``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from search_r1.search.client import (
    RETRYABLE_STATUS,
    RetrievalError,
    RetrievalTimeout,
    _RetrieveEndpoint,
    parse_retrieve_response,
    raise_for_retrieve_status,
)
from search_r1.search.schema import Hit


def _import_httpx() -> Any:
    try:
        import httpx
    except ImportError as err:
        raise ImportError("the async retrieval client needs httpx: pip install -e .[retriever]") from err
    return httpx


class AsyncRetrievalClient(_RetrieveEndpoint):
    """Pooled, retrying asyncio client for POST /retrieve; settings as ``RetrievalClient``'s,
    except ``pool_size`` (default 64: many trajectories search at once)."""

    default_pool_size = 64

    def _open(self) -> None:
        httpx = _import_httpx()
        self._httpx = httpx
        # One request per pooled connection at a time. Left to httpx, every coroutine queues in
        # its pool, each freed connection wakes all of them, and under that churn a request
        # gave up with PoolTimeout (inside the same ``timeout``) and was reported as a slow
        # server: 996 of 1000 concurrent searches over 4 connections, 20 ms each, timeout 1 s.
        # With this bound a connection is always free once the semaphore is taken, so httpx's
        # own pool wait is unbounded (``pool=None``) and ``timeout`` covers connect/write/read.
        self._in_flight = asyncio.Semaphore(self.pool_size)
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(self.timeout, pool=None),
            limits=httpx.Limits(max_connections=self.pool_size, max_keepalive_connections=self.pool_size),
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def __aenter__(self) -> AsyncRetrievalClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def retrieve(
        self, queries: Sequence[str], topk: int | None = None, return_scores: bool = True
    ) -> list[list[Hit]]:
        """Hits for each query, in query order, best first. Raises ``RetrievalError`` (or a subclass)."""
        topk = self.topk if topk is None else topk
        answers = await asyncio.gather(*(self._post_chunk(chunk, topk, return_scores)
                                         for chunk in self._chunks(queries)))
        return [hits for answer in answers for hits in answer]

    async def _post_chunk(self, queries: list[str], topk: int, return_scores: bool) -> list[list[Hit]]:
        httpx = self._httpx
        payload = self._payload(queries, topk, return_scores)
        retry = 0
        while True:
            try:
                async with self._in_flight:  # the wait for a connection: not timed, not a failure
                    response = await self._client.post(self.url, json=payload)
            except httpx.TimeoutException as exc:
                if not isinstance(exc, httpx.ConnectTimeout):
                    raise RetrievalTimeout(
                        f"retrieval server did not answer within {self.timeout}s ({type(exc).__name__})",
                        None,
                        self.url,
                    ) from exc
                answer, failure = None, exc
            except (httpx.NetworkError, httpx.RemoteProtocolError) as exc:
                # refused, or reset while sending or reading: /retrieve is read-only, so resend
                answer, failure = None, exc
            except httpx.HTTPError as exc:
                raise RetrievalError(f"retrieval request failed: {exc}", None, self.url) from exc
            else:
                if response.status_code not in RETRYABLE_STATUS:
                    raise_for_retrieve_status(response, self.url, self.max_retries)
                    return parse_retrieve_response(response, len(queries), self.url)
                answer, failure = response, None
            await asyncio.sleep(self._wait_before_retry(retry, answer, failure))
            retry += 1
