"""What a tool backend returns to the rollout (tool_backends.py, mcp_tools.py): a result, or a
ToolFailure whose message the model reads after `Error: `; `redact`, which every text that
could hold an API key passes through before it is cut or shown; and `CallTool`, the
`verl.tools.base_tool.BaseTool` every built-in tool is. A leaf module both backends import."""

from __future__ import annotations

import asyncio
import json
import urllib.parse
from collections.abc import Iterable
from typing import Any

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from verl.utils.rollout_trace import rollout_trace_op


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


def as_schema(schema: Any, name: str = "") -> OpenAIFunctionToolSchema:
    """A tool schema as veRL's model (a dict from a tool config is validated; None: a bare one named `name`)."""
    if isinstance(schema, OpenAIFunctionToolSchema):
        return schema
    if schema is None:
        return OpenAIFunctionToolSchema(type="function", function={"name": name, "description": ""})
    return OpenAIFunctionToolSchema.model_validate(schema)


class CallTool(BaseTool):
    """A built-in tool: `call(arguments) -> str` (blocking, raising ToolFailure) answers each call;
    `execute` runs it in a thread. Built as veRL builds a tool, `cls(config, tool_schema)`; the older
    `cls(name, config)` form is kept for code that builds one directly."""

    KEYS: tuple[str, ...] = ()

    def __init__(self, config: Any, tool_schema: Any = None) -> None:
        if isinstance(config, str):        # cls(name, config)
            config, tool_schema = dict(tool_schema or {}), as_schema(None, config)
        super().__init__(dict(config), as_schema(tool_schema))

    def call(self, arguments: dict) -> str:
        raise NotImplementedError

    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
                      ) -> tuple[ToolResponse, float, dict]:
        return ToolResponse(text=await asyncio.to_thread(self.call, parameters)), 0.0, {}
