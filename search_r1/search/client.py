"""HTTP client for any server that speaks the /retrieve API (DESIGN §3.1).

The generation manager owns one ``RetrievalClient`` and calls ``retrieve`` once per
turn with every active trajectory's query. Failures surface as a typed
``RetrievalError`` so the caller can turn them into a counted observation instead of
crashing a training step (DESIGN §4.9).

Transport choices, and why:

- one pooled ``requests.Session`` so that a rollout's hundreds of calls reuse TCP
  connections instead of opening one per turn;
- retries are urllib3's ``Retry`` on the adapter: connection failures (refused, or reset
  while reading) and 5xx answers are retried with exponential backoff (POST included, since
  /retrieve is read-only); a 503's ``Retry-After`` (an overloaded server) is waited instead,
  up to ``timeout``; 4xx answers are never retried, as the same body will be refused again;
- a read timeout is *not* retried: the server has the request and is slow, so sending
  it again only adds load to an overloaded server and multiplies the caller's wait;
- a long query list is sent in chunks of ``max_batch_queries`` (servers cap the number
  of queries per request) and the answers are joined back in query order.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from urllib3.exceptions import ReadTimeoutError
from urllib3.util.retry import Retry

from search_r1.search.schema import Hit

RETRYABLE_STATUS = (500, 502, 503, 504)


def retry_after_s(response: Any, cap: float) -> float:
    """How long to wait after a 503 answer: its ``Retry-After`` (delta-seconds) times a random
    factor in [1, 2), so the clients an overloaded server turned away together do not all come
    back in the same instant; at most `cap`; 0 without the header."""
    if response.status_code != 503:
        return 0.0
    try:
        after = max(0.0, float(response.headers.get("Retry-After", 0)))
    except ValueError:        # an HTTP date: not sent by our servers; back off as usual
        return 0.0
    return min(after * (1.0 + random.random()), cap)


class _Retry(Retry):
    """urllib3's Retry, with a read timeout never retried (the server has the request) while a
    connection reset during the read is, and a ``Retry-After`` honoured (times a random factor in
    [1, 2), as ``retry_after_s``) up to ``max_retry_after``."""

    max_retry_after: float = 30.0

    def new(self, **kw: Any) -> _Retry:
        retry = super().new(**kw)
        retry.max_retry_after = self.max_retry_after
        return retry

    def increment(self, method: str | None = None, url: str | None = None, response: Any = None,
                  error: Exception | None = None, _pool: Any = None, _stacktrace: Any = None) -> Retry:
        if isinstance(error, ReadTimeoutError):
            raise error
        return super().increment(method, url, response, error, _pool, _stacktrace)

    def get_retry_after(self, response: Any) -> float | None:
        after = super().get_retry_after(response)
        return None if after is None else min(after * (1.0 + random.random()), self.max_retry_after)


def retrying_session(max_retries: int, backoff_factor: float, timeout: float, pool_size: int = 16
                     ) -> requests.Session:
    """A requests Session with the retrieval clients' retry policy: connection failures, resets while
    reading and 5xx answers resent up to `max_retries` times with exponential backoff (POST included:
    the endpoints are read-only), a 503's Retry-After honoured up to `timeout`, a read timeout and 4xx
    answers never resent; the last 5xx is handed back rather than raised. A backoff never exceeds
    `timeout` either (urllib3's own cap is 120 s)."""
    retry = _Retry(
        total=max_retries,
        connect=max_retries,
        status=max_retries,
        read=max_retries,  # resets while reading; _Retry re-raises a read timeout as is
        other=0,
        redirect=0,
        allowed_methods=frozenset({"GET", "POST"}),
        status_forcelist=RETRYABLE_STATUS,
        backoff_factor=backoff_factor,
        backoff_max=timeout,
        raise_on_status=False,
        respect_retry_after_header=True,
    )
    retry.max_retry_after = timeout
    adapter = HTTPAdapter(pool_connections=1, pool_maxsize=pool_size, max_retries=retry)
    session = requests.Session()
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


class RetrievalError(RuntimeError):
    """A /retrieve call that did not produce results.

    ``status`` is the HTTP status when the server answered (None when it never did),
    ``url`` the endpoint that was called.
    """

    def __init__(self, message: str, status: int | None = None, url: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.url = url

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep the typed fields when the error crosses a Ray / multiprocessing boundary.
        return (type(self), (self.message, self.status, self.url))


class RetrievalTimeout(RetrievalError):
    """The server did not answer within the client's timeout."""


class RetrievalUnavailable(RetrievalError):
    """The server could not be reached, or kept answering 5xx after every retry."""


class RetrievalBadRequest(RetrievalError):
    """The server refused the request (4xx); retrying the same body cannot help."""


def _error_detail(response: Any) -> str:
    """The server's own message for a refused request (FastAPI puts it in ``detail``)."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(body, dict) and "detail" in body:
        return str(body["detail"])[:500]
    return str(body)[:500]


class _RetrieveEndpoint:
    """What every /retrieve client shares: its settings (checked, naming the bad one), the
    request body, and the split of a long query list into chunks of ``max_batch_queries``.
    Subclasses open their transport in ``_open``."""

    default_pool_size = 16
    schemes: tuple[str, ...] = ("http://", "https://")

    def __init__(
        self,
        url: str,
        topk: int = 3,
        timeout: float = 30.0,
        max_retries: int = 3,
        backoff_factor: float = 0.5,
        max_batch_queries: int = 512,
        pool_size: int | None = None,
    ) -> None:
        pool_size = self.default_pool_size if pool_size is None else pool_size
        if not url.startswith(self.schemes):
            raise ValueError(f"retriever url must start with {' or '.join(self.schemes)}, got {url!r}")
        for name, value in (
            ("topk", topk),
            ("max_batch_queries", max_batch_queries),
            ("pool_size", pool_size),
        ):
            if value < 1:
                raise ValueError(f"{type(self).__name__}.{name} must be >= 1, got {value}")
        if timeout <= 0:
            raise ValueError(f"{type(self).__name__}.timeout must be > 0, got {timeout}")
        if max_retries < 0:
            raise ValueError(f"{type(self).__name__}.max_retries must be >= 0, got {max_retries}")
        self.url = url
        self.topk = topk
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff_factor = backoff_factor
        self.max_batch_queries = max_batch_queries
        self.pool_size = pool_size
        self._open()

    def _open(self) -> None:
        raise NotImplementedError

    def _unreachable_text(self, failure: BaseException | None) -> str:
        return f"retrieval server unreachable after {self.max_retries} retries ({type(failure).__name__})"

    def _wait_before_retry(self, retry: int, answer: Any | None, failure: BaseException | None) -> float:
        """Seconds to wait before resend number ``retry + 1`` after a retryable ``answer`` (a 5xx
        response) or ``failure`` (an exception): exponential backoff, or a 503's ``Retry-After`` when
        longer. Raises the typed error when the ``max_retries`` budget is spent."""
        if retry == self.max_retries:
            if answer is not None:
                raise_for_retrieve_status(answer, self.url, self.max_retries)
            raise RetrievalUnavailable(self._unreachable_text(failure), None, self.url) from failure
        # doubling, but never past `timeout` (as a Retry-After is not): uncapped, a client an overloaded
        # server refused 12 times in a row slept backoff_factor * 4096 s before the next try (34 min at 0.5)
        wait = min(self.backoff_factor * 2 ** retry, self.timeout)
        return max(wait, retry_after_s(answer, self.timeout)) if answer is not None else wait

    def __repr__(self) -> str:
        return f"{type(self).__name__}(url={self.url!r}, topk={self.topk}, timeout={self.timeout})"

    def _chunks(self, queries: Sequence[str]) -> list[list[str]]:
        if isinstance(queries, str):
            raise TypeError("queries must be a sequence of strings, not a single string")
        return [list(queries[i : i + self.max_batch_queries]) for i in range(0, len(queries), self.max_batch_queries)]

    @staticmethod
    def _payload(queries: list[str], topk: int, return_scores: bool) -> dict[str, Any]:
        return {"queries": queries, "topk": topk, "return_scores": return_scores}


class RetrievalClient(_RetrieveEndpoint):
    """Pooled, retrying client for POST /retrieve.

    ``url`` is the full endpoint, as in the trainer's ``retriever.url``
    (e.g. ``http://127.0.0.1:8000/retrieve``). Settings: ``topk``, ``timeout`` (s),
    ``max_retries``, ``backoff_factor``, ``max_batch_queries``, ``pool_size`` (default 16).
    """

    def _open(self) -> None:
        self._session = self._make_session()

    def _make_session(self) -> requests.Session:
        return retrying_session(self.max_retries, self.backoff_factor, self.timeout, self.pool_size)

    # A requests.Session holds sockets and locks; ship the settings and rebuild it.
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_session"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._open()

    def close(self) -> None:
        self._session.close()

    def __enter__(self) -> RetrievalClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def health_url(self) -> str:
        base = self.url[: -len("/retrieve")] if self.url.endswith("/retrieve") else self.url.rstrip("/")
        return base + "/health"

    def health(self) -> bool:
        """True when GET /health answers 200 (no retries: this is a probe)."""
        try:
            response = requests.get(self.health_url, timeout=self.timeout)
        except requests.RequestException:
            return False
        return response.status_code == 200

    def retrieve(
        self, queries: Sequence[str], topk: int | None = None, return_scores: bool = True
    ) -> list[list[Hit]]:
        """Hits for each query, in query order, best first.

        Without ``return_scores`` the server sends bare documents and every
        ``Hit.score`` is 0.0. Raises ``RetrievalError`` (or a subclass) on failure.
        """
        topk = self.topk if topk is None else topk
        return [hits for chunk in self._chunks(queries) for hits in self._post_chunk(chunk, topk, return_scores)]

    def _post_chunk(self, queries: list[str], topk: int, return_scores: bool) -> list[list[Hit]]:
        try:
            response = self._session.post(self.url, json=self._payload(queries, topk, return_scores),
                                          timeout=self.timeout)
        except requests.Timeout as exc:
            raise RetrievalTimeout(
                f"retrieval server did not answer within {self.timeout}s ({type(exc).__name__})",
                None,
                self.url,
            ) from exc
        except requests.ConnectionError as exc:
            raise RetrievalUnavailable(
                f"retrieval server unreachable after {self.max_retries} retries ({type(exc).__name__})",
                None,
                self.url,
            ) from exc
        except requests.RequestException as exc:
            raise RetrievalError(f"retrieval request failed: {exc}", None, self.url) from exc

        raise_for_retrieve_status(response, self.url, self.max_retries)
        return parse_retrieve_response(response, len(queries), self.url)


def raise_for_retrieve_status(response: Any, url: str, max_retries: int) -> None:
    """The typed error for a 4xx / 5xx answer (a requests or httpx response), after retries."""
    status = response.status_code
    if 400 <= status < 500:
        raise RetrievalBadRequest(f"retrieval server refused the request: {_error_detail(response)}", status, url)
    if status >= 500:
        raise RetrievalUnavailable(
            f"retrieval server answered HTTP {status} after {max_retries} retries: {_error_detail(response)}",
            status,
            url,
        )


def parse_retrieve_response(response: Any, n_queries: int, url: str) -> list[list[Hit]]:
    """The hits of a 2xx /retrieve answer (a requests or httpx response), one list per query."""
    status = response.status_code
    try:
        body = response.json()
    except ValueError as exc:
        raise RetrievalError("retrieval server answered with a body that is not JSON", status, url) from exc
    result = body.get("result") if isinstance(body, dict) else None
    if not isinstance(result, list):
        raise RetrievalError("retrieval server answer has no 'result' list", status, url)
    if len(result) != n_queries:
        raise RetrievalError(
            f"retrieval server answered {len(result)} result lists for {n_queries} queries", status, url
        )
    hits: list[list[Hit]] = []
    for i, per_query in enumerate(result):
        if not isinstance(per_query, list):
            raise RetrievalError(f"result[{i}] is not a list", status, url)
        try:
            hits.append([Hit.from_wire(obj) for obj in per_query])
        except (ValueError, TypeError, AttributeError) as exc:
            raise RetrievalError(f"result[{i}] holds a malformed hit: {exc}", status, url) from exc
    return hits
