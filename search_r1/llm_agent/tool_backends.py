"""Tools beside the retrieval server's `search`: what answers a call of each, by class name.

A tool config (`multi_turn.tool_config_path`, veRL's layout) lists tools as
`{class_name, config, tool_schema}`; `search_r1.llm_agent.tools` validates the list and keeps
each tool here as plain JSON (`{name, class_name, config}`), so it travels to rollout workers;
`build_backend` makes the object that answers calls there.

- `OpenTool`: `open` a corpus passage by id (the retrieval server's POST /open) or a web page
  by URL (fetched directly, or through a Jina-reader-style service), one page of text a call.
- `SerperSearchTool`, `TavilySearchTool`: web search through those APIs (their request and
  response formats; `base_url` configurable).
- `MCPTool` (search_r1.llm_agent.mcp_tools): the tools of an MCP server.

Every tool's `config:` may set `max_calls_per_row` (calls one trajectory may make of it) and
`timeout` (seconds). API keys are read from the environment variable the config names
(`api_key_env`), never from the YAML, and never appear in a tool message, an error or a log.

Each is a `verl.tools.base_tool.BaseTool` (veRL's interface, through `tool_results.CallTool`): the rollout calls every
tool, these and a user's own, through `create` / `execute` / `calc_reward` / `release`; these answer
with a blocking `call(arguments) -> str` run in a thread. A `ToolFailure` raised by any tool's
`execute` is the error message the model reads (`{"result": "Error: ..."}`), counted as that tool's error.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import requests

from search_r1.llm_agent.tool_results import CallTool, DocumentNotFound, ToolFailure, as_schema, redact
from search_r1.llm_agent.tool_results import tool_result as _result
from search_r1.search import documents
from verl.tools.base_tool import BaseTool

COMMON_KEYS = ("max_calls_per_row", "timeout")


def _api_key(config: dict, default_env: str) -> str:
    env = config.get("api_key_env", default_env)
    key = os.environ.get(env, "")
    if not key:
        raise ToolFailure(f"the API key is not set (environment variable {env})")
    return key


def _post_json(url: str, body: dict, headers: dict, timeout: float, secret: str | None) -> Any:
    try:
        response = requests.post(url, json=body, headers=headers, timeout=timeout)
    except requests.RequestException as err:
        raise ToolFailure(redact(f"{type(err).__name__} from {url}", [secret])) from None
    if response.status_code != 200:
        # redacted whole, then cut: a cut first can leave a key's prefix that no longer matches
        raise ToolFailure(redact(f"HTTP {response.status_code} from {url}: {redact(response.text, [secret])[:200]}",
                                 [secret]))
    try:
        return response.json()
    except ValueError:
        raise ToolFailure(f"{url} did not answer JSON") from None


def _queries(arguments: dict) -> list[str]:
    queries = arguments.get("query_list", arguments.get("query"))
    if isinstance(queries, str):
        queries = [queries]
    if not isinstance(queries, list) or not queries or not all(isinstance(q, str) and q.strip() for q in queries):
        raise ToolFailure("'query_list' is missing, empty, or not a list of non-empty strings")
    return [q.strip() for q in queries]


def _hits(data: Any, field: str, topk: int) -> list[dict]:
    """The first `topk` dict entries of `data[field]`; anything else a provider answers counts as none."""
    entries = data.get(field) if isinstance(data, dict) else None
    return [h for h in entries[:topk] if isinstance(h, dict)] if isinstance(entries, list) else []


def _render_web_hits(per_query: list[list[tuple[str, str, str]]], key: str) -> str:
    """(title, snippet, url) per hit, per query, in the search tool's layout (and the URL to `open`);
    the API key redacted (a provider may echo the request)."""
    blocks = []
    for hits in per_query:
        text = "".join(f"Doc {i} (Title: {title})\n{snippet}\nURL: {url}\n\n" for i, (title, snippet, url)
                       in enumerate(hits, start=1))
        blocks.append(text.strip() or "No search results found.")
    return _result(redact("\n---\n".join(blocks), [key]))


class SerperSearchTool(CallTool):
    """Google results through Serper (POST {base_url}/search, `X-API-KEY` header, `{"q", "num"}`;
    answer `{"organic": [{"title", "link", "snippet"}]}`)."""

    KEYS = ("base_url", "api_key_env", "topk")

    def __init__(self, config: Any, tool_schema: Any = None) -> None:
        super().__init__(config, tool_schema)
        config = self.config
        self.base_url = str(config.get("base_url", "https://google.serper.dev")).rstrip("/")
        self.topk = int(config.get("topk", 3))
        self.timeout = float(config.get("timeout", 30))

    def call(self, arguments: dict) -> str:
        key = _api_key(self.config, "SERPER_API_KEY")
        per_query = []
        for q in _queries(arguments):
            data = _post_json(f"{self.base_url}/search", {"q": q, "num": self.topk},
                              {"X-API-KEY": key}, self.timeout, key)
            per_query.append([(str(h.get("title", "")), str(h.get("snippet", "")), str(h.get("link", "")))
                              for h in _hits(data, "organic", self.topk)])
        return _render_web_hits(per_query, key)


class TavilySearchTool(CallTool):
    """Web results through Tavily (POST {base_url}/search, `Authorization: Bearer` header,
    `{"query", "max_results"}`; answer `{"results": [{"title", "url", "content"}]}`)."""

    KEYS = ("base_url", "api_key_env", "topk", "search_depth")

    def __init__(self, config: Any, tool_schema: Any = None) -> None:
        super().__init__(config, tool_schema)
        config = self.config
        self.base_url = str(config.get("base_url", "https://api.tavily.com")).rstrip("/")
        self.topk = int(config.get("topk", 3))
        self.timeout = float(config.get("timeout", 30))
        self.depth = str(config.get("search_depth", "basic"))

    def call(self, arguments: dict) -> str:
        key = _api_key(self.config, "TAVILY_API_KEY")
        per_query = []
        for q in _queries(arguments):
            data = _post_json(f"{self.base_url}/search", {"query": q, "max_results": self.topk,
                                                          "search_depth": self.depth},
                              {"Authorization": f"Bearer {key}"}, self.timeout, key)
            per_query.append([(str(h.get("title", "")), str(h.get("content", "")), str(h.get("url", "")))
                              for h in _hits(data, "results", self.topk)])
        return _render_web_hits(per_query, key)


class OpenTool(CallTool):
    """`open`: `{"doc_id": ..., "page": 1}` reads a corpus passage from the retrieval server
    (POST /open); `{"url": ..., "page": 1}` fetches a web page (`fetcher: direct`, with
    `max_bytes` and `timeout` for the whole fetch, search_r1.search.web_fetch; or `fetcher: jina`, a
    Jina-reader-style GET {reader_url}/{url} that answers the page as text, the key sent to the
    reader's origin only and redacted from the text). Either way one page of `page_size` characters
    comes back."""

    KEYS = ("retrieval_service_url", "page_size", "fetcher", "reader_url", "api_key_env", "max_bytes",
            "allow_private_addresses", "max_retries", "backoff_factor")
    FETCHERS = ("none", "direct", "jina")

    def __init__(self, config: Any, tool_schema: Any = None) -> None:
        super().__init__(config, tool_schema)
        config = self.config
        url = config.get("retrieval_service_url")
        self.open_url = None if not url else str(url).rstrip("/").removesuffix("/retrieve") + "/open"
        self.page_size = int(config.get("page_size", documents.DEFAULT_PAGE_SIZE))
        self.fetcher = str(config.get("fetcher", "none"))
        self.reader_url = str(config.get("reader_url", "https://r.jina.ai")).rstrip("/")
        self.max_bytes = int(config.get("max_bytes", 2_000_000))
        self.timeout = float(config.get("timeout", 30))
        # `fetcher: direct` reaches public addresses only unless the operator allows private ones
        self.allow_private = bool(config.get("allow_private_addresses", False))
        # POST /open is retried as a search is (search_r1.search.client.retrying_session): refused
        # connections and 5xx answers, with backoff; a read timeout and 4xx answers are not.
        self.max_retries = int(config.get("max_retries", 3))
        self.backoff_factor = float(config.get("backoff_factor", 0.5))
        if self.max_retries < 0 or self.backoff_factor < 0:
            raise ValueError(f"open tool {self.name!r}: max_retries ({self.max_retries}) and backoff_factor "
                             f"({self.backoff_factor}) must be >= 0")
        self._session: requests.Session | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_session": None}   # sockets do not travel; rebuilt on first use

    def call(self, arguments: dict) -> str:
        page = arguments.get("page", 1)
        if not isinstance(page, int) or isinstance(page, bool) or page < 1:
            raise ToolFailure(f"'page' must be a positive integer, got {page!r}")
        if "doc_id" in arguments:
            return self._open_doc(str(arguments["doc_id"]), page)
        if isinstance(arguments.get("url"), str):
            return self._open_url(arguments["url"], page)
        raise ToolFailure("give 'doc_id' (from a search result) or 'url'")

    def _open_doc(self, doc_id: str, page: int) -> str:
        title, p = self.read_doc(doc_id, page)
        return _result(documents.render_page(title, p, f"doc {doc_id}"))

    def read_doc(self, doc_id: str, page: int) -> tuple[str, documents.Page]:
        """(title, page) of a corpus passage through the retrieval server's POST /open (also the tag
        protocol's `<open>`). No such document or page: `DocumentNotFound` (the server's message);
        the server unreachable or failing: `ToolFailure`."""
        if self.open_url is None:
            raise ToolFailure("this open tool reads URLs only; give 'url'")
        if self._session is None:
            from search_r1.search.client import retrying_session

            self._session = retrying_session(self.max_retries, self.backoff_factor, self.timeout, pool_size=4)
        try:
            response = self._session.post(self.open_url, timeout=self.timeout,
                                          json={"doc_id": doc_id, "page": page, "page_size": self.page_size})
        except requests.RequestException as err:
            raise ToolFailure(f"the retrieval server did not answer after {self.max_retries} retries "
                              f"({type(err).__name__})") from None
        if response.status_code in (400, 404):
            try:
                body = response.json()
            except ValueError:
                body = None
            detail = body.get("detail") if isinstance(body, dict) else None   # any JSON, or none
            raise DocumentNotFound(str(detail if detail is not None else response.text)[:500])
        if response.status_code != 200:
            raise ToolFailure(f"the retrieval server answered HTTP {response.status_code}")
        try:
            data = response.json()
            return str(data.get("title", "")), documents.Page(text=data["text"], page=data["page"],
                                                              num_pages=data["num_pages"])
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ToolFailure("the retrieval server's answer to /open is not {text, page, num_pages}") from None

    def _open_url(self, url: str, page: int) -> str:
        if self.fetcher == "none":
            raise ToolFailure("this open tool reads documents by 'doc_id' only")
        key = ""
        if self.fetcher == "jina":
            key = os.environ.get(self.config.get("api_key_env", "JINA_API_KEY"), "")
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            if not url.strip().lower().startswith(("http://", "https://")):
                raise ToolFailure(f"only http:// and https:// URLs can be opened, got {url!r}")
            # the reader is the operator's endpoint (it fetches the page, not this process); the key goes
            # to the reader's origin only, never to where it redirects
            fetch = (f"{self.reader_url}/{url.strip()}", headers, True)
        else:
            fetch = (url, {}, self.allow_private)
        try:
            title, text = documents.fetch_url(fetch[0], self.timeout, self.max_bytes, fetch[1], allow_private=fetch[2])
            # the whole text is redacted before it is cut into pages (a reader may echo the request headers)
            title, text = redact(title, [key]), redact(text, [key])
            p = documents.paginate(text, page, self.page_size)
        except (documents.FetchError, ValueError) as err:
            raise ToolFailure(redact(str(err), [key])) from None
        return _result(documents.render_page(title, p, url))


def _mcp_class() -> type:
    from search_r1.llm_agent.mcp_tools import MCPTool

    return MCPTool


BACKENDS: dict[str, Callable[[], type]] = {
    "search_r1.llm_agent.tool_backends.OpenTool": lambda: OpenTool,
    "search_r1.llm_agent.tool_backends.SerperSearchTool": lambda: SerperSearchTool,
    "search_r1.llm_agent.tool_backends.TavilySearchTool": lambda: TavilySearchTool,
    "search_r1.llm_agent.mcp_tools.MCPTool": _mcp_class,
}


def check_config(class_name: str, config: dict, where: str) -> None:
    """Refuse unknown or bad keys of a backend's `config:` block, naming `where` and the key."""
    cls = BACKENDS[class_name]()
    known = set(COMMON_KEYS) | set(cls.KEYS)
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(f"{where}.config: unknown keys {unknown}; known: {sorted(known)}")
    for key in ("max_calls_per_row", "topk", "page_size", "max_bytes"):
        if key in config and (not isinstance(config[key], int) or config[key] < 1):
            raise ValueError(f"{where}.config.{key}: must be an integer >= 1, got {config[key]!r}")
    if "timeout" in config and float(config["timeout"]) <= 0:
        raise ValueError(f"{where}.config.timeout: must be > 0, got {config['timeout']}")
    if cls is OpenTool:
        if config.get("fetcher", "none") not in OpenTool.FETCHERS:
            raise ValueError(f"{where}.config.fetcher: one of {list(OpenTool.FETCHERS)}, got {config['fetcher']!r}")
        if not config.get("retrieval_service_url") and config.get("fetcher", "none") == "none":
            raise ValueError(f"{where}.config: an open tool needs retrieval_service_url (documents by id) or a "
                             f"fetcher (direct, jina) for URLs")


