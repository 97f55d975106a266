"""An MCP server exposing a running retrieval server as two tools, `search` and `open`.

    python -m search_r1.search.mcp_server --retrieval_url http://127.0.0.1:8000/retrieve             # stdio
    python -m search_r1.search.mcp_server --retrieval_url ... --transport http --port 8010             # streamable HTTP at /mcp

`search(query_list, topk)` answers as the rollout's search tool does (veRL SearchTool's text; each
hit with its `doc_id`); `open(doc_id, page)` reads one page of a passage through POST /open. Any MCP
client can use them; a rollout lists them in its tool config with
`class_name: search_r1.llm_agent.mcp_tools.MCPTool` (docs/agent.md, "Tools").

Hostile input: an error message quotes at most ``schema.MAX_ECHO_CHARS`` characters of a client's
value (the library logs each tool error; a 2 MB doc_id echoed whole stalled every session for
seconds), and over stdio a line that is not a JSON-RPC message is answered with a JSON-RPC error
(-32700 not JSON, -32600 not a message) instead of being dropped, which left the client waiting.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import TracebackType
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import httpx  # noqa: E402

from search_r1.llm_agent import tools  # noqa: E402
from search_r1.search.documents import DEFAULT_PAGE_SIZE, Page, render_page  # noqa: E402
from search_r1.search.schema import MAX_ECHO_CHARS, Hit  # noqa: E402

# An error message passed on from the retrieval server is cut to this many characters (it quotes a
# client's value at most MAX_ECHO_CHARS long, but an older or other server may quote it whole).
_MAX_DETAIL_CHARS = 2 * MAX_ECHO_CHARS + 200


def _cut(text: str, limit: int = _MAX_DETAIL_CHARS) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def build_server(retrieval_url: str, topk: int = 3, page_size: int = DEFAULT_PAGE_SIZE, timeout: float = 30.0) -> Any:
    """The MCPServer with `search` and `open` bound to the retrieval server at `retrieval_url` (/retrieve)."""
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError

    base = retrieval_url.rstrip("/").removesuffix("/retrieve")
    topk_default = int(topk)
    server = MCPServer("search-r1-retrieval", instructions="Search a passage corpus and open passages by doc_id.")

    @server.tool(name="search", description="Searches the corpus for passages relevant to each query; every hit "
                                            "names its doc_id, which `open` reads in full.")
    async def search(query_list: list[str], topk: int | None = None) -> str:
        queries = [q.strip() for q in query_list if isinstance(q, str) and q.strip()]
        if not queries:
            raise ToolError(tools.BAD_QUERY_LIST_TEXT)
        async with httpx.AsyncClient(timeout=timeout) as client:
            response = await client.post(f"{base}/retrieve", json={"queries": queries, "topk": topk or topk_default,
                                                                   "return_scores": True})
        if response.status_code != 200:
            raise ToolError(f"the retrieval server answered HTTP {response.status_code}: {_cut(response.text, 200)}")
        hits = [[Hit.from_contents(str(h["document"]["id"]), h["document"]["contents"], h.get("score", 0.0))
                 for h in per_query] for per_query in response.json()["result"]]
        return json.loads(tools.render_search_results(hits, show_doc_ids=True))["result"]

    @server.tool(name="open", description="Opens a passage by the doc_id a search result gave; long passages come "
                                          "in pages (page 1 first).")
    async def open_document(doc_id: str, page: int = 1) -> str:
        async with httpx.AsyncClient(timeout=timeout) as client:
            response = await client.post(f"{base}/open", json={"doc_id": doc_id, "page": page, "page_size": page_size})
        if response.status_code in (400, 404):
            try:
                detail = str(response.json().get("detail", response.text))
            except (ValueError, AttributeError):
                detail = response.text
            raise ToolError(_cut(detail))
        if response.status_code != 200:
            raise ToolError(f"the retrieval server answered HTTP {response.status_code}")
        data = response.json()
        return render_page(data.get("title", ""), Page(data["text"], data["page"], data["num_pages"]), f"doc {doc_id}")

    return server


def error_reply(err: Exception) -> Any:
    """The JSON-RPC error answering a stdio line the transport could not read as a message (``err``,
    pydantic's error): -32700 when the line is not JSON, else -32600 with the message's id when it
    has a usable one. The message names what was wrong, never the line's content."""
    import mcp_types as types

    errors = err.errors() if hasattr(err, "errors") else []
    if not errors or any(e["type"] == "json_invalid" for e in errors):
        error = types.ErrorData(code=types.PARSE_ERROR, message="Parse error: the line is not valid JSON")
        return types.JSONRPCError(jsonrpc="2.0", id=None, error=error)
    message_id = None
    for e in errors:
        found = e.get("input").get("id") if isinstance(e.get("input"), dict) else None
        if isinstance(found, str) or (isinstance(found, int) and not isinstance(found, bool)):
            message_id = found
            break
    error = types.ErrorData(code=types.INVALID_REQUEST, message="Invalid Request: JSON, but not a JSON-RPC 2.0 "
                                                                "request, notification or response")
    return types.JSONRPCError(jsonrpc="2.0", id=message_id, error=error)


class AnswerUnreadableLines:
    """The stdio transport's read stream, answering each line it could not parse (the transport
    passes it on as an exception, which the server drops) with ``error_reply`` on ``write_stream``.
    Everything else passes through unchanged, with the sender's context (``last_context``)."""

    def __init__(self, inner: Any, write_stream: Any) -> None:
        self._inner, self._write_stream = inner, write_stream

    @property
    def last_context(self) -> Any:
        return getattr(self._inner, "last_context", None)

    async def receive(self) -> Any:
        from mcp.shared.message import SessionMessage

        while True:
            item = await self._inner.receive()
            if not isinstance(item, Exception):
                return item
            await self._write_stream.send(SessionMessage(error_reply(item)))

    async def aclose(self) -> None:
        await self._inner.aclose()

    def __aiter__(self) -> AnswerUnreadableLines:
        return self

    async def __anext__(self) -> Any:
        import anyio

        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def __aenter__(self) -> AnswerUnreadableLines:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()


async def run_stdio(server: Any) -> None:
    """``server.run("stdio")``, but a line that is not a JSON-RPC message gets a JSON-RPC error reply.
    (MCPServer has no public hook between its stdio transport and its session: this is its
    ``run_stdio_async`` with the read stream wrapped.)"""
    from mcp.server.stdio import stdio_server

    lowlevel = server._lowlevel_server
    async with stdio_server() as (read_stream, write_stream):
        await lowlevel.run(AnswerUnreadableLines(read_stream, write_stream), write_stream,
                           lowlevel.create_initialization_options())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--retrieval_url", required=True, help="the retrieval server's /retrieve URL")
    p.add_argument("--transport", choices=("stdio", "http"), default="stdio")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8010)
    p.add_argument("--topk", type=int, default=3)
    p.add_argument("--page_size", type=int, default=DEFAULT_PAGE_SIZE, help="characters per page of `open`")
    args = p.parse_args(argv)
    server = build_server(args.retrieval_url, topk=args.topk, page_size=args.page_size)
    if args.transport == "stdio":
        import anyio

        anyio.run(run_stdio, server)
    else:
        server.run("streamable-http", host=args.host, port=args.port)


if __name__ == "__main__":
    main()
