"""The generation manager's turns in the tool protocol (veRL upstream's Search-R1 recipe).

`LLMGenerationManager` delegates here when `GenerationConfig.protocol == "tool"`; the loops
(sync and async), the rolling context, the log-probs and the composed batch are the
manager's, shared with the tag protocol. What differs, and lives here:

- **Cut.** A turn ends at the end of its first tool call (`</tool_call>` is the engine's stop
  string when `max_parallel_calls == 1`, veRL's default) or at EOS. If an engine wrote past
  the call, the ids are cut at the token that completes it (binary search over decoded
  prefixes, as for tags). Sampled ids are never re-encoded.
- **Act.** The turn's calls (at most `max_parallel_calls`) are parsed from its text; every
  search call's `query_list` goes into the turn's one retrieval request (sync: one request
  for all rows). Each call is answered by a `tool` message: veRL SearchTool's text for the
  hits, or an error message for a malformed call (counted in `tool_call_errors`), cut to
  `max_tool_response_length` characters as veRL cuts it. Every other tool is a
  `verl.tools.base_tool.BaseTool` (the built-ins and the user's own alike) with veRL's lifetime:
  `create` once per trajectory (its `extra_info.tools_kwargs[name].create_kwargs`), `execute` per
  call (a turn's calls concurrently; sync mode: every row's calls of the turn at once, on a loop
  thread), `calc_reward` and `release` when the trajectory ends. Step rewards and `calc_reward`
  are kept on the row (`tool_rewards`, `reward_scores`) and summed in `tools/<name>/reward`; an
  exception from a tool is that call's error message, counted, never the batch's.
- **Append.** The observation is the chat template's own text between the turns (tools.
  ChatFraming): end of the assistant turn (unless the model wrote EOS), the tool messages,
  the next assistant opening; tokenized once, masked; when it is over `max_obs_length`
  tokens the tool contents are shortened, the framing never is. Special tokens are the
  framing's only: `<|im_end|>` written inside a tool message is ordinary text tokens.
- **Stop.** No call: the row ends (`answered` if it wrote `<answer>…</answer>`, `eos`, or
  `context_full` when the budget ran out mid-turn). `max_assistant_turns` /
  `max_user_turns` reached: the row ends without running the call (`max_turns`), as in
  veRL. The budget `max_total_response_length` (veRL's `data.max_response_length`) bounds
  all turns and observations together; a tool message that would not fit ends the row
  (`context_full`), as in veRL.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from search_r1.llm_agent import actions, tool_backends, tools
from search_r1.llm_agent.actions import Action
from search_r1.llm_agent.generation_config import GenerationConfig
from search_r1.llm_agent.loop_thread import LoopThread
from search_r1.llm_agent.token_text import TokenText
from search_r1.llm_agent.tool_results import ToolFailure
from search_r1.llm_agent.trajectory import _Row, _TurnResult
from search_r1.search.schema import Hit

logger = logging.getLogger(__name__)
# Names a tool's own metrics may not take in tools/<name>/... (they are this module's counters).
RESERVED_TOOL_METRICS = ("calls", "errors", "latency_ms", "latency_ms_mean", "reward", "create_errors")


def _tool_kwargs(row: _Row, name: str, stage: str) -> dict:
    """veRL's per-row kwargs of one tool stage: extra_info.tools_kwargs[name][stage] (create_kwargs, ...)."""
    per_tool = row.tools_kwargs.get(name) if isinstance(row.tools_kwargs, dict) else None
    kwargs = per_tool.get(stage) if isinstance(per_tool, dict) else None
    return dict(kwargs) if isinstance(kwargs, dict) else {}


def _unpack(result: Any, name: str) -> tuple[str, float | None, dict]:
    """(text, step reward, metrics) of what `execute` returned (veRL: (ToolResponse, float, dict))."""
    if not isinstance(result, tuple) or len(result) != 3:
        raise TypeError(f"tool {name!r}: execute returned {type(result).__name__}; expected (ToolResponse, reward, "
                        "metrics)")
    response, reward, metrics = result
    if getattr(response, "image", None) or getattr(response, "video", None):
        raise TypeError(f"tool {name!r} answered an image or video; rollouts here are text-only")
    text = response if isinstance(response, str) else getattr(response, "text", None)
    return (text or ""), (None if reward is None else float(reward)), (metrics if isinstance(metrics, dict) else {})


