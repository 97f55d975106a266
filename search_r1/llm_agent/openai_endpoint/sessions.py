"""A session's completions as the engine produced them, and the training samples they make.

Every completion records the prompt ids the engine was given and the ids (and log-probs) it sampled;
nothing is ever re-tokenized from text. A request whose messages extend the previous request's messages
plus the assistant message it got back (or whose rendered prompt extends the previous prompt + completion
ids) continues the chain: its prompt is the previous prompt + completion + the continuation's ids
(`chat.MessageFraming`), so the merged trajectory is one sample whose completions are trained (mask 1)
and whose inserted text is masked (0). A request that does neither (the agent rewrote history, forked,
or changed the tools) starts a new sample: a *prefix break* (`agent/prefix_breaks`). A row's samples
share its reward.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from search_r1.llm_agent.openai_endpoint.chat import message_key


@dataclass
class Exchange:
    """One completion: what the engine was given and what it sampled."""

    messages: list[tuple]               # message_key of each request message
    tools_key: str
    prompt_ids: list[int]
    completion_ids: list[int]
    log_probs: list[float]
    reply: tuple                         # message_key of the assistant message returned
    emitted_eos: bool
    finish_reason: str
    continues: bool                      # True: prompt_ids = previous prompt + completion + inserted ids
    tool_calls: int = 0


@dataclass
class Sample:
    """One training sample: a prompt, then completions (trained) with the text inserted between them
    (masked). `turns`: (completion ids, inserted ids after it, completion log-probs)."""

    prompt_ids: list[int]
    turns: list[tuple[list[int], list[int], list[float]]] = field(default_factory=list)
    finish_reason: str = ""
    tool_calls: int = 0

    @property
    def response_ids(self) -> list[int]:
        return [t for completion, inserted, _ in self.turns for t in completion + inserted]

    @property
    def response_mask(self) -> list[int]:
        return [m for completion, inserted, _ in self.turns for m in [1] * len(completion) + [0] * len(inserted)]

    @property
    def response_log_probs(self) -> list[float]:
        return [lp for completion, inserted, lps in self.turns for lp in list(lps) + [0.0] * len(inserted)]


def tools_key(request_tools: list[dict] | None) -> str:
    return json.dumps(request_tools or [], sort_keys=True)


@dataclass
class Session:
    """The completions of one row's agent, in order; one request in flight at a time."""

    session_id: str
    row: int = -1
    exchanges: list[Exchange] = field(default_factory=list)
    busy: bool = False                   # a request of this session is being answered
    closed: bool = False
    last_completion: Any = None          # the engine's last Completion (its next request follows it)

    def continuation_of(self, messages: list[dict], request_tools_key: str) -> list[dict] | None:
        """The messages added after the last exchange's reply, when `messages` extend that exchange's
        messages plus its reply with the same tools; None otherwise (a new sample starts)."""
        if not self.exchanges:
            return None
        last = self.exchanges[-1]
        n = len(last.messages)
        if request_tools_key != last.tools_key or len(messages) <= n + 1:
            return None
        keys = [message_key(m) for m in messages[: n + 1]]
        if keys[:n] != last.messages or keys[n] != last.reply:
            return None
        return messages[n + 1:]

    def full_ids(self) -> list[int] | None:
        """The last exchange's prompt + completion ids (what a continuing prompt must start with)."""
        if not self.exchanges:
            return None
        last = self.exchanges[-1]
        return last.prompt_ids + last.completion_ids

    def sample_prompt_length(self) -> int:
        """Prompt tokens of the sample the last exchange belongs to (0 without exchanges)."""
        for exchange in reversed(self.exchanges):
            if not exchange.continues:
                return len(exchange.prompt_ids)
        return 0

    def samples(self) -> list[Sample]:
        """The training samples: one per chain of continuing exchanges."""
        out: list[Sample] = []
        for exchange in self.exchanges:
            if not exchange.continues or not out:
                out.append(Sample(prompt_ids=list(exchange.prompt_ids)))
            else:
                sample = out[-1]
                previous = sample.prompt_ids + sample.response_ids
                completion, _, lps = sample.turns[-1]
                if exchange.prompt_ids[: len(previous)] != previous:   # the invariant the chain is built on
                    raise AssertionError(f"session {self.session_id}: a continuing prompt does not extend the chain")
                sample.turns[-1] = (completion, list(exchange.prompt_ids[len(previous):]), lps)
            sample = out[-1]
            sample.turns.append((list(exchange.completion_ids), [], list(exchange.log_probs)))
            sample.finish_reason = exchange.finish_reason
            sample.tool_calls += exchange.tool_calls
        return out

    @property
    def prefix_breaks(self) -> int:
        return sum(not e.continues for e in self.exchanges[1:])


__all__ = ["Exchange", "Sample", "Session", "tools_key"]