def tool_class(class_name: str) -> type:
    """The class a tool config's `class_name` names: a built-in (BACKENDS), else any importable class or
    a `path/to/file.py:Class` (verl/tools/utils/tool_registry.py)."""
    if class_name in BACKENDS:
        return BACKENDS[class_name]()
    from verl.tools.utils.tool_registry import get_tool_class

    return get_tool_class(class_name)


def build_tool(entry: dict, schema: Any = None) -> BaseTool:
    """The tool object answering calls of one configured tool (`{name, class_name, config}`), built as veRL
    builds one: `cls(config, tool_schema)`."""
    return tool_class(entry["class_name"])(config=dict(entry["config"]), tool_schema=as_schema(schema, entry["name"]))


def build_backend(entry: dict) -> Any:
    """`build_tool` without a schema (a built-in's name only)."""
    return build_tool(entry)


def run_call(backend: Any, arguments: dict) -> tuple[str, bool]:
    """(tool message text, ok) of one call; a failure becomes `{"result": "Error: ..."}`."""
    try:
        return backend.call(arguments), True
    except ToolFailure as err:
        return _result(f"Error: {err}"), False


__all__ = ["BACKENDS", "COMMON_KEYS", "CallTool", "DocumentNotFound", "OpenTool", "SerperSearchTool", "TavilySearchTool",
           "ToolFailure", "as_schema", "build_backend", "build_tool", "check_config", "run_call", "tool_class"]
