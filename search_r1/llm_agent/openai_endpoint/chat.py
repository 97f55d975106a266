"""OpenAI chat messages <-> the tool protocol's text: the prompt, the text an agent inserts between two
completions, and the assistant message a completion becomes. Pure functions on text and token ids; the
rendering and the tool-call parser are the tool protocol's own (`rl_dataset.prompt_to_text`,
`tools.ChatFraming`, `tools.parse_tool_calls`), not a second copy.

- **Prompt** of a session's first request (or one that rewrote history): the chat template over the
  messages with the request's `tools`, exactly as the tool protocol's dataset renders a row's prompt.
- **Continuation** of a request whose messages extend the previous request's messages plus the assistant
  message it got back: the chat template's text after that assistant turn (its end-of-turn, unless the
  model wrote EOS, then the new messages and the next assistant opening), found as `ChatFraming` finds a
  tool message's framing. It is appended to the previous prompt + completion ids, so a merged trajectory
  holds the ids the engine sampled, never a re-rendering of them. Message contents are tokenized as plain
  text (a special token's text inside a tool result is not a control token), the framing keeps its own.
- **Assistant message** of a completion: the text outside complete `<tool_call>…</tool_call>` blocks is
  `content`; each well-formed call (parsed by `tools.parse_tool_calls`) is an OpenAI `tool_calls` entry
  with its arguments as a JSON string; a malformed call stays in the content, as the model wrote it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from search_r1.llm_agent import tools
from search_r1.llm_agent.token_text import TokenText
from verl.utils.dataset.rl_dataset import prompt_to_text

ROLES = ("system", "developer", "user", "assistant", "tool")
_SENTINEL = "\x00OPENAI_ENDPOINT_SENTINEL\x00"


class BadMessages(ValueError):
    """A request's messages that cannot be rendered; the text is the 400 answer's message."""


def _text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, None (empty) or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadMessages(f"{where}.content[{i}]: only text parts are supported ({{'type': 'text', "
                                  f"'text': ...}}), got {str(part)[:80]!r}")
            parts.append(part["text"])
        return "".join(parts)
    raise BadMessages(f"{where}.content: expected a string, null or a list of text parts, got {type(content).__name__}")


def _arguments(raw: Any) -> Any:
    """A tool call's arguments as the chat template expects them (an object), from the JSON string."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def normalize_messages(messages: Any) -> list[dict]:
    """The request's messages as the chat template reads them (roles checked, contents as text, each
    tool call's arguments an object, `developer` as `system`). Raises BadMessages naming the message."""
    if not isinstance(messages, list) or not messages:
        raise BadMessages("messages: expected a non-empty list of messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise BadMessages(f"{where}: expected an object with 'role' and 'content'")
        role = message.get("role")
        if role not in ROLES:
            raise BadMessages(f"{where}.role: {role!r} is not one of {list(ROLES)}")
        entry: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                 "content": _text_of(message.get("content"), where)}
        calls = message.get("tool_calls")
        if role == "assistant" and calls:
            if not isinstance(calls, list):
                raise BadMessages(f"{where}.tool_calls: expected a list")
            entry["tool_calls"] = []
            for j, call in enumerate(calls):
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    raise BadMessages(f"{where}.tool_calls[{j}]: expected {{'type': 'function', 'function': "
                                      "{'name': ..., 'arguments': ...}}")
                entry["tool_calls"].append({"type": "function", "id": call.get("id"),
                                            "function": {"name": function["name"],
                                                         "arguments": _arguments(function.get("arguments", {}))}})
        if role == "tool":
            entry["tool_call_id"] = message.get("tool_call_id")
            if message.get("name") is not None:
                entry["name"] = message["name"]
        out.append(entry)
    return out


