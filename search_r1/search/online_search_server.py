"""Web search (SerpAPI, Google Custom Search, or Brave) behind the /retrieve API.

The trainer cannot tell this server from a local index: each query's web results come
back as ``{"id": <url>, "contents": "\\"<title>\\"\\n<snippet>"}``, best first, with a
rank-based score ``1 / rank``. A batch's queries are sent upstream concurrently
(a bounded thread pool); if any of them fails the request answers 502 with a message.

    export SERP_API_KEY=...            # serpapi
    export GOOGLE_API_KEY=... GOOGLE_CSE_ID=...   # google
    export BRAVE_API_KEY=...           # brave
    python -m search_r1.search.online_search_server --search_engine serpapi --topk 3 --port 8000

Departures from the original Search-R1 search servers: API keys are read only from
environment variables (never a command-line flag, which ``ps`` and shell history would
show) and never appear in logs, error messages, answers or reprs; the upstream base URL
is overridable (``--search_url`` or ``SERPAPI_BASE_URL`` / ``GOOGLE_CSE_BASE_URL`` /
``BRAVE_BASE_URL``), which is how the tests point it at a local fake; bad requests get a
4xx with the same validation as the retrieval server.
"""

from __future__ import annotations

import argparse
import html
import logging
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, quote_plus

import requests
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from requests.adapters import HTTPAdapter
from starlette.concurrency import run_in_threadpool
from urllib3.util.retry import Retry

from search_r1.search.schema import Hit, RetrieveRequest, ServerLimits, ValidRequest, validate_request
from search_r1.search.serving import configure_logging, install_request_errors, read_json_body

logger = logging.getLogger(__name__)

ENGINES = ("serpapi", "google", "brave")
# urllib3 logs request URLs (SerpAPI's key is a query parameter) at DEBUG, and retries at WARNING.
_TRANSPORT_LOGGERS = (
    "urllib3.connectionpool",
    "urllib3.connection",
    "urllib3.util.retry",
    "urllib3.poolmanager",
    "urllib3.response",
    "requests",
)


