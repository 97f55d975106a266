"""What a tool backend returns to the rollout (tool_backends.py, mcp_tools.py): a result, or a
ToolFailure whose message the model reads after `Error: `; and `redact`, which every text that
could hold an API key passes through before it is cut or shown. A leaf module both backends import."""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Iterable


class ToolFailure(Exception):
    """A call that could not be answered; the message is what the model reads (after `Error: `)."""


class DocumentNotFound(ToolFailure):
    """The server answered, but has no such document or page (its 404 / 400 to POST /open): the
    caller's request was wrong, the server is fine."""


def tool_result(text: str) -> str:
    """The JSON a tool message carries: {"result": text}."""
    return json.dumps({"result": text}, ensure_ascii=False)


def redact(text: str, secrets: Iterable[str | None]) -> str:
    """`text` with each non-empty secret replaced by `***`, as written and in the forms a server may
    echo it (URL-quoted, JSON-escaped). Call it on the whole text, before any cut: a cut can leave a
    key's prefix that no longer matches."""
    for secret in secrets:
        if not secret:
            continue
        forms = {secret, urllib.parse.quote(secret, safe=""), urllib.parse.quote_plus(secret),
                 json.dumps(secret)[1:-1]}
        for form in sorted(forms, key=len, reverse=True):
            text = text.replace(form, "***")
    return text
