"""`SearchTool`: the search tool of veRL's Search-R1 recipe, over this project's retrieval server.

The class a recipe's tool config names (`class_name: verl.tools.search_tool.SearchTool`), with veRL's
`config:` keys (`retrieval_service_url`, `topk`, `timeout`, ...; docs/agent.md "Tools"). Its answer
is veRL SearchTool's text, byte for byte: per query `Doc i (Title: ...)\\n...` blocks, queries joined
by `\\n---\\n`, JSON-wrapped.

In the tool protocol's own loop (`tool_agent`) the search calls of a turn are not sent one by one:
every row's queries of the turn go to the retrieval server in one request (sync mode) or one request
per trajectory turn (async mode), rendered with the same functions. `execute` answers one call the
same way, for an agent loop of your own that loads tools with `initialize_tools_from_config`.
"""

from __future__ import annotations

from typing import Any

from search_r1.llm_agent import tools
from search_r1.llm_agent.tool_results import CallTool


class SearchTool(CallTool):
    """`search(query_list)` against the retrieval server's POST /retrieve."""

    KEYS = tools.SEARCH_TOOL_KEYS

    def __init__(self, config: Any, tool_schema: Any = None) -> None:
        super().__init__(config, tool_schema)
        known = {k: v for k, v in self.config.items() if k in tools.SEARCH_TOOL_KEYS and k != "max_calls_per_row"}
        self.settings = tools.SearchToolSettings(**known)
        self._client: Any = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_client": None}   # sockets do not travel; reopened on first use

    def call(self, arguments: dict) -> str:
        from search_r1.search.client import RetrievalError
        from search_r1.search.serve_client import open_retrieval_client

        queries = tools.search_queries(tools.ToolCall(self.name, arguments))
        if queries is None:
            return tools.render_bad_query_list()
        if self._client is None:
            s = self.settings
            self._client = open_retrieval_client(s.retrieval_service_url, topk=int(s.topk), timeout=float(s.timeout))
        try:
            results = self._client.retrieve(queries, topk=int(self.settings.topk), return_scores=True)
        except RetrievalError as err:
            return tools.render_search_error(str(err))
        return tools.render_search_results(results, self.settings.show_doc_ids)


__all__ = ["SearchTool"]
