"""The OpenAI request fields the endpoint reads, checked, and OpenAI-shaped errors.

Every refusal is an `APIError` that the server answers as OpenAI does
(`{"error": {"message", "type", "param", "code"}}`, 400 for a bad request, 404 for an unknown session,
429 over the concurrency bound, 500 when the engine failed); nothing a client sends raises past it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from search_r1.llm_agent.openai_endpoint.chat import BadMessages, check_tools, normalize_messages

TOOL_CHOICES = ("auto", "none", "required")


@dataclass
class APIError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass(frozen=True)
class Sampling:
    """The sampling fields of a request (checked). `temperature`/`top_p` are None when not given."""

    max_tokens: int | None
    stop: tuple[str, ...]
    temperature: float | None
    top_p: float | None
    logprobs: bool


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict]                 # normalize_messages
    tools: list[dict] | None
    tool_choice: str                     # auto | none | required (a named function reads as required)
    sampling: Sampling


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str | list[int]
    sampling: Sampling
    echo: bool


def _number(body: dict, key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or not low <= value <= high:
        raise bad(f"{key}: expected a number in [{low}, {high}], got {value!r}", key)
    return float(value)


def _positive_int(body: dict, key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise bad(f"{key}: expected an integer >= 1, got {value!r}", key)
    return value


def _common(body: Any, logprobs_key: str) -> Sampling:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    if body.get("stream"):
        raise bad("stream: streaming is not supported by this endpoint; send stream=false", "stream")
    n = body.get("n", 1)
    if n != 1:
        raise bad(f"n: only n=1 is supported (one completion per request), got {n!r}", "n")
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise bad(f"{key}: not supported (the trained policy samples without penalties)", key)
    if body.get("logit_bias"):
        raise bad("logit_bias: not supported (the trained policy samples without biases)", "logit_bias")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise bad("response_format: only {'type': 'text'} is supported", "response_format")
    max_tokens = _positive_int(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _positive_int(body, "max_tokens")
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise bad("stop: expected a string or a list of at most 4 strings", "stop")
    logprobs = body.get(logprobs_key)
    top = body.get("top_logprobs")
    if top not in (None, 0):
        raise bad("top_logprobs: only 0 is supported (the sampled token's own log-prob)", "top_logprobs")
    return Sampling(max_tokens=max_tokens, stop=stops, temperature=_number(body, "temperature", 0.0, 2.0),
                    top_p=_number(body, "top_p", 0.0, 1.0), logprobs=bool(logprobs))


def parse_chat(body: Any) -> ChatRequest:
    """POST /v1/chat/completions's body, checked; raises APIError (400) naming the field."""
    sampling = _common(body, "logprobs")
    try:
        messages = normalize_messages(body.get("messages"))
        request_tools = check_tools(body.get("tools"))
    except BadMessages as err:
        raise bad(str(err), "messages" if str(err).startswith("messages") else "tools") from err
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if not isinstance(name, str) or name not in [t["function"]["name"] for t in request_tools or []]:
            raise bad(f"tool_choice: names no tool of the request, got {choice!r}", "tool_choice")
        choice = "required"
    elif choice not in TOOL_CHOICES:
        raise bad(f"tool_choice: expected one of {list(TOOL_CHOICES)} or a function, got {choice!r}", "tool_choice")
    return ChatRequest(messages=messages, tools=request_tools, tool_choice=choice, sampling=sampling)


def parse_completion(body: Any) -> CompletionRequest:
    """POST /v1/completions's body, checked (one prompt: a string or a list of token ids)."""
    logprobs = body.get("logprobs") if isinstance(body, dict) else None
    if logprobs not in (None, 0, False, True):
        raise bad("logprobs: only 0 is supported (the sampled token's own log-prob)", "logprobs")
    sampling = _common(body, "logprobs")
    sampling = Sampling(sampling.max_tokens, sampling.stop, sampling.temperature, sampling.top_p,
                        logprobs is not None and logprobs is not False)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        pass
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                     for t in prompt):
        prompt = list(prompt)
    else:
        raise bad("prompt: expected one non-empty string or one list of token ids", "prompt")
    return CompletionRequest(prompt=prompt, sampling=sampling, echo=bool(body.get("echo")))


__all__ = ["APIError", "ChatRequest", "CompletionRequest", "Sampling", "bad", "parse_chat", "parse_completion"]
