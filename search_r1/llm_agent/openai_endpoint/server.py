"""The OpenAI-compatible endpoint in front of the rollout engine (docs/agent.md "Train an agent you
already wrote").

    endpoint = Endpoint(tokenizer, engine_client, EndpointLimits(...), eos_token_ids)
    with serve_endpoint(endpoint) as base:              # http://127.0.0.1:<port>
        sid = endpoint.open_session(row=0)
        # an agent: AsyncOpenAI(base_url=f"{base}/sessions/{sid}/v1", api_key="-")
        session = endpoint.close_session(sid)           # its completions -> session.samples()

Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`, each also under
`/sessions/<id>/v1/...` (or with the header `X-Session-Id`): a session's requests are recorded and make
its row's training samples (`sessions.py`); a request without a session is answered and not recorded.
Sampling is the engine's (the trainer's rollout settings: what the actor's log-probs are computed
under); a request's `temperature` / `top_p` are checked, not applied, and counted (`sampling_ignored`).
"""

import contextlib
import json
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from search_r1.llm_agent.openai_endpoint import chat
from search_r1.llm_agent.openai_endpoint.api import APIError, Sampling, bad, parse_chat, parse_completion
from search_r1.llm_agent.openai_endpoint.engines import EngineClient
from search_r1.llm_agent.openai_endpoint.sessions import Exchange, Session, tools_key
from search_r1.llm_agent.token_text import TokenText

logger = logging.getLogger(__name__)
SESSION_HEADER = "x-session-id"


def request_seed(call_seed: int, row: int, turn: int) -> int:
    """A request's sampling seed from the rollout's seed, its row and its place in the row (not from timing),
    spread as async_generation.request_seed spreads a trajectory's (that module imports the manager, which
    imports this package: no import of it here)."""
    return (int(call_seed) * 1_000_003 + row * 7_919 + turn) % (2**63 - 1)
MAX_BODY_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class EndpointLimits:
    """Bounds of what the endpoint takes: a sample's prompt and response tokens (data.max_prompt_length,
    data.max_response_length: all completions and inserted text of one sample together) and the
    requests in flight at once (over it: 429)."""

    max_prompt_length: int
    max_response_length: int
    max_concurrent_requests: int = 64
    model_name: str = "policy"
    call_seed: int = 0