class Secret:
    """A credential whose str/repr never shows the value; ``reveal()`` is the one way out."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__

    def __reduce__(self) -> Any:
        raise TypeError("a Secret is not picklable; read it from the environment where it is used")


def read_secret(env_var: str, environ: Mapping[str, str] | None = None) -> Secret:
    """The credential in ``env_var``; a missing one names the variable (never a value)."""
    value = (environ if environ is not None else os.environ).get(env_var, "")
    if not value:
        raise RuntimeError(f"environment variable {env_var} is not set; export it before starting the server")
    return Secret(value)


class _RedactSecrets(logging.Filter):
    """Rewrites log records that would contain a secret (raw or URL-encoded)."""

    def __init__(self) -> None:
        super().__init__()
        self.needles: set[str] = set()

    def add(self, secret: Secret) -> None:
        raw = secret.reveal()
        self.needles.update({raw, quote_plus(raw), quote(raw, safe="")})

    def redact(self, text: str) -> str:
        for needle in self.needles:
            text = text.replace(needle, "***")
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = self.redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, ()
        return True


_REDACTOR = _RedactSecrets()
for _name in _TRANSPORT_LOGGERS:
    logging.getLogger(_name).addFilter(_REDACTOR)


class UpstreamError(RuntimeError):
    """The search API failed; the message is safe to show (it holds no credential)."""


_TAG = re.compile(r"<[^>]+>")


def _plain(text: str | None) -> str:
    """Snippets may carry HTML highlighting (Brave's <strong>) and entities."""
    return html.unescape(_TAG.sub("", text or "")).strip()


def _make_hits(items: Sequence[tuple[str, str, str]], topk: int) -> list[Hit]:
    """(id, title, snippet) in engine order -> Hits with score 1/rank."""
    return [
        Hit.from_contents(doc_id, f'"{title}"\n{snippet}', 1.0 / rank)
        for rank, (doc_id, title, snippet) in enumerate(items[:topk], start=1)
    ]


def _items(payload: Any, *path: str) -> list[dict[str, Any]]:
    """``payload[path...]`` as a list of result dicts; absent means no results."""
    node = payload
    for key in path:
        if not isinstance(node, dict):
            raise UpstreamError(f"search API answer has no object at '{key}'")
        node = node.get(key, [])
    if not isinstance(node, list):
        raise UpstreamError(f"search API answer field '{'.'.join(path)}' is not a list")
    return [item for item in node if isinstance(item, dict)]


@dataclass(frozen=True)
class UpstreamCall:
    """One HTTP GET to the search API; holds credentials, so it is never logged or shown."""

    url: str
    params: dict[str, Any]
    headers: dict[str, str]

    def __repr__(self) -> str:
        return f"UpstreamCall(url={self.url!r}, params=<hidden>, headers=<hidden>)"


class SearchEngine(ABC):
    """One web search API: how to ask it, and how to read its answer."""

    name: str = ""
    default_base_url: str = ""
    base_url_env: str = ""
    key_envs: tuple[str, ...] = ()
    max_topk: int = 10
    # Where the answer keeps its result list, and each result's URL and snippet fields.
    results_path: tuple[str, ...] = ()
    url_field: str = "link"
    snippet_field: str = "snippet"

    def __init__(self, base_url: str, secrets: Mapping[str, Secret]) -> None:
        self.base_url = base_url
        self._secrets = dict(secrets)
        for secret in self._secrets.values():
            _REDACTOR.add(secret)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(base_url={self.base_url!r})"

    def _key(self, env_var: str) -> str:
        return self._secrets[env_var].reveal()

    def redact(self, text: str) -> str:
        return _REDACTOR.redact(text)

    @abstractmethod
    def build_call(self, query: str, topk: int) -> UpstreamCall: ...

    def parse(self, payload: Any, topk: int) -> list[Hit]:
        """The answer's results, in engine order, as Hits; a result without a URL gets ``<engine>-<i>``."""
        rows = [
            (
                str(r.get(self.url_field, f"{self.name}-{i}")),
                _plain(r.get("title")),
                _plain(r.get(self.snippet_field)),
            )
            for i, r in enumerate(_items(payload, *self.results_path))
        ]
        return _make_hits(rows, topk)


class SerpApiEngine(SearchEngine):
    name = "serpapi"
    default_base_url = "https://serpapi.com/search"
    base_url_env = "SERPAPI_BASE_URL"
    key_envs = ("SERP_API_KEY",)
    max_topk = 100
    results_path = ("organic_results",)

    def __init__(self, base_url: str, secrets: Mapping[str, Secret], serp_engine: str = "google") -> None:
        super().__init__(base_url, secrets)
        self.serp_engine = serp_engine

    def build_call(self, query: str, topk: int) -> UpstreamCall:
        # SerpAPI accepts the key only as a query parameter; _REDACTOR keeps it out of urllib3's logs.
        params = {"engine": self.serp_engine, "q": query, "num": topk, "api_key": self._key("SERP_API_KEY")}
        return UpstreamCall(self.base_url, params, {})


class GoogleCseEngine(SearchEngine):
    name = "google"
    default_base_url = "https://www.googleapis.com/customsearch/v1"
    base_url_env = "GOOGLE_CSE_BASE_URL"
    key_envs = ("GOOGLE_API_KEY", "GOOGLE_CSE_ID")
    max_topk = 10  # the API's cap on ``num``
    results_path = ("items",)

    def build_call(self, query: str, topk: int) -> UpstreamCall:
        # Google APIs take the key in a header, which keeps it out of URLs altogether.
        params = {"cx": self._key("GOOGLE_CSE_ID"), "q": query, "num": topk}
        return UpstreamCall(self.base_url, params, {"X-goog-api-key": self._key("GOOGLE_API_KEY")})


class BraveEngine(SearchEngine):
    name = "brave"
    default_base_url = "https://api.search.brave.com/res/v1/web/search"
    base_url_env = "BRAVE_BASE_URL"
    key_envs = ("BRAVE_API_KEY",)
    max_topk = 20  # the API's cap on ``count``
    results_path = ("web", "results")
    url_field = "url"
    snippet_field = "description"

    def build_call(self, query: str, topk: int) -> UpstreamCall:
        headers = {"X-Subscription-Token": self._key("BRAVE_API_KEY"), "Accept": "application/json"}
        return UpstreamCall(self.base_url, {"q": query, "count": topk}, headers)


ENGINE_CLASSES: dict[str, type[SearchEngine]] = {
    "serpapi": SerpApiEngine,
    "google": GoogleCseEngine,
    "brave": BraveEngine,
}


@dataclass(frozen=True)
class OnlineSearchConfig:
    """Serving settings; credentials are deliberately not here (they come from the environment)."""

    engine: str = "serpapi"
    base_url: str | None = None
    default_topk: int = 3
    timeout: float = 10.0
    concurrency: int = 8
    upstream_retries: int = 2
    backoff_factor: float = 0.3
    serp_engine: str = "google"
    max_queries_per_request: int = 64
    max_body_bytes: int = ServerLimits.max_body_bytes

    def __post_init__(self) -> None:
        if self.engine not in ENGINE_CLASSES:
            raise ValueError(f"--search_engine must be one of {ENGINES}, got {self.engine!r}")
        if self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.timeout <= 0:
            raise ValueError(f"--timeout must be > 0, got {self.timeout}")


def load_engine(config: OnlineSearchConfig, environ: Mapping[str, str] | None = None) -> SearchEngine:
    """The configured engine with its keys read from the environment; base URL: flag > env > default."""
    env = environ if environ is not None else os.environ
    cls = ENGINE_CLASSES[config.engine]
    base_url = config.base_url or env.get(cls.base_url_env) or cls.default_base_url
    secrets = {name: read_secret(name, env) for name in cls.key_envs}
    if cls is SerpApiEngine:
        return SerpApiEngine(base_url, secrets, serp_engine=config.serp_engine)
    return cls(base_url, secrets)


class OnlineSearchService:
    """Fans a batch of queries out to the search API and maps the answers to Hits."""

    def __init__(self, engine: SearchEngine, config: OnlineSearchConfig) -> None:
        self.engine = engine
        self.config = config
        self._pool = ThreadPoolExecutor(
            max_workers=config.concurrency, thread_name_prefix=f"{engine.name}-search"
        )
        retry = Retry(
            total=config.upstream_retries,
            read=False,
            status_forcelist=(429, 500, 502, 503, 504),
            allowed_methods=frozenset({"GET"}),
            backoff_factor=config.backoff_factor,
            raise_on_status=False,
        )
        self._session = requests.Session()
        adapter = HTTPAdapter(pool_maxsize=config.concurrency, max_retries=retry)
        self._session.mount("http://", adapter)
        self._session.mount("https://", adapter)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._session.close()

    def search_one(self, query: str, topk: int) -> list[Hit]:
        call = self.engine.build_call(query, topk)
        name = self.engine.name
        try:
            response = self._session.get(
                call.url, params=call.params, headers=call.headers, timeout=self.config.timeout
            )
        except requests.Timeout:
            # `from None`: the original exception's text holds the full URL, key included.
            raise UpstreamError(f"{name} did not answer within {self.config.timeout}s") from None
        except requests.RequestException as exc:
            raise UpstreamError(f"{name} could not be reached ({type(exc).__name__})") from None
        if response.status_code != 200:
            detail = self.engine.redact(response.text[:300])
            raise UpstreamError(f"{name} answered HTTP {response.status_code}: {detail}")
        try:
            payload = response.json()
        except ValueError:
            raise UpstreamError(f"{name} answered with a body that is not JSON") from None
        return self.engine.parse(payload, topk)

    def search_batch(self, queries: Sequence[str], topk: int) -> list[list[Hit]]:
        """Hits per query, in query order; the first upstream failure is raised."""
        return list(self._pool.map(self.search_one, queries, [topk] * len(queries)))


def create_online_search_app(service: OnlineSearchService) -> FastAPI:
    """FastAPI app answering POST /retrieve from the web, and GET /health (which calls nothing upstream)."""
    config = service.config
    limits = ServerLimits(
        max_queries_per_request=config.max_queries_per_request,
        max_topk=service.engine.max_topk,
        max_body_bytes=config.max_body_bytes,
    )
    app = FastAPI(title=f"Search-R1 online search ({service.engine.name})")
    install_request_errors(app)

    def search(valid: ValidRequest) -> Any:
        try:
            results = service.search_batch(valid.queries, valid.topk)
        except UpstreamError as exc:
            message = service.engine.redact(str(exc))
            logger.warning(
                "upstream search failed for a batch of %d queries: %s", len(valid.queries), message
            )
            return JSONResponse({"detail": f"upstream search failed: {message}"}, status_code=502)
        return {"result": [[h.to_wire(valid.return_scores) for h in hits] for hits in results]}

    @app.post("/retrieve")
    async def retrieve(request: Request) -> Any:
        body = await read_json_body(request, RetrieveRequest, limits.max_body_bytes)
        valid = validate_request(body, limits, config.default_topk)
        # search_batch waits on the upstream calls; keep that wait off the event loop.
        return await run_in_threadpool(search, valid)

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "engine": service.engine.name, "max_topk": service.engine.max_topk}

    return app


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--search_engine", default="serpapi", choices=ENGINES)
    p.add_argument(
        "--search_url", default=None, help="Override the search API base URL (else env, else default)."
    )
    p.add_argument("--topk", type=int, default=3, help="Results per query when a request gives no topk.")
    p.add_argument("--serp_engine", default="google", help="SerpAPI's own 'engine' parameter.")
    p.add_argument("--timeout", type=float, default=10.0, help="Seconds to wait for one upstream call.")
    p.add_argument("--concurrency", type=int, default=8, help="Upstream calls in flight at once.")
    p.add_argument(
        "--upstream_retries", type=int, default=2, help="Retries on connection errors, 429 and 5xx."
    )
    p.add_argument("--max_queries_per_request", type=int, default=64)
    p.add_argument("--max_body_bytes", type=int, default=ServerLimits.max_body_bytes)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    import uvicorn

    configure_logging()
    args = parse_args(argv)
    config = OnlineSearchConfig(
        engine=args.search_engine,
        base_url=args.search_url,
        default_topk=args.topk,
        timeout=args.timeout,
        concurrency=args.concurrency,
        upstream_retries=args.upstream_retries,
        serp_engine=args.serp_engine,
        max_queries_per_request=args.max_queries_per_request,
        max_body_bytes=args.max_body_bytes,
    )
    service = OnlineSearchService(load_engine(config), config)
    try:
        uvicorn.run(create_online_search_app(service), host=args.host, port=args.port)
    finally:
        service.close()


if __name__ == "__main__":
    main()
