"""HTTP plumbing shared by every search server: reading a request, refusing it, running an app.

All four apps (retrieval, rerank, retrieve-then-rerank, online search) read their JSON
body through ``read_json_body`` and answer ``RequestError`` through
``install_request_errors``, so a bad request gets the same status and the same
``{"detail": "<message naming the field>"}`` from each of them:

- a body over ``ServerLimits.max_body_bytes`` -> 413. The limit is checked on the bytes
  actually read: a chunked body carries no Content-Length, so a header check alone
  would let any size through;
- a body that is not JSON, JSON nested too deeply to parse, or an integer of more than
  4,300 digits (Python's limit on converting one) -> 400;
- JSON that does not fit the request model -> 422 naming the field.

``serve_in_background`` runs an app under uvicorn in a thread (tests, benches).
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp

from search_r1.search.schema import RequestError

# An oversized body is drained (not stored) so the client reads our 413 instead of a reset;
# past this much we stop reading and let the connection drop.
_MAX_DRAIN_BYTES = 64 * 1024 * 1024
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

RequestModel = TypeVar("RequestModel", bound=BaseModel)


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, or ``RequestError`` 413 if it declares or turns out to hold more than ``limit`` bytes."""
    declared = request.headers.get("content-length", "")
    too_big = declared.isdigit() and int(declared) > limit
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            too_big = True
            chunks.clear()
            if size > _MAX_DRAIN_BYTES:
                break
        elif not too_big:
            chunks.append(chunk)
    if too_big:
        raise RequestError(f"request body exceeds this server's limit of {limit} bytes", status_code=413)
    return b"".join(chunks)


def parse_body(body: bytes, model: type[RequestModel]) -> RequestModel:
    """``body`` as ``model``; not JSON is a 400, JSON of the wrong shape a 422 naming the field."""
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RequestError(f"request body is not valid JSON: {err}", status_code=400) from err
    except ValueError as err:
        # An integer of more than sys.get_int_max_str_digits() (4,300) digits: Python refuses to
        # convert it (a guard against quadratic-time parsing). The client's body, not our failure:
        # a 500 would make clients retry it.
        raise RequestError("request body holds an integer too long to parse (more than "
                           f"{sys.get_int_max_str_digits()} digits)", status_code=400) from err
    except RecursionError as err:
        # json's parser recurses once per nesting level: `[[[[...` a few thousand deep exhausts the
        # stack. That is the client's malformed body, not a search failure (500).
        raise RequestError(
            "request body is nested too deeply to parse (arrays/objects inside each other past "
            f"Python's limit of about {sys.getrecursionlimit()} levels); send "
            '{"queries": ["...", ...], "topk": k}', status_code=400) from err
    try:
        return model.model_validate(payload)
    except ValidationError as err:
        problems = "; ".join(
            f"field '{'.'.join(str(p) for p in e['loc']) or 'body'}': {e['msg']}" for e in err.errors()
        )
        raise RequestError(f"invalid request: {problems}") from err


async def read_json_body(request: Request, model: type[RequestModel], limit: int) -> RequestModel:
    """``read_body`` then ``parse_body``: the one way a search server reads its request."""
    return parse_body(await read_body(request, limit), model)


def install_request_errors(app: FastAPI, on_reject: Callable[[], None] | None = None) -> None:
    """Answer ``RequestError`` with its status and ``{"detail": message}``; ``on_reject`` counts them."""

    @app.exception_handler(RequestError)
    async def _refuse(_: Request, err: RequestError) -> JSONResponse:
        if on_reject is not None:
            on_reject()
        return JSONResponse(status_code=err.status_code, content={"detail": err.message})


def configure_logging() -> None:
    """Log format of the server entry points."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)


@contextlib.contextmanager
def serve_in_background(
    app: ASGIApp, host: str = "127.0.0.1", port: int | None = None, start_timeout_s: float = 30.0
) -> Iterator[str]:
    """Run ``app`` under uvicorn in a daemon thread for the block's duration; yield ``http://host:port``.

    With ``port=None`` the OS picks a free one. The socket is bound here and handed to
    uvicorn, so nothing else can take the port between choosing it and listening on it.
    IPv4 only.
    """
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port or 0))
    bound = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=bound, log_level="warning"))
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, daemon=True, name=f"uvicorn-{bound}"
    )
    thread.start()
    try:
        deadline = time.monotonic() + start_timeout_s
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on {host}:{bound} did not start within {start_timeout_s:.0f} s")
            time.sleep(0.02)
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()
