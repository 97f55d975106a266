"""One trajectory while it is rolled out, and one policy turn after its cut: the records the
generation manager's loops (sync, async) and both protocols' rules (tags, tool) share; the rollout's
statistics over finished rows (`rollout_statistics`, the batch's meta_info); and what each turn did
(`TurnTrace`, `RowTrace`: the batch's `agent_trace`, read by the dumps, verl/trainer/ppo/dumps.py)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from uuid import uuid4

from search_r1.llm_agent import actions
from search_r1.llm_agent.actions import Action


@dataclass(frozen=True)
class TurnTrace:
    """What one turn did, in the order of the row's turns: its token counts (policy, then observation:
    the response is these spans back to back), its action and what it asked and got back."""

    policy_tokens: int
    obs_tokens: int
    action: str                               # search | answer | open | invalid (tool protocol: search = calls)
    queries: tuple[str, ...] = ()             # sent to the retrieval server
    doc_ids: tuple[tuple[str, ...], ...] = ()  # per query, the ids it returned, best first (empty: failed)
    calls: tuple[str, ...] = ()               # tool protocol: each call's tool name ("" when unreadable)
    opened: str | None = None                 # open tag: the doc id the turn opened


@dataclass(frozen=True)
class RowTrace:
    """One finished trajectory's turns and why it stopped (`agent_trace`, one per row)."""

    stop_reason: str | None
    turns: tuple[TurnTrace, ...]


@dataclass
class _Row:
    """One trajectory while it is being rolled out."""

    prompt_ids: list[int]
    # Each turn: (policy ids, observation ids); observation may be empty.
    turns: list[tuple[list[int], list[int]]] = field(default_factory=list)
    # The engine's log-prob of each policy id, per turn (None once any turn came without them).
    log_probs: list[list[float]] | None = field(default_factory=list)
    response_len: int = 0
    stop_reason: str | None = None
    n_turns: int = 0
    n_valid_actions: int = 0
    n_searches: int = 0
    n_opens: int = 0            # tag protocol with the open tag: opens run (not-found and failed ones included)
    n_tool_rounds: int = 0      # tool protocol: rounds of tool answers appended (veRL's user turns)
    tool_counts: dict[str, int] = field(default_factory=dict)   # tool protocol: calls per tool (budgets)
    # Response position from which the policy sampled from a rolling context that had dropped
    # older turns (-1: never). Old log-probs and the update see the full sequence instead.
    cut_from: int = -1
    # Tools (veRL's BaseTool lifetime, tool_turns.py): the trajectory's id (each tool's instance id), the
    # row's extra_info.tools_kwargs, the instances created, the step rewards of execute in call order
    # (veRL's `tool_rewards`) and each tool's calc_reward at the end (veRL's `reward_scores`).
    request_id: str = field(default_factory=lambda: uuid4().hex)
    tools_kwargs: dict = field(default_factory=dict)
    tool_instances: dict[str, str] = field(default_factory=dict)
    tool_rewards: list[float] = field(default_factory=list)
    reward_scores: dict[str, float] = field(default_factory=dict)
    # An interaction (veRL's BaseInteraction; tool_turns.py): the row's extra_info.interaction_kwargs, and the
    # conversation it is shown (the row's chat messages, then each turn; None: no interaction).
    interaction_kwargs: dict = field(default_factory=dict)
    messages: list[dict] | None = None
    # Agent loops (agent_loops.py): the loop that rolled the row out, an interaction's score per user turn
    # (veRL's `turn_scores`), a loop's own reward_score / num_turns / extra_fields (AgentLoopOutput).
    agent_name: str = ""
    turn_scores: list[float] = field(default_factory=list)
    reward_score: float | None = None
    reported_turns: int | None = None
    extra_fields: dict = field(default_factory=dict)
    traces: list[TurnTrace] = field(default_factory=list)   # one per turn (record_turn)

    @property
    def active(self) -> bool:
        return self.stop_reason is None

    def append_turn(self, policy_ids: list[int], obs_ids: list[int], policy_log_probs: list[float] | None = None) -> None:
        self.turns.append((policy_ids, obs_ids))
        self.response_len += len(policy_ids) + len(obs_ids)
        if self.log_probs is not None and policy_log_probs is not None:
            self.log_probs.append(list(policy_log_probs[: len(policy_ids)]))
        else:
            self.log_probs = None

    def record_turn(self, res: _TurnResult) -> None:
        """Trace the turn just appended (`append_turn`) from its cut result."""
        policy_ids, obs_ids = self.turns[-1]
        calls = tuple(getattr(c, "name", None) or getattr(c, "tool", None) or "" for c in res.calls)
        self.traces.append(TurnTrace(
            policy_tokens=len(policy_ids), obs_tokens=len(obs_ids), action=res.action.kind,
            queries=tuple(res.queries), doc_ids=tuple(tuple(ids) for ids in res.doc_ids), calls=calls,
            opened=res.action.content if res.action.kind == "open" else None))

    def trace(self) -> RowTrace:
        return RowTrace(stop_reason=self.stop_reason, turns=tuple(self.traces))

    def response_log_probs(self) -> list[float] | None:
        """The engine's log-prob at each response position (0 on observations), if it gave them."""
        if self.log_probs is None:
            return None
        out: list[float] = []
        for (_, obs_ids), lps in zip(self.turns, self.log_probs, strict=True):
            out += lps + [0.0] * len(obs_ids)
        return out

    def response(self) -> tuple[list[int], list[int]]:
        """All turns' ids and the matching mask (1 = sampled by the policy, 0 = observation)."""
        ids: list[int] = []
        mask: list[int] = []
        for policy_ids, obs_ids in self.turns:
            ids += policy_ids + obs_ids
            mask += [1] * len(policy_ids) + [0] * len(obs_ids)
        return ids, mask


