"""An MCP server exposing a running retrieval server as two tools, `search` and `open`.

    python -m search_r1.search.mcp_server --retrieval_url http://127.0.0.1:8000/retrieve             # stdio
    python -m search_r1.search.mcp_server --retrieval_url ... --transport http --port 8010             # streamable HTTP at /mcp

`search(query_list, topk)` answers as the rollout's search tool does (veRL SearchTool's text; each
hit with its `doc_id`); `open(doc_id, page)` reads one page of a passage through POST /open. Any MCP
client can use them; a rollout lists them in its tool config with
`class_name: search_r1.llm_agent.mcp_tools.MCPTool` (docs/agent.md, "Tools").
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import httpx  # noqa: E402

from search_r1.llm_agent import tools  # noqa: E402
from search_r1.search.documents import DEFAULT_PAGE_SIZE, Page, render_page  # noqa: E402
from search_r1.search.schema import Hit  # noqa: E402


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
            raise ToolError(f"the retrieval server answered HTTP {response.status_code}: {response.text[:200]}")
        hits = [[Hit.from_contents(str(h["document"]["id"]), h["document"]["contents"], h.get("score", 0.0))
                 for h in per_query] for per_query in response.json()["result"]]
        return json.loads(tools.render_search_results(hits, show_doc_ids=True))["result"]

    @server.tool(name="open", description="Opens a passage by the doc_id a search result gave; long passages come "
                                          "in pages (page 1 first).")
    async def open_document(doc_id: str, page: int = 1) -> str:
        async with httpx.AsyncClient(timeout=timeout) as client:
            response = await client.post(f"{base}/open", json={"doc_id": doc_id, "page": page, "page_size": page_size})
        if response.status_code in (400, 404):
            raise ToolError(response.json().get("detail", response.text))
        if response.status_code != 200:
            raise ToolError(f"the retrieval server answered HTTP {response.status_code}")
        data = response.json()
        return render_page(data.get("title", ""), Page(data["text"], data["page"], data["num_pages"]), f"doc {doc_id}")

    return server


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
        server.run("stdio")
    else:
        server.run("streamable-http", host=args.host, port=args.port)


if __name__ == "__main__":
    main()
