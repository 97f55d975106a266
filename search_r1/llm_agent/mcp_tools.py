"""Tools from an MCP server (stdio or streamable HTTP), called from the rollout.

A tool config entry

    - class_name: search_r1.llm_agent.mcp_tools.MCPTool
      config:
        transport: stdio                 # or http, with url: http://127.0.0.1:8010/mcp
        command: [python, -m, search_r1.search.mcp_server, --retrieval_url, http://127.0.0.1:8000/retrieve]
        cwd: /path/to/Search-R1        # optional: the server's working directory (stdio)
        env: {KEY: value}              # optional: added to the server's environment (stdio)
        tools: [search, open]            # optional: the server's tools to offer (default: all)
        timeout: 30                      # seconds per call
        max_calls_per_row: 8             # optional budget, per tool, per trajectory

declares the server's tools; their schemas are listed from the server when the config is loaded
(on the driver) and go to the chat template like any tool's. Each rollout process keeps one
connection per server, opened on the first call, on an event loop thread of its own, so sync and
async rollouts call it alike. A call that fails, times out or that the server answers with an
error becomes an `Error: ...` tool message and counts in `tools/<name>/errors`.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import threading
from typing import Any

from search_r1.llm_agent.tool_results import CallTool, ToolFailure
from search_r1.llm_agent.tool_results import tool_result as _result

TRANSPORTS = ("stdio", "http")
CONNECT_TIMEOUT_S = 60.0


def _target(config: dict, where: str = "mcp") -> Any:
    transport = config.get("transport")
    if transport == "stdio":
        from mcp.client.stdio import StdioServerParameters

        command = config.get("command")
        if not isinstance(command, list) or not command or not all(isinstance(c, str) for c in command):
            raise ValueError(f"{where}.config.command: a list of strings (the MCP server's command line)")
        env = config.get("env")
        if env is not None:
            env = {**os.environ, **{str(k): str(v) for k, v in env.items()}}
        return StdioServerParameters(command=command[0], args=command[1:], env=env, cwd=config.get("cwd"))
    if transport == "http":
        url = config.get("url")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"{where}.config.url: the MCP server's streamable HTTP URL (e.g. http://127.0.0.1:8010/mcp)")
        return url
    raise ValueError(f"{where}.config.transport: one of {list(TRANSPORTS)}, got {transport!r}")


class MCPConnection:
    """One MCP client session, kept open on an event loop thread of its own."""

    def __init__(self, config: dict) -> None:
        self.target = _target(config)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="mcp-client")
        self._thread.start()
        self._client: Any = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._task = asyncio.run_coroutine_threadsafe(self._hold(), self._loop)
        if not self._ready.wait(CONNECT_TIMEOUT_S) or self._error is not None:
            self.close()
            raise ToolFailure(f"could not connect to the MCP server ({type(self._error).__name__ if self._error else 'timeout'})")

    async def _hold(self) -> None:
        from mcp import Client

        self._stop = asyncio.Event()
        try:
            async with Client(self.target) as client:
                self._client = client
                self._ready.set()
                await self._stop.wait()
        except BaseException as err:   # noqa: BLE001 - reported to the caller waiting on _ready
            self._error = err
            self._ready.set()

    def run(self, coro: Any, timeout: float) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise

    def list_tools(self, timeout: float = 30.0) -> list[Any]:
        return list(self.run(self._client.list_tools(), timeout).tools)

    def call_tool(self, name: str, arguments: dict, timeout: float) -> Any:
        return self.run(self._client.call_tool(name, arguments), timeout)

    def close(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            try:
                self._task.result(10)
            except Exception:  # noqa: BLE001 - closing anyway
                pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


_connections: dict[str, MCPConnection] = {}
_lock = threading.Lock()


def connection(config: dict) -> MCPConnection:
    """This process's connection to the server `config` names (opened once, closed at exit)."""
    key = repr((config.get("transport"), config.get("command"), config.get("url"), config.get("env"), config.get("cwd")))
    with _lock:
        if key not in _connections:
            _connections[key] = MCPConnection(config)
        return _connections[key]


@atexit.register
def close_all() -> None:
    with _lock:
        for conn in _connections.values():
            conn.close()
        _connections.clear()


def _schema(tool: Any) -> dict:
    return {"type": "function", "function": {"name": tool.name, "description": tool.description or "",
                                             "parameters": tool.input_schema or {"type": "object", "properties": {}}}}


def list_tool_schemas(config: dict, where: str) -> list[dict]:
    """The OpenAI function schemas of the server's tools (those in `config.tools`, when given)."""
    _target(config, where)
    try:
        conn = MCPConnection(config)
    except ToolFailure as err:
        raise ValueError(f"{where}: {err} ({config.get('transport')})") from None
    try:
        listed = conn.list_tools(float(config.get("timeout", 30)))
    finally:
        conn.close()
    names = [t.name for t in listed]
    wanted = config.get("tools")
    if wanted is not None:
        missing = [n for n in wanted if n not in names]
        if missing:
            raise ValueError(f"{where}.config.tools: the MCP server has no tools {missing}; it has {names}")
        listed = [t for t in listed if t.name in wanted]
    return [_schema(t) for t in listed]


class MCPTool(CallTool):
    """Calls one tool of an MCP server (the tool its schema names); its answer's text blocks, joined,
    are the tool message."""

    KEYS = ("transport", "command", "url", "env", "cwd", "tools")

    def __init__(self, config: Any, tool_schema: Any = None) -> None:
        super().__init__(config, tool_schema)
        self.timeout = float(self.config.get("timeout", 30))

    def call(self, arguments: dict) -> str:
        conn = connection(self.config)
        try:
            result = conn.call_tool(self.name, arguments, self.timeout)
        except TimeoutError:
            raise ToolFailure(f"tool {self.name!r} did not answer within {self.timeout} s") from None
        except Exception as err:   # noqa: BLE001 - a protocol or transport error is the model's to read
            raise ToolFailure(f"tool {self.name!r} failed ({type(err).__name__}: {err})") from None
        text = "\n".join(getattr(block, "text", "") for block in result.content if getattr(block, "text", None))
        if result.is_error:
            raise ToolFailure(text or f"tool {self.name!r} failed")
        return _result(text)


__all__ = ["MCPConnection", "MCPTool", "TRANSPORTS", "close_all", "connection", "list_tool_schemas"]