class ToolTurns:
    """Cut, observation and stop rules of one manager in the tool protocol."""

    def __init__(self, text: TokenText, config: GenerationConfig) -> None:
        self.text = text
        self.config = config
        self.tool_config = tools.ToolConfig.from_dict(config.tool_config or {})
        self.tool_names = self.tool_config.tool_names
        self.framing = tools.ChatFraming(text.tokenizer, self.tool_config.schemas, config.chat_template_kwargs)
        self.search_name = self.tool_config.search_name
        self.show_doc_ids = bool((self.tool_config.search or {}).get("show_doc_ids", False))
        self._others = {entry["name"]: entry for entry in self.tool_config.others}
        self._schemas = {schema["function"]["name"]: schema for schema in self.tool_config.schemas}
        self._tools: dict[str, Any] = {}        # BaseTools, built on first use (MCP tools connect on their first call)
        self._loop_thread = LoopThread()        # the sync loop's tool coroutines run there
        framing_len = len(self._observation_ids([""], ended_with_eos=False)[0])
        if framing_len >= config.max_obs_length:
            raise ValueError(f"max_obs_length ({config.max_obs_length}) leaves no room for a tool answer: the chat "
                             f"template's text around one tool message is {framing_len} tokens")

    # --- cut --------------------------------------------------------------------------

    def cut_turn(self, sampled: list[int], eos_token_ids: frozenset[int]) -> _TurnResult:
        decode = self.text.decode
        text = decode(sampled)
        kept = sampled
        close = tools.TOOL_CALL_CLOSE
        outside = tools.outside_reasoning(text)   # a call drafted inside <think>…</think> is no call
        if self.config.max_parallel_calls == 1 and close in outside and outside[outside.index(close) + len(close):]:
            kept = self.text.shortest_prefix(sampled, lambda prefix: close in tools.outside_reasoning(prefix))
            text = decode(kept)
        calls = tuple(tools.parse_tool_calls(text, self.tool_names)[: self.config.max_parallel_calls])
        queries = self._queries(calls)
        if calls:
            action = Action(kind="search", content="")
        elif tools.has_answer(text):
            action = Action(kind="answer", content="")
        else:
            action = Action(kind="invalid", content="")
        emitted_eos = bool(kept) and kept[-1] in eos_token_ids
        return _TurnResult(kept_ids=kept, action=action, emitted_eos=emitted_eos, generated=len(sampled),
                           calls=calls, queries=tuple(queries))

    def unreadable_turn(self, sampled: list[int], emitted_eos: bool, err: Exception) -> _TurnResult:
        """The whole turn kept, as one call that could not be read (the manager's guard: `err` escaped
        cut_turn); the model reads an error message and the call counts in tool_call_errors."""
        error = tools.ToolCallError(f"Error: the tool call could not be read ({type(err).__name__}); write "
                                    f'{{"name": <tool name>, "arguments": {{...}}}} inside <tool_call></tool_call>.')
        return _TurnResult(kept_ids=sampled, action=Action(kind="search", content=""), emitted_eos=emitted_eos,
                           generated=len(sampled), calls=(error,))

    def _is_search(self, call: object) -> bool:
        return isinstance(call, tools.ToolCall) and call.name == self.search_name

    def _queries(self, calls: tuple) -> tuple[str, ...]:
        """The retrieval server's queries of the turn: those of its well-formed search calls."""
        return tuple(q for call in calls if self._is_search(call) for q in tools.search_queries(call) or [])

    def limit_calls(self, row: _Row, res: _TurnResult) -> _TurnResult:
        """Per-tool budgets (a tool's `max_calls_per_row`): a call past its tool's budget in this
        trajectory is not run; it becomes an error message saying so (counted as an error)."""
        budgets = self.tool_config.budgets
        if not budgets or not res.calls:
            return res
        calls = []
        for call in res.calls:
            if isinstance(call, tools.ToolCall) and call.name in budgets:
                used = row.tool_counts.get(call.name, 0)
                row.tool_counts[call.name] = used + 1
                if used >= budgets[call.name]:
                    call = tools.ToolCallError(
                        f"Error: tool {call.name!r} may be called at most {budgets[call.name]} times per "
                        f"trajectory; this call was not run. Answer with what you have or use another tool.",
                        tool=call.name)
            calls.append(call)
        return dataclasses.replace(res, calls=tuple(calls), queries=self._queries(tuple(calls)))

    # --- act --------------------------------------------------------------------------

    def n_searches(self, res: _TurnResult) -> int:
        """Well-formed search calls of the turn (each sends all of its queries)."""
        return sum(self._is_search(c) and tools.search_queries(c) is not None for c in res.calls)

    def _tool(self, name: str) -> Any:
        """The BaseTool answering `name` (built on first use, in the process that runs the rollout)."""
        if name not in self._tools:
            self._tools[name] = tool_backends.build_tool(self._others[name], self._schemas.get(name))
        return self._tools[name]

    async def start_row(self, row: _Row, stats: Counter[str]) -> None:
        """Create each tool's instance for the trajectory (veRL: once, when it starts; with the row's
        create_kwargs). A tool that cannot start answers its calls with an error (counted there)."""
        async def create(name: str) -> None:
            try:
                instance_id, _ = await self._tool(name).create(row.request_id, **_tool_kwargs(row, name, "create_kwargs"))
                row.tool_instances[name] = instance_id
            except Exception as err:   # noqa: BLE001 - the tool's failure, not the batch's
                stats[f"tools/{name}/create_errors"] += 1
                logger.warning("tool %r: create failed (%s: %s); its calls get an error", name, type(err).__name__, err)

        await asyncio.gather(*(create(name) for name in self._others))

    async def finish_row(self, row: _Row, stats: Counter[str]) -> None:
        """calc_reward, then release, of each instance the trajectory holds; the rewards go to
        `row.reward_scores` (veRL's reward_scores) and `tools/<name>/reward`."""
        async def finish(name: str, instance_id: str) -> None:
            tool = self._tool(name)
            try:
                reward = await tool.calc_reward(instance_id, **_tool_kwargs(row, name, "calc_reward_kwargs"))
                if reward is not None:
                    row.reward_scores[name] = float(reward)
                    stats[f"tools/{name}/reward"] += float(reward)
            except Exception as err:   # noqa: BLE001
                stats[f"tools/{name}/errors"] += 1
                logger.warning("tool %r: calc_reward failed (%s: %s)", name, type(err).__name__, err)
            try:
                await tool.release(instance_id, **_tool_kwargs(row, name, "release_kwargs"))
            except Exception as err:   # noqa: BLE001
                logger.warning("tool %r: release failed (%s: %s)", name, type(err).__name__, err)

        held, row.tool_instances = dict(row.tool_instances), {}
        await asyncio.gather(*(finish(name, instance_id) for name, instance_id in held.items()))

    async def _execute(self, row: _Row, call: tools.ToolCall, stats: Counter[str]) -> str:
        """One call's tool message; its step reward and metrics go to the row and `stats`."""
        name = call.name
        start = time.perf_counter()
        ok, reward, metrics = False, None, {}
        try:
            instance_id = row.tool_instances.get(name)
            if instance_id is None:          # the tool failed to start (start_row): its error, again
                self._tool(name)
                raise RuntimeError(f"tool {name!r} has no instance")
            result = await self._tool(name).execute(instance_id, call.arguments,
                                                    **_tool_kwargs(row, name, "execute_kwargs"))
            text, reward, metrics = _unpack(result, name)
            ok = True
        except ToolFailure as err:
            text = tools.tool_result(f"Error: {err}")
        except Exception as err:   # noqa: BLE001 - a tool that failed (to start, or in execute) answers an error
            text = tools.tool_result(f"Error: tool {name!r} failed ({type(err).__name__})")
            logger.warning("tool %r failed (%s: %s); the call is answered with an error", name, type(err).__name__, err)
        stats[f"tools/{name}/latency_ms"] += round((time.perf_counter() - start) * 1000, 3)
        stats[f"tools/{name}/errors"] += int(not ok)
        if reward is not None:
            row.tool_rewards.append(reward)
            stats[f"tools/{name}/reward"] += reward
        for key, value in metrics.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                stats[f"tools/{name}/{'metric_' if key in RESERVED_TOOL_METRICS else ''}{key}"] += float(value)
        return text

    async def run_calls(self, res: _TurnResult, stats: Counter[str], row: _Row | None = None) -> dict[int, str]:
        """The answers of the turn's calls of tools other than search, by call position, run concurrently.
        Without `row` (one turn on its own) the instances are created and released around the calls."""
        positions = [i for i, call in enumerate(res.calls)
                     if isinstance(call, tools.ToolCall) and call.name in self._others]
        if not positions:
            return {}
        own = row is None
        if own:
            row = _Row(prompt_ids=[])
            await self.start_row(row, stats)
        texts = await asyncio.gather(*(self._execute(row, res.calls[i], stats) for i in positions))
        if own:
            await self.finish_row(row, Counter())
        return dict(zip(positions, texts, strict=True))

    def run_others(self, res: _TurnResult, stats: Counter[str], row: _Row | None = None) -> dict[int, str]:
        """`run_calls` from blocking code (the loop thread runs the coroutines)."""
        return self._loop_thread.run(self.run_calls(res, stats, row))

    def run_turn(self, turns: Sequence[tuple[_Row, _TurnResult]], stats: Counter[str]
                 ) -> list[dict[int, str] | BaseException]:
        """The sync loop's turn: every row's calls at once; a row whose calls raised gets its exception."""
        async def all_rows() -> list[Any]:
            return await asyncio.gather(*(self.run_calls(res, stats, row) for row, res in turns),
                                        return_exceptions=True)

        return self._loop_thread.run(all_rows()) if turns else []

    def start_rows(self, rows: Sequence[_Row], stats: Counter[str]) -> None:
        if self._others:
            self._loop_thread.run(_gather(self.start_row(row, stats) for row in rows))

    def finish_rows(self, rows: Sequence[_Row], stats: Counter[str]) -> None:
        if any(row.tool_instances for row in rows):
            self._loop_thread.run(_gather(self.finish_row(row, stats) for row in rows))

    def is_final(self, row: _Row) -> bool:
        """True when the turn being taken is the row's last: its calls are not run (veRL's limits)."""
        c = self.config
        return bool((c.max_assistant_turns and row.n_turns + 1 >= c.max_assistant_turns)
                    or (c.max_user_turns and row.n_tool_rounds >= c.max_user_turns))

    def answers(self, res: _TurnResult, hits: list[list[Hit]] | None, error: str | None,
                stats: Counter[str], others: dict[int, str] | None = None) -> list[str]:
        """The tool message of each call of `res`: `hits` holds one list per query of `res.queries`
        in order (None when the retrieval failed with `error`); `others` the answers of the other
        tools' calls (run here when not given)."""
        if others is None:
            others = self.run_others(res, stats)
        texts = []
        position = 0
        for i, call in enumerate(res.calls):
            if isinstance(call, tools.ToolCallError):
                text = tools.render_call_error(call)
            elif i in others:
                text = others[i]
            else:
                queries = tools.search_queries(call)
                if queries is None:
                    text = tools.render_bad_query_list()
                elif hits is None:
                    text = tools.render_search_error(error or "the retrieval server did not answer")
                    stats[f"tools/{call.name}/errors"] += 1
                else:
                    text = tools.render_search_results(hits[position: position + len(queries)], self.show_doc_ids)
                    position += len(queries)
            text, cut = tools.truncate_tool_response(text, self.config.max_tool_response_length,
                                                     self.config.tool_response_truncate_side)
            stats["tool_response_truncated"] += int(cut)
            texts.append(text)
        return texts

    def failed_answers(self, res: _TurnResult, err: Exception, stats: Counter[str]) -> list[str]:
        """One error message per call of a turn whose answers raised `err` (the manager's guard), each
        counted as its tool's error."""
        for call in res.calls:
            if isinstance(call, tools.ToolCall):
                stats[f"tools/{call.name}/errors"] += 1
        return [tools.tool_result(f"Error: the tool call failed ({type(err).__name__}).")] * len(res.calls)

    # --- append and stop ------------------------------------------------------------------

    def _observation_ids(self, texts: list[str], ended_with_eos: bool, role: str = "tool") -> tuple[list[int], bool]:
        """The observation's ids, the whole text tokenized at once (as an SFT row's observation segment
        is); when over max_obs_length, the framing and the tool contents are tokenized apart and the
        contents shortened (evenly) so the framing stays whole. Returns (ids, truncated).

        Special tokens are the framing's only: a special token's text inside a tool message (a page, a
        server's answer, an error echoing the call) is tokenized as ordinary text (token_text.TokenText)."""
        text = self.text
        if any(text.has_special(t) for t in texts):   # a page holding <|im_end|> etc.: plain text, not control ids
            whole = text.encode_framed(self.framing.split_observation(texts, ended_with_eos, role))
        else:
            whole = text.encode(self.framing.observation(texts, ended_with_eos, role))
        if len(whole) <= self.config.max_obs_length:
            return whole, False
        pieces = [(text.encode_plain(piece) if is_content else text.encode(piece), is_content)
                  for piece, is_content in self.framing.split_observation(texts, ended_with_eos, role)]
        framing = sum(len(ids) for ids, is_content in pieces if not is_content)
        room = max(0, self.config.max_obs_length - framing) // max(1, len(texts))
        return [tok for ids, is_content in pieces for tok in (ids[:room] if is_content else ids)], True

    def apply_turn(self, row: _Row, res: _TurnResult, answers: list[str] | None, stats: Counter[str],
                   sampled_log_probs: list[float] | None) -> None:
        """Append the turn (and, when its calls ran, their tool messages; an interaction's reply to a turn
        without calls when `res.role` is user) to `row`; decide whether it ends."""
        role = res.role
        row.n_turns += 1
        errors = 0
        for call in res.calls:
            bad = isinstance(call, tools.ToolCallError) or (self._is_search(call) and tools.search_queries(call) is None)
            errors += int(bad)
            name = call.tool if isinstance(call, tools.ToolCallError) else call.name
            if name is not None:      # per tool (tools/<name>/...); a call naming no tool counts only overall
                stats[f"tools/{name}/calls"] += 1
                stats[f"tools/{name}/errors"] += int(bad)
        row.n_valid_actions += int(res.action.kind == "answer" or len(res.calls) > errors)
        stats["tool_calls"] += len(res.calls)
        stats["tool_call_errors"] += errors
        obs_ids: list[int] = []
        if answers is None and not res.calls:
            if res.action.kind == "answer":
                reason: str | None = actions.ANSWERED
            else:
                reason = actions.EOS if res.emitted_eos else actions.CONTEXT_FULL
        elif answers is None:
            reason = actions.MAX_TURNS
        else:
            obs_ids, truncated = self._observation_ids(answers, res.emitted_eos, role)
            stats["obs_truncated"] += int(truncated)
            reason = None
            if row.response_len + len(res.kept_ids) + len(obs_ids) >= self.config.max_total_response_length:
                obs_ids, reason = [], actions.CONTEXT_FULL
            else:
                row.n_tool_rounds += 1
                row.n_searches += self.n_searches(res)
        if row.messages is not None:   # an interaction's row: the conversation it is shown
            row.messages.append({"role": "assistant", "content": self.text.tokenizer.decode(
                res.kept_ids, skip_special_tokens=True)})
            row.messages += [{"role": role, "content": a} for a in (answers or []) if obs_ids]
        row.append_turn(res.kept_ids, obs_ids, sampled_log_probs)
        row.stop_reason = reason

    # --- interactions (veRL's BaseInteraction: a simulated user answers turns without tool calls) ---------

    def interaction_of(self, row: _Row) -> Any:
        """The interaction a row talks to (its extra_info.interaction_kwargs `name`), or None."""
        if not self.config.interaction_config_path or not row.interaction_kwargs:
            return None
        from verl.interactions.utils.interaction_registry import interactions_of

        interactions = interactions_of(self.config.interaction_config_path)
        name = row.interaction_kwargs.get("name")
        if name not in interactions:
            raise ValueError(f"extra_info.interaction_kwargs.name={name!r} names no interaction of "
                             f"{self.config.interaction_config_path} (it has {sorted(interactions)})")
        return interactions[name]

    def wants_user_turn(self, row: _Row, res: _TurnResult) -> bool:
        """A turn without calls that the model ended (it answered or wrote EOS) gets the interaction's reply,
        within the turn limits (veRL's: max_assistant_turns, max_user_turns) and the budget."""
        return (not res.calls and (res.action.kind == "answer" or res.emitted_eos) and not self.is_final(row)
                and row.response_len + len(res.kept_ids) < self.config.max_total_response_length)

    async def user_reply(self, interaction: Any, row: _Row, res: _TurnResult, stats: Counter[str]) -> str | None:
        """The interaction's reply to the turn (None: it ends the row); its score goes to `row.turn_scores`.
        An exception from the interaction is the row's counted error and ends it."""
        assistant = {"role": "assistant", "content": self.text.tokenizer.decode(res.kept_ids, skip_special_tokens=True)}
        try:
            terminate, reply, score, _ = await interaction.generate_response(
                row.request_id, [*(row.messages or []), assistant], **row.interaction_kwargs)
        except Exception as err:   # noqa: BLE001 - the interaction's failure is the row's
            stats["row_errors"] += 1
            stats[f"row_errors/{type(err).__name__}"] += 1
            logger.error("interaction %r failed (%s: %s); the row ends", getattr(interaction, "name", "?"),
                         type(err).__name__, err, exc_info=err)
            return None
        if score is not None:
            row.turn_scores.append(float(score))
        stats["interaction_turns"] += 1
        return None if terminate else str(reply)

    def remaining(self, row: _Row) -> int:
        """Tokens the row may still generate (veRL's response budget over all turns)."""
        return max(0, int(self.config.max_total_response_length) - row.response_len)


async def _gather(coros: Any) -> None:
    await asyncio.gather(*coros)


def turn_limit(config: GenerationConfig) -> int:
    """Most turns a row can take: max_assistant_turns, else the budget (each turn costs >= 1 token)."""
    return int(config.max_assistant_turns or config.max_total_response_length)


__all__ = ["ToolTurns", "turn_limit"]
