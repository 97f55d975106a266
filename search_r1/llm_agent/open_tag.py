"""The tag protocol's second tag, `<open> doc_id </open>` (`GenerationConfig.open_tag`; trainer key
`open_tag.enable`): what answers an open.

The passage is read through the retrieval server's POST /open with the tool protocol's `OpenTool`
(tool_backends.py: one HTTP client for both protocols) and rendered inside the same
`<information>…</information>` framing as search results (actions.py). An id or page the server
does not have is an observation saying so (`open_not_found`); a server that does not answer is one
too (`open_failures`), after `retriever.max_retries` resends as for a search. Neither ends the row.
The per-row budget (`max_opens`) and the final-turn rule are the manager's (generation.py
`_runs_action`, `_apply_turn`).
"""

from __future__ import annotations

from collections import Counter

from search_r1.llm_agent import actions
from search_r1.llm_agent.generation_config import GenerationConfig
from search_r1.llm_agent.tool_backends import DocumentNotFound, OpenTool, ToolFailure


class OpenTag:
    """Answers the opens of one manager's rows (blocking HTTP; the async loop runs it in a thread)."""

    def __init__(self, config: GenerationConfig) -> None:
        self.config = config
        self._tool: OpenTool | None = None

    def _backend(self) -> OpenTool:
        if self._tool is None:
            if not self.config.search_url:
                raise ValueError("GenerationConfig.search_url (retriever.url) is required when the policy opens "
                                 "documents (open_tag.enable)")
            self._tool = OpenTool("open", {"retrieval_service_url": self.config.search_url,
                                           "page_size": self.config.open_page_size,
                                           "timeout": self.config.retrieval_timeout,
                                           "max_retries": self.config.retrieval_max_retries})
        return self._tool

    def observe(self, content: str, stats: Counter[str]) -> str:
        """The observation answering `<open>content</open>`; counts not-found ids and failures in `stats`."""
        doc_id, page = actions.parse_open(content)
        try:
            title, text = self._backend().read_doc(doc_id, page)
        except DocumentNotFound as err:
            stats["open_not_found"] += 1
            return actions.render_open_unknown(str(err))
        except ToolFailure:
            stats["open_failures"] += 1
            return actions.render_open_failure()
        return actions.render_open_page(title, text, doc_id)


__all__ = ["OpenTag"]
