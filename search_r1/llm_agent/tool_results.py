"""What a tool backend returns to the rollout (tool_backends.py, mcp_tools.py): a result, or a
ToolFailure whose message the model reads after `Error: `. A leaf module both backends import."""

from __future__ import annotations

import json


class ToolFailure(Exception):
    """A call that could not be answered; the message is what the model reads (after `Error: `)."""


class DocumentNotFound(ToolFailure):
    """The server answered, but has no such document or page (its 404 / 400 to POST /open): the
    caller's request was wrong, the server is fine."""


def tool_result(text: str) -> str:
    """The JSON a tool message carries: {"result": text}."""
    return json.dumps({"result": text}, ensure_ascii=False)