def message_key(message: dict) -> tuple:
    """What decides that an agent sent back the assistant message it was given: role, content and the
    calls' names and arguments (not their ids, which some frameworks rewrite)."""
    calls = tuple((c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                  for c in message.get("tool_calls") or [])
    return message["role"], message.get("content") or "", calls


def tool_names(request_tools: Sequence[dict] | None) -> list[str]:
    return [t["function"]["name"] for t in request_tools or []]


def check_tools(request_tools: Any) -> list[dict] | None:
    """The request's `tools` (OpenAI function schemas), checked; None when absent or empty."""
    if request_tools is None:
        return None
    if not isinstance(request_tools, list):
        raise BadMessages("tools: expected a list of {'type': 'function', 'function': {...}}")
    for i, tool in enumerate(request_tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise BadMessages(f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': ..., ...}}}}")
        if tool.get("type", "function") != "function":
            raise BadMessages(f"tools[{i}].type: only 'function' tools are supported, got {tool.get('type')!r}")
    return list(request_tools) or None


class MessageFraming(tools.ChatFraming):
    """`tools.ChatFraming` for any messages after an assistant turn (user and system messages too, not
    only tool messages), split into framing and contents so contents are tokenized as plain text."""

    def continuation_pieces(self, messages: Sequence[dict], ended_with_eos: bool) -> list[tuple[str, bool]]:
        """(text, is_content) pieces of: the assistant's end-of-turn (without the EOS the model wrote), the
        messages, the next assistant opening. Contents the template does not render verbatim once each
        fall back to one piece of framing text (tokenized as the template's text)."""
        end = self.assistant_end
        if ended_with_eos and self._eos_text and end.startswith(self._eos_text):
            end = end[len(self._eos_text):]
        # ChatFraming's own probe conversation: its rendering without the new messages is self._base
        probe = [{"role": "user", "content": "u"}, {"role": "assistant", "content": tools._SENTINEL}]
        marked = [{**m, "content": f"{_SENTINEL}{i}{_SENTINEL}"} if m.get("content") else m
                  for i, m in enumerate(messages)]
        full = self._render(probe + marked, True)
        if not full.startswith(self._base):
            raise BadMessages("the chat template renders the assistant turn differently once these messages "
                              "follow it; the conversation cannot be continued token-exactly")
        parts = (end + full[len(self._base):]).split(_SENTINEL)
        contents = [m.get("content") or "" for m in messages]
        seen = [int(p) for j, p in enumerate(parts) if j % 2 == 1 and p.isdigit()]
        if len(parts) % 2 == 0 or sorted(seen) != [i for i, c in enumerate(contents) if c]:
            plain = self._render(probe + list(messages), True)
            return [(end + plain[len(self._base):], False)]
        return [(contents[int(p)], True) if j % 2 == 1 else (p, False) for j, p in enumerate(parts) if j % 2 or p]


@dataclass(frozen=True)
class Rendered:
    """A completion read back: the ids kept (cut at a stop string), why it ended, the assistant message."""

    kept_ids: list[int]
    log_probs: list[float]
    emitted_eos: bool
    finish_reason: str          # stop | length | tool_calls
    message: dict               # OpenAI's assistant message: role, content, tool_calls (when any)


def _call_blocks(text: str) -> list[tuple[int, int]]:
    """[start, end) of each complete `<tool_call>…</tool_call>` (the shortest, left to right)."""
    blocks, pos = [], 0
    while (start := text.find(tools.TOOL_CALL_OPEN, pos)) >= 0:
        end = text.find(tools.TOOL_CALL_CLOSE, start + len(tools.TOOL_CALL_OPEN))
        if end < 0:
            break
        pos = end + len(tools.TOOL_CALL_CLOSE)
        blocks.append((start, pos))
    return blocks


def assistant_message(text: str, names: Sequence[str], parse_calls: bool) -> tuple[dict, bool]:
    """(OpenAI assistant message, whether it calls tools) for a completion's text."""
    calls, content, last = [], "", 0
    for start, end in _call_blocks(text) if parse_calls and names else []:
        parsed = tools.parse_tool_calls(text[start:end], names)
        if len(parsed) == 1 and isinstance(parsed[0], tools.ToolCall):
            content += text[last:start]
            last = end
            calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": parsed[0].name,
                                       "arguments": json.dumps(parsed[0].arguments, ensure_ascii=False)}})
    content = (content + text[last:]).strip() if calls else text
    message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return message, bool(calls)


def read_completion(text: TokenText, sampled: list[int], log_probs: list[float], eos_ids: frozenset[int],
                    max_tokens: int, stop: Sequence[str], names: Sequence[str], parse_calls: bool) -> Rendered:
    """The completion `sampled` as the endpoint answers it. A request's stop strings cut the ids at the
    token completing the first one (the engine decoded on, those ids are dropped: never trained on); the
    text shown stops before the stop string, as OpenAI's does."""
    kept, hit = list(sampled), False
    stops = [s for s in stop if s]
    if stops and any(s in text.decode(kept) for s in stops):
        kept = text.shortest_prefix(kept, lambda prefix: any(s in prefix for s in stops))
        hit = True
    emitted_eos = bool(kept) and kept[-1] in eos_ids
    shown = text.decode(kept[:-1] if emitted_eos else kept)
    if hit:
        cut = min(i for i in (shown.find(s) for s in stops) if i >= 0)
        shown = shown[:cut]
    message, calls = assistant_message(shown, names, parse_calls)
    if emitted_eos or hit:
        reason = "tool_calls" if calls else "stop"
    else:
        reason = "length" if len(kept) >= max_tokens else ("tool_calls" if calls else "stop")
    return Rendered(kept_ids=kept, log_probs=list(log_probs[: len(kept)]), emitted_eos=emitted_eos,
                    finish_reason=reason, message=message)


def render_prompt(text: TokenText, messages: list[dict], request_tools: list[dict] | None) -> list[int]:
    """A whole conversation's prompt ids (the tool protocol's rendering, the assistant turn opened)."""
    return text.encode(prompt_to_text(messages, text.tokenizer, request_tools))


__all__ = ["BadMessages", "MessageFraming", "Rendered", "assistant_message", "check_tools", "message_key",
           "normalize_messages", "read_completion", "render_prompt", "tool_names"]