class Endpoint:
    """Sessions, the engine client and the request handling; every method runs on the server's loop
    except open_session / close_session / stats (called from the agents' thread)."""

    def __init__(self, tokenizer: Any, engine: EngineClient, limits: EndpointLimits,
                 eos_token_ids: frozenset[int]) -> None:
        self.text = TokenText(tokenizer)
        self.engine = engine
        self.limits = limits
        self.eos_token_ids = frozenset(eos_token_ids)
        self.sessions: dict[str, Session] = {}
        self.counters: Counter[str] = Counter()
        self._in_flight = 0
        self._framings: dict[str, chat.MessageFraming] = {}
        self._lock = threading.Lock()
        self._framing(None)   # a template that cannot continue a conversation is refused at start-up

    # --- sessions (any thread) --------------------------------------------------------

    def open_session(self, row: int = -1, session_id: str | None = None) -> str:
        session_id = session_id or uuid.uuid4().hex
        with self._lock:
            self.sessions[session_id] = Session(session_id=session_id, row=row)
        return session_id

    def close_session(self, session_id: str) -> Session:
        """The session's record; later requests in it are refused (404)."""
        with self._lock:
            session = self.sessions.pop(session_id)
        session.closed = True
        return session

    def _session(self, session_id: str | None) -> Session | None:
        if session_id is None:
            return None
        with self._lock:
            session = self.sessions.get(session_id)
        if session is None:
            raise APIError(404, f"no open session {session_id[:80]!r} (it ended, or was never opened)",
                           code="session_not_found")
        return session

    def _framing(self, request_tools: list[dict] | None) -> chat.MessageFraming:
        key = tools_key(request_tools)
        if key not in self._framings:
            self._framings[key] = chat.MessageFraming(self.text.tokenizer, request_tools)
        return self._framings[key]

    # --- requests (the server's loop) -----------------------------------------------------

    async def handle(self, kind: str, session_id: str | None, body: Any) -> dict:
        """One request: 'chat' or 'completion'. Raises APIError; the app answers it."""
        if self._in_flight >= self.limits.max_concurrent_requests:
            self.counters["rate_limited"] += 1
            raise APIError(429, f"more than {self.limits.max_concurrent_requests} requests in flight; retry later",
                           type="rate_limit_error", code="rate_limit_exceeded")
        session = self._session(session_id)
        if session is not None and session.busy:
            raise bad(f"session {session.session_id!r} already has a request in flight: one request at a time per "
                      "session (parallel calls need one session each)", code="session_busy")
        self._in_flight += 1
        if session is not None:
            session.busy = True   # one loop, and no await between the check and this
        try:
            if kind == "chat":
                return await self._chat(session, parse_chat(body))
            return await self._completion(session, parse_completion(body))
        finally:
            self._in_flight -= 1
            if session is not None:
                session.busy = False

    def _budget(self, session: Session | None, prompt_ids: list[int], continues: bool,
                sampling: Sampling) -> int:
        """Tokens this request may sample (the sample's response budget left, the request's max_tokens,
        the engine's length); a request with no room is a 400 `context_length_exceeded`."""
        limits = self.limits
        if continues and session is not None:
            used = len(prompt_ids) - session.sample_prompt_length()
            left = limits.max_response_length - used
            if left < 1:
                self.counters["context_exceeded"] += 1
                raise bad(f"this conversation's completions and inserted messages reach {used} tokens; the response "
                          f"budget is {limits.max_response_length} (data.max_response_length)",
                          "messages", "context_length_exceeded")
        else:
            if len(prompt_ids) > limits.max_prompt_length:
                self.counters["context_exceeded"] += 1
                raise bad(f"the prompt is {len(prompt_ids)} tokens; at most {limits.max_prompt_length} "
                          "(data.max_prompt_length)", "messages", "context_length_exceeded")
            left = limits.max_response_length
        return max(1, min(left, sampling.max_tokens or left, self.engine.response_length))

    def _prompt(self, session: Session | None, messages: list[dict], request_tools: list[dict] | None
                ) -> tuple[list[int], bool]:
        """(prompt ids, continues the session's chain)."""
        key = tools_key(request_tools)
        added = session.continuation_of(messages, key) if session is not None else None
        if added is not None:
            last = session.exchanges[-1]
            pieces = self._framing(request_tools).continuation_pieces(added, last.emitted_eos)
            return session.full_ids() + self.text.encode_framed(pieces), True
        ids = chat.render_prompt(self.text, messages, request_tools)
        full = session.full_ids() if session is not None else None
        return ids, bool(full) and ids[: len(full)] == full and session.exchanges[-1].tools_key == key

    async def _generate(self, session: Session | None, prompt_ids: list[int], max_tokens: int,
                        sampling: Sampling) -> Any:
        self.counters["requests"] += 1
        self.counters["sampling_ignored"] += int(sampling.temperature is not None or sampling.top_p is not None)
        turn = len(session.exchanges) if session is not None else int(self.counters["requests"])
        row = session.row if session is not None else -1
        follows = session.last_completion if session is not None else None
        try:
            completion = await self.engine.generate(prompt_ids, max_tokens,
                                                    request_seed(self.limits.call_seed, max(row, 0) + 1, turn), follows)
        except Exception as err:  # noqa: BLE001 - the engine's failure is this request's 500, not the trainer's
            logger.exception("the engine failed a request")
            self.counters["engine_errors"] += 1
            raise APIError(500, f"the engine failed: {type(err).__name__}", type="server_error") from err
        if session is not None:
            session.last_completion = completion
        return completion

    async def _chat(self, session: Session | None, request: Any) -> dict:
        try:
            prompt_ids, continues = self._prompt(session, request.messages, request.tools)
        except chat.BadMessages as err:
            raise bad(str(err), "messages") from err
        max_tokens = self._budget(session, prompt_ids, continues, request.sampling)
        completion = await self._generate(session, prompt_ids, max_tokens, request.sampling)
        names = chat.tool_names(request.tools)
        read = chat.read_completion(self.text, list(completion.token_ids), list(completion.log_probs),
                                    self.eos_token_ids, max_tokens, request.sampling.stop, names,
                                    parse_calls=request.tool_choice != "none")
        if session is not None:
            reply = chat.normalize_messages([read.message])[0]
            session.exchanges.append(Exchange(
                messages=[chat.message_key(m) for m in request.messages], tools_key=tools_key(request.tools),
                prompt_ids=prompt_ids, completion_ids=read.kept_ids, log_probs=read.log_probs,
                reply=chat.message_key(reply), emitted_eos=read.emitted_eos, finish_reason=read.finish_reason,
                continues=continues and bool(session.exchanges), tool_calls=len(read.message.get("tool_calls", []))))
        choice = {"index": 0, "message": read.message, "finish_reason": read.finish_reason,
                  "logprobs": {"content": self._logprobs(read.kept_ids, read.log_probs)}
                  if request.sampling.logprobs else None}
        return self._envelope("chat.completion", choice, len(prompt_ids), len(read.kept_ids))

    async def _completion(self, session: Session | None, request: Any) -> dict:
        prompt_ids = list(request.prompt) if isinstance(request.prompt, list) else self.text.encode(request.prompt)
        full = session.full_ids() if session is not None else None
        continues = bool(full) and prompt_ids[: len(full)] == full and session.exchanges[-1].tools_key == "completion"
        max_tokens = self._budget(session, prompt_ids, continues, request.sampling)
        completion = await self._generate(session, prompt_ids, max_tokens, request.sampling)
        read = chat.read_completion(self.text, list(completion.token_ids), list(completion.log_probs),
                                    self.eos_token_ids, max_tokens, request.sampling.stop, (), parse_calls=False)
        if session is not None:
            session.exchanges.append(Exchange(
                messages=[], tools_key="completion", prompt_ids=prompt_ids, completion_ids=read.kept_ids,
                log_probs=read.log_probs, reply=(), emitted_eos=read.emitted_eos, finish_reason=read.finish_reason,
                continues=continues))
        text = read.message["content"] or ""
        if request.echo:
            text = self.text.decode(prompt_ids) + text
        logprobs = None
        if request.sampling.logprobs:
            tokens = [self.text.decode([t]) for t in read.kept_ids]
            logprobs = {"tokens": tokens, "token_logprobs": read.log_probs, "top_logprobs": None,
                        "text_offset": [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]}
        choice = {"index": 0, "text": text, "finish_reason": "length" if read.finish_reason == "length" else "stop",
                  "logprobs": logprobs}
        return self._envelope("text_completion", choice, len(prompt_ids), len(read.kept_ids))

    def _logprobs(self, ids: list[int], log_probs: list[float]) -> list[dict]:
        out = []
        for token_id, lp in zip(ids, log_probs, strict=True):
            token = self.text.decode([token_id])
            out.append({"token": token, "logprob": float(lp), "bytes": list(token.encode("utf-8")),
                        "top_logprobs": []})
        return out

    def _envelope(self, kind: str, choice: dict, prompt_tokens: int, completion_tokens: int) -> dict:
        prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
                "model": self.limits.model_name, "choices": [choice],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.limits.model_name, "object": "model", "created": 0,
                                            "owned_by": "search-r1"}]}