@dataclass(frozen=True)
class _TurnResult:
    """A policy turn after cutting at its first action."""

    kept_ids: list[int]
    action: Action
    emitted_eos: bool
    generated: int
    calls: tuple = ()                 # tool protocol: the turn's parsed calls (tools.ToolCall | ToolCallError)
    queries: tuple[str, ...] = ()     # the queries the turn sends to the retrieval server
    role: str = "tool"                # tool protocol: who answers the turn (user: an interaction's reply)
    # per query, the ids of the hits that answered it: filled when the observation is made (_observation_for)
    doc_ids: list[tuple[str, ...]] = field(default_factory=list, compare=False)


def rollout_statistics(rows: Sequence[_Row], stats: Counter[str], timing: dict[str, float],
                       open_tag: bool = False) -> dict[str, Any]:
    """The rollout's `meta_info` statistics: per-row counts (turns, valid actions, searches; opens
    with the open tag on), the loops' counters, stop reasons and timings (docs/agent.md "Metrics")."""
    reasons = Counter(row.stop_reason for row in rows)   # an unfinished row (None) is in no count
    meta_info = {
        "turns_stats": [row.n_turns for row in rows],
        # Rows that ran out of budget without answering, as in the original.
        "active_mask": [row.stop_reason not in (actions.ANSWERED, actions.EOS) for row in rows],
        "valid_action_stats": [row.n_valid_actions for row in rows],
        "valid_search_stats": [row.n_searches for row in rows],
        "search_failures": int(stats["search_failures"]),
        "obs_truncated": int(stats["obs_truncated"]),
        "context_cuts": int(stats["context_cuts"]),
        # Tool protocol: calls made, malformed ones (answered with an error message), answers cut to
        # max_tool_response_length characters.
        "tool_calls": int(stats["tool_calls"]),
        "tool_call_errors": int(stats["tool_call_errors"]),
        "tool_response_truncated": int(stats["tool_response_truncated"]),
        # Per tool: tools/<name>/{calls, errors, latency_ms} (errors: malformed or over-budget calls
        # and failed answers; calls of a name no tool has count under tools/_unknown); the tool's own
        # numeric metrics summed; tools/<name>/reward: its step rewards and calc_reward per row (mean).
        "tool_stats": {k: float(v) / (max(1, len(rows)) if k.endswith("/reward") else 1)
                       for k, v in sorted(stats.items()) if k.startswith("tools/")},
        # Rows whose turn raised unexpectedly (a bug or an unmapped backend error): that row got an error
        # observation and went on; by exception type, the messages are in the log.
        "row_errors": int(stats["row_errors"]),
        # Interactions (tool protocol): the simulated user's replies, one per turn it answered (tool_turns.py)
        "interaction_turns": int(stats["interaction_turns"]),
        "row_error_types": {k.removeprefix("row_errors/"): int(v) for k, v in sorted(stats.items())
                            if k.startswith("row_errors/")},
        # Agent loops (agent_loops.py): rows per loop (agent_loop/<name>/rows) and responses cut to the bound.
        "agent_loop_stats": {k: float(v) for k, v in sorted(stats.items())
                             if k.startswith("agent_loop/") or k == "agent_loop_truncated"},
        "generated_tokens": int(stats["generated_tokens"]),
        "kept_tokens": int(stats["kept_tokens"]),
        "stop_reasons": {name: int(reasons.get(name, 0)) for name in actions.STOP_REASONS}
        | ({actions.AGENT_LOOP: reasons[actions.AGENT_LOOP]} if reasons.get(actions.AGENT_LOOP) else {}),
        "timing_s": dict(timing),
    }
    if open_tag:   # opens run per row; unknown ids / pages, and opens the server did not answer
        meta_info.update(valid_open_stats=[row.n_opens for row in rows], open_not_found=int(stats["open_not_found"]),
                         open_failures=int(stats["open_failures"]))
    return meta_info
