"""Clients for a retrieval application on Ray Serve (url ``ray-serve://<app>``; ``ray_serve.py``).

They behave as the HTTP clients do (``client.RetrievalClient``, ``async_client.AsyncRetrievalClient``):
same settings, same chunking, same typed errors, same retries. A call goes through a
``DeploymentHandle`` that prefers the replica on the caller's node and answers what the HTTP route
would (status, body, headers), so:

- 500/502/503/504 are retried with exponential backoff, a 503's ``Retry-After`` waited when longer
  (up to ``timeout``); 4xx never (``RetrievalBadRequest``);
- a replica that died under the call (``RayActorError``), one Serve could not reach, or Serve's own
  queue being full is retried like a connection reset: the router has dropped the dead replica
  and sends the retry to a live one (another node's while Serve restarts this node's);
- no answer within ``timeout`` is ``RetrievalTimeout`` (not retried: the replica has the request).

``open_retrieval_client`` / ``open_async_retrieval_client`` pick the HTTP or Serve client by url.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from search_r1.search.async_client import AsyncRetrievalClient
from search_r1.search.client import (
    RETRYABLE_STATUS,
    RetrievalClient,
    RetrievalError,
    RetrievalTimeout,
    _RetrieveEndpoint,
    parse_retrieve_response,
    raise_for_retrieve_status,
)
from search_r1.search.ray_serve import SERVE_SCHEME, is_serve_url, local_handle
from search_r1.search.schema import Hit


def _handle(app_name: str) -> Any:
    """The process's locality-routed handle (Serve caches it: one router, a thread holding the replica
    set, for every client and event loop of the process)."""
    return local_handle(app_name)


def _caller_node() -> str | None:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


@dataclass
class _Answer:
    """A replica's (status, body, headers), read as the HTTP helpers read a response."""

    status_code: int
    body: dict
    headers: dict = field(default_factory=dict)

    def json(self) -> dict:
        return self.body

    @property
    def text(self) -> str:
        return str(self.body)


def _retryable(exc: BaseException) -> bool:
    """A failure of the call itself (not an answer) that a resend can fix."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    return isinstance(exc, RayActorError | BackPressureError | DeploymentUnavailableError)


class _ServeEndpoint(_RetrieveEndpoint):
    """Settings, chunking and the retry plan of both Serve clients."""

    schemes = (SERVE_SCHEME,)

    def _open(self) -> None:
        self.app_name = self.url[len(SERVE_SCHEME):]
        if not self.app_name:
            raise ValueError(f"retriever url {self.url!r} names no Serve application ({SERVE_SCHEME}<app>)")

    @property
    def health_url(self) -> str:
        return f"{self.url} (each replica's health(): search_r1.search.ray_serve.replica_health)"

    def _accept(self, answer: _Answer, n_queries: int) -> list[list[Hit]]:
        raise_for_retrieve_status(answer, self.url, self.max_retries)
        return parse_retrieve_response(answer, n_queries, self.url)

    def _unreachable_text(self, failure: BaseException | None) -> str:
        return (f"retrieval application unreachable after {self.max_retries} retries ({type(failure).__name__}: "
                f"{failure})")

    def _timed_out(self, exc: BaseException) -> RetrievalTimeout:
        return RetrievalTimeout(f"retrieval application did not answer within {self.timeout}s", None, self.url)


class ServeRetrievalClient(_ServeEndpoint):
    """Blocking client (the driver's sync rollout); must not be called inside a running event loop."""

    def close(self) -> None:
        pass

    def health(self) -> bool:
        try:
            return bool(_handle(self.app_name).health.remote().result(timeout_s=self.timeout))
        except Exception:
            return False

    def retrieve(self, queries: Sequence[str], topk: int | None = None, return_scores: bool = True
                 ) -> list[list[Hit]]:
        topk = self.topk if topk is None else topk
        return [hits for chunk in self._chunks(queries) for hits in self._post_chunk(chunk, topk, return_scores)]

    def _post_chunk(self, queries: list[str], topk: int, return_scores: bool) -> list[list[Hit]]:
        payload, node = self._payload(queries, topk, return_scores), _caller_node()
        retry = 0
        while True:
            answer, failure = None, None
            try:
                answer = _Answer(*_handle(self.app_name).retrieve.remote(payload, node).result(timeout_s=self.timeout))
            except TimeoutError as exc:
                raise self._timed_out(exc) from exc
            except Exception as exc:
                if not _retryable(exc):
                    raise RetrievalError(f"retrieval call failed: {type(exc).__name__}: {exc}", None, self.url) from exc
                failure = exc
            if answer is not None and answer.status_code not in RETRYABLE_STATUS:
                return self._accept(answer, len(queries))
            time.sleep(self._wait_before_retry(retry, answer, failure))
            retry += 1


class AsyncServeRetrievalClient(_ServeEndpoint):
    """asyncio client (the async rollout): at most ``pool_size`` calls in flight, the wait for a slot
    not counted against ``timeout``."""

    default_pool_size = AsyncRetrievalClient.default_pool_size

    def _open(self) -> None:
        super()._open()
        self._in_flight = asyncio.Semaphore(self.pool_size)

    async def aclose(self) -> None:
        pass

    async def __aenter__(self) -> AsyncServeRetrievalClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def retrieve(self, queries: Sequence[str], topk: int | None = None, return_scores: bool = True
                       ) -> list[list[Hit]]:
        topk = self.topk if topk is None else topk
        answers = await asyncio.gather(*(self._post_chunk(chunk, topk, return_scores)
                                         for chunk in self._chunks(queries)))
        return [hits for answer in answers for hits in answer]

    async def _post_chunk(self, queries: list[str], topk: int, return_scores: bool) -> list[list[Hit]]:
        payload, node = self._payload(queries, topk, return_scores), _caller_node()
        retry = 0
        while True:
            answer, failure = None, None
            async with self._in_flight:
                response = None
                try:
                    response = _handle(self.app_name).retrieve.remote(payload, node)
                    answer = _Answer(*await asyncio.wait_for(_awaited(response), self.timeout))
                except asyncio.TimeoutError as exc:
                    response.cancel()
                    raise self._timed_out(exc) from exc
                except Exception as exc:
                    if not _retryable(exc):
                        raise RetrievalError(f"retrieval call failed: {type(exc).__name__}: {exc}", None,
                                             self.url) from exc
                    failure = exc
            if answer is not None and answer.status_code not in RETRYABLE_STATUS:
                return self._accept(answer, len(queries))
            await asyncio.sleep(self._wait_before_retry(retry, answer, failure))
            retry += 1


async def _awaited(response: Any) -> Any:
    return await response


def open_retrieval_client(url: str, **settings: Any) -> RetrievalClient | ServeRetrievalClient:
    """The blocking client for ``url``: HTTP(S) or ``ray-serve://<app>``."""
    return ServeRetrievalClient(url, **settings) if is_serve_url(url) else RetrievalClient(url, **settings)


def open_async_retrieval_client(url: str, **settings: Any) -> AsyncRetrievalClient | AsyncServeRetrievalClient:
    """The asyncio client for ``url``: HTTP(S) or ``ray-serve://<app>``."""
    return AsyncServeRetrievalClient(url, **settings) if is_serve_url(url) else AsyncRetrievalClient(url, **settings)