def build_app(endpoint: Endpoint) -> Any:
    """The FastAPI app serving `endpoint` (errors OpenAI-shaped; nothing a client sends raises out).
    (No `from __future__ import annotations` in this module: FastAPI reads the handlers' annotations, and
    `Request` is imported here, so the module imports without the web stack.)"""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    app = FastAPI(title="search-r1 OpenAI-compatible rollout endpoint", docs_url=None, redoc_url=None)

    def error(err: APIError) -> JSONResponse:
        endpoint.counters[f"http_{err.status}"] += 1
        return JSONResponse(err.body(), status_code=err.status)

    async def answer(kind: str, request: Request, session_id: str | None) -> JSONResponse:
        try:
            raw = await request.body()
            if len(raw) > MAX_BODY_BYTES:
                raise bad(f"the request body is over {MAX_BODY_BYTES} bytes")
            try:
                body = json.loads(raw)
            except ValueError as err:
                raise bad(f"the request body is not JSON ({str(err)[:100]})") from err
            return JSONResponse(await endpoint.handle(kind, session_id or request.headers.get(SESSION_HEADER), body))
        except APIError as err:
            return error(err)
        except Exception as err:  # noqa: BLE001 - a bug here is one request's 500, never the trainer's crash
            logger.exception("the endpoint failed a request")
            return error(APIError(500, f"internal error: {type(err).__name__}", type="server_error"))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> JSONResponse:
        return await answer("chat", request, None)

    @app.post("/sessions/{session_id}/v1/chat/completions")
    async def session_chat_completions(session_id: str, request: Request) -> JSONResponse:
        return await answer("chat", request, session_id)

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        return await answer("completion", request, None)

    @app.post("/sessions/{session_id}/v1/completions")
    async def session_completions(session_id: str, request: Request) -> JSONResponse:
        return await answer("completion", request, session_id)

    @app.get("/v1/models")
    @app.get("/sessions/{session_id}/v1/models")
    async def models() -> dict:
        return endpoint.models()

    return app


# serve_endpoint's shutdown: requests still decoding get SHUTDOWN_GRACE_S, the thread STOP_WAIT_S in all.
SHUTDOWN_GRACE_S = 30
STOP_WAIT_S = 60.0


@contextlib.contextmanager
def serve_endpoint(endpoint: Endpoint, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve `endpoint` with uvicorn on its own thread and event loop (the engine's requests run there, so
    an agent that blocks its own loop cannot stall the endpoint); yields the base URL. On exit, requests
    still decoding are given 30 s to finish, then the loop ends (in-flight engine requests are aborted).
    A thread still alive after 60 s is an error when the endpoint steps this process's engine (async mode):
    its loop may still step it while the caller puts it to sleep or loads weights; over the workers' engines
    (sync mode's batched waves, which the thread's executor waits for) it is a warning."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(build_app(endpoint), host=host, port=port, log_level="warning",
                                           timeout_graceful_shutdown=SHUTDOWN_GRACE_S, lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True, name="openai-endpoint")
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the OpenAI endpoint did not start on {host}:{port}")
        time.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        thread.join(timeout=STOP_WAIT_S)
        if thread.is_alive():
            stuck = (f"the OpenAI endpoint on {host}:{bound} did not stop within {STOP_WAIT_S:g} s of its shutdown "
                     "(a request still running, or a handler blocking its event loop)")
            if getattr(getattr(endpoint, "client", None), "steps_local_engine", True):
                # (raised in a finally: an exception of the body is chained as this one's context)
                raise RuntimeError(f"{stuck}; its engine may still be stepping")
            logger.warning("%s; the workers' engines finish that wave, and calls after it queue behind it", stuck)


__all__ = ["Endpoint", "EndpointLimits", "build_app", "serve_endpoint"]
