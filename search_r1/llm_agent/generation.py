"""Multi-turn rollout with search and state masking (the Search-R1 generation manager).

`LLMGenerationManager.run_llm_loop` runs every prompt of a batch for several turns:
the policy writes until it closes `</search>` or `</answer>` (stop strings in the
engine); a search is sent to the retrieval server (one HTTP call per turn for all
rows) and the rendered `<information>` block is appended as an observation; an
answer, or EOS, ends the row. After `max_turns` turns one final turn is allowed in
which a search is not run.

Departures from the original Search-R1 (DESIGN §4):
- Token exactness: the sampled ids are kept as the engine returned them and cut at
  the first complete action by token position; text is decoded only to parse the
  action. Observations are tokenized once and appended, special tokens split (a
  page's `<|im_end|>` is text, not the control token). The trained response is
  exactly the sampled one, EOS included where emitted.
- One mask: each row carries a 0/1 list built as tokens are appended (policy = 1,
  observation = 0); `info_mask` and `loss_mask` come from it, never from comparing
  ids with the pad id.
- Observation truncation keeps the closing `</information>` and is counted.
- A failed retrieval becomes an observation and is counted; the run goes on.
- The rolling context keeps the whole prompt (its start holds the instructions)
  and drops the oldest turns when it exceeds `max_prompt_length`; a prompt longer
  than `max_start_length` is rejected with the row's index instead of being cut.
- `no_think_rl` is not supported: it would need decoding the policy's tokens and
  re-encoding the action, which breaks token exactness. Configuring it raises.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from search_r1.llm_agent import actions
from search_r1.llm_agent.actions import Action
from search_r1.llm_agent.generation_config import GenerationConfig
from search_r1.llm_agent.open_tag import OpenTag
from search_r1.llm_agent.row_outputs import attach_row_outputs
from search_r1.llm_agent.tensor_helper import (
    left_pad,
    masked_rows,
    position_ids_from_mask,
    real_tokens,
    right_pad,
)
from search_r1.llm_agent.token_text import TokenText
from search_r1.llm_agent.tool_turns import ToolTurns, turn_limit
from search_r1.llm_agent.trajectory import _Row, _TurnResult, rollout_statistics
from search_r1.search.schema import Hit
from verl.utils import batch_keys as K

logger = logging.getLogger(__name__)

# generate_trajectories' contract: the config goes in meta_info, rows and counters come back per row.
META_AGENT_CONFIG = "agent_config"
AGENT_ROWS = "agent_rows"
AGENT_STATS = "agent_stats"


def row_fields(batch: Any, n_rows: int) -> list[dict[str, Any]]:
    """Each row's non-tensor fields (extra_info, raw_prompt, agent_name, ...; veRL passes them to an agent
    loop's run as keywords), {} for a batch without any."""
    columns = (getattr(batch, "non_tensor_batch", None) or {}) if batch is not None else {}
    return [{key: values[i] for key, values in columns.items()} for i in range(n_rows)]


def row_extra_infos(gen_batch: Any, n_rows: int) -> list[dict]:
    """Each row's `extra_info` (a dict; {} when the batch carries none)."""
    return [dict(f[K.EXTRA_INFO]) if isinstance(f.get(K.EXTRA_INFO), dict) else {} for f in row_fields(gen_batch, n_rows)]


def tools_kwargs_of(extra_info: dict) -> dict:
    """veRL's `extra_info.tools_kwargs`: per tool name, its create/execute/calc_reward/release kwargs."""
    kwargs = extra_info.get("tools_kwargs") if isinstance(extra_info, dict) else None
    return dict(kwargs) if isinstance(kwargs, dict) else {}


def prompts_of(rows: Sequence[_Row], prompts: torch.Tensor, prompt_mask: torch.Tensor, pad_token_id: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's prompts as its rows hold them: the given tensors when no row's prompt changed (an agent
    loop of the user's may build its own), else every row's prompt left-padded anew."""
    if [row.prompt_ids for row in rows] == real_tokens(prompts, prompt_mask):
        return prompts, prompt_mask
    return left_pad([row.prompt_ids for row in rows], pad_token_id)


def eos_token_ids(meta: dict[str, Any]) -> frozenset[int]:
    eos = meta[K.META_EOS_TOKEN_ID]
    return frozenset(int(e) for e in eos) if isinstance(eos, list | tuple) else frozenset({int(eos)})


class LLMGenerationManager:
    """Runs multi-turn search rollouts through `actor_rollout_wg.generate_sequences`."""

    def __init__(self, tokenizer: Any, actor_rollout_wg: Any, config: GenerationConfig,
                 is_validation: bool = False, retrieval_client: Any | None = None) -> None:
        self.tokenizer = tokenizer
        self.actor_rollout_wg = actor_rollout_wg
        self.config = config
        self.is_validation = is_validation
        self._client = retrieval_client
        # Partial rollout (a pipelined run's rollout.partial): called before every turn of the sync loop;
        # brings the engines to the newest weights between turns and returns their policy version, which
        # each turn's tokens record (`token_versions`). None: one version for the whole rollout.
        self.turn_version: Callable[[], int] | None = None
        # False once an engine reported log-probs that are not the actor's quantity (vllm_rollout.log_probs_mode).
        self._log_probs_match_actor = True
        if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
            raise ValueError("tokenizer must define both pad_token_id and eos_token_id")
        self.text = TokenText(tokenizer)
        self._tool: ToolTurns | None = None
        self._open = OpenTag(config) if config.open_tag else None   # the open tag (off: the original's strings)
        if config.protocol == "tool":
            self._tool = ToolTurns(self.text, config)
            return
        self._invalid_notice = actions.INVALID_ACTION_NOTICE_WITH_OPEN if self._open else actions.INVALID_ACTION_NOTICE
        self._close_ids = self.text.encode(actions.INFORMATION_CLOSE)
        self._invalid_ids = self.text.encode(self._invalid_notice)
        self._budget_ids = self.text.encode(actions.SEARCH_BUDGET_NOTICE)
        for name, ids in (("the invalid-action notice", self._invalid_ids),
                          ("the search-budget notice", self._budget_ids),
                          ("the open-budget notice", self.text.encode(actions.OPEN_BUDGET_NOTICE) if self._open else []),
                          ("the </information> closing", self._close_ids)):
            if len(ids) > config.max_obs_length:
                raise ValueError(f"max_obs_length ({config.max_obs_length}) is shorter than {name} "
                                 f"({len(ids)} tokens)")

    # --- cut and observe (tags; the tool protocol delegates) ------------------------

    def _cut_turn(self, sampled: list[int], eos_token_ids: frozenset[int],
                  stats: Counter[str] | None = None) -> _TurnResult:
        """Keep the sampled ids up to the token that completes the first action.

        With stop strings in the engine the action already ends the turn; without
        them (or with an engine that overshoots) the tail is dropped here by token
        position. Decoded text is used only to find that position.

        Never raises for a row: parsing refuses hostile text without an exception, and any exception
        left (a bug) makes the whole turn that row's invalid action (tags) or tool-call error (tool),
        counted in `row_errors` and logged with its traceback; the batch goes on.
        """
        try:
            if self._tool is not None:
                return self._tool.cut_turn(sampled, eos_token_ids)
            return self._cut_tag_turn(sampled, eos_token_ids)
        except Exception as err:
            self._row_error("reading the turn", err, stats)
            emitted_eos = bool(sampled) and sampled[-1] in eos_token_ids
            if self._tool is not None:
                return self._tool.unreadable_turn(sampled, emitted_eos, err)
            return _TurnResult(kept_ids=sampled, action=Action(kind="invalid", content=""), emitted_eos=emitted_eos,
                               generated=len(sampled))

    @staticmethod
    def _row_error(stage: str, err: Exception, stats: Counter[str] | None) -> None:
        """Count one row's unexpected exception (`row_errors`, and by type) and log it with its traceback."""
        if stats is not None:
            stats["row_errors"] += 1
            stats[f"row_errors/{type(err).__name__}"] += 1
        logger.error("rollout: %s failed for one row (%s: %s); that row gets an error and the batch goes on",
                     stage, type(err).__name__, err, exc_info=err)

    def _cut_tag_turn(self, sampled: list[int], eos_token_ids: frozenset[int]) -> _TurnResult:
        text = self.text.decode(sampled)
        opens = self.config.open_tag
        action = actions.parse_action(text, opens)
        kept = sampled
        if action.is_valid and text[action.end:]:
            kept = self.text.shortest_prefix(sampled, lambda t: actions.has_complete_action(t, opens))
            action = actions.parse_action(self.text.decode(kept), opens)
        emitted_eos = bool(kept) and kept[-1] in eos_token_ids
        queries = (action.content,) if action.kind == "search" else ()
        return _TurnResult(kept_ids=kept, action=action, emitted_eos=emitted_eos, generated=len(sampled),
                           queries=queries)

    def _observation_ids(self, text: str) -> tuple[list[int], bool]:
        """Tokenize an observation once; if too long, cut the body but keep `</information>\\n\\n`.
        The text is the environment's (pages, hits, notices): a special token's text in it is ordinary
        text tokens (`encode_plain`), never a control id a page could forge a turn with.

        Returns (ids, truncated).
        """
        if not text.endswith(actions.INFORMATION_CLOSE):
            ids = self.text.encode_plain(text)
            return ids[: self.config.max_obs_length], len(ids) > self.config.max_obs_length
        body = self.text.encode_plain(text[: -len(actions.INFORMATION_CLOSE)])
        room = self.config.max_obs_length - len(self._close_ids)
        if len(body) <= room:
            return body + self._close_ids, False
        return body[:room] + self._close_ids, True

    # --- the rolling context ----------------------------------------------------

    def _context(self, row: _Row) -> tuple[list[int], bool]:
        """Prompt + the newest turns that fit in `max_prompt_length`. Returns (ids, was_cut).

        Whole oldest turns are dropped first; if the newest turn alone does not fit,
        its tail is kept. The prompt itself (<= max_start_length < max_prompt_length)
        is never cut, so the instructions and question stay in view.
        """
        room = self.config.max_prompt_length - len(row.prompt_ids)
        kept: list[list[int]] = []
        used = 0
        cut = False
        for policy_ids, obs_ids in reversed(row.turns):
            turn = policy_ids + obs_ids
            if used + len(turn) <= room:
                kept.append(turn)
                used += len(turn)
                continue
            cut = True
            if not kept:
                kept.append(turn[len(turn) - room:])
            break
        tail = [tok for turn in reversed(kept) for tok in turn]
        return row.prompt_ids + tail, cut

    # --- engine and retriever -----------------------------------------------------

    def _generation_meta(self, gen_batch: Any) -> dict[str, Any]:
        meta = dict(gen_batch.meta_info)
        meta[K.META_EOS_TOKEN_ID] = meta.get(K.META_EOS_TOKEN_ID, self.tokenizer.eos_token_id)
        meta[K.META_PAD_TOKEN_ID] = meta.get(K.META_PAD_TOKEN_ID, self.tokenizer.pad_token_id)
        # Validation is greedy whatever the batch says (same data, same score), unless the trainer marked the
        # batch as its validation rollout (meta 'validate'): then rollout.val_kwargs.do_sample decided.
        sampled_validation = self.is_validation and bool(meta.get(K.META_VALIDATE, False))
        meta[K.META_DO_SAMPLE] = (bool(meta.get(K.META_DO_SAMPLE, False)) if sampled_validation
                                  else not self.is_validation and bool(meta.get(K.META_DO_SAMPLE, True)))
        meta[K.META_TEMPERATURE] = float(meta.get(K.META_TEMPERATURE, 1.0))
        meta[K.META_RESPONSE_LENGTH] = self.config.max_response_length
        meta[K.META_STOP] = list(self.config.stop)
        return meta

    def _generate(self, contexts: list[list[int]], meta: dict[str, Any]
                  ) -> tuple[list[list[int]], list[list[float]] | None]:
        """One engine call for the active rows; returns each row's sampled ids and, when the
        engine reports them (`rollout_log_probs`), each sampled id's log-prob."""
        from verl.protocol import DataProto

        input_ids, attention_mask = left_pad(contexts, self.tokenizer.pad_token_id)
        batch = DataProto.from_dict(
            tensors={K.INPUT_IDS: input_ids, K.ATTENTION_MASK: attention_mask,
                     K.POSITION_IDS: position_ids_from_mask(attention_mask)},
            meta_info=dict(meta),
        )
        out = self.actor_rollout_wg.generate_sequences(batch)
        self._log_probs_match_actor &= bool(out.meta_info.get(K.META_ROLLOUT_LOG_PROBS_MATCH_ACTOR, True))
        responses = out.batch[K.RESPONSES]
        if responses.shape[0] != len(contexts):
            raise ValueError(f"generate_sequences returned {responses.shape[0]} rows of '{K.RESPONSES}' "
                             f"for {len(contexts)} prompts")
        response_mask = out.batch[K.ATTENTION_MASK][:, -responses.shape[1]:]
        log_probs = None
        if K.ROLLOUT_LOG_PROBS in out.batch.keys():
            log_probs = masked_rows(out.batch[K.ROLLOUT_LOG_PROBS], response_mask)
        return real_tokens(responses, response_mask), log_probs

    def _retriever(self) -> Any:
        if self._client is None:
            from search_r1.search.serve_client import open_retrieval_client

            if not self.config.search_url:
                raise ValueError("GenerationConfig.search_url (retriever.url) is required when the policy searches")
            self._client = open_retrieval_client(self.config.search_url, topk=self.config.topk,
                                                 timeout=self.config.retrieval_timeout,
                                                 max_retries=self.config.retrieval_max_retries)
        return self._client

    def _retrieve(self, queries: list[str]) -> tuple[list[list[Hit]] | None, str | None]:
        """One retrieval call for `queries`: (hits per query, None), or (None, why) when it failed."""
        if not queries:
            return [], None
        from search_r1.search.client import RetrievalError

        try:
            results = self._retriever().retrieve(queries, topk=self.config.topk, return_scores=True)
        except RetrievalError as err:
            return None, str(err)
        if len(results) != len(queries):
            raise ValueError(f"retrieval returned {len(results)} result lists for {len(queries)} queries")
        return results, None

    def _limit_calls(self, row: _Row, res: _TurnResult) -> _TurnResult:
        """Tool protocol: calls past their tool's per-row budget become error answers (tags: unchanged)."""
        return res if self._tool is None else self._tool.limit_calls(row, res)

    def _runs_action(self, row: _Row, res: _TurnResult, is_final: bool) -> bool:
        """Whether the turn's search (tags) or tool calls (tool) are carried out, not refused as over budget."""
        if self._tool is not None:
            return bool(res.calls) and not self._tool.is_final(row)
        if res.action.kind == "open":   # an open past max_opens gets the open-budget notice (_apply_turn)
            return not is_final and row.n_opens < self.config.max_opens
        return res.action.kind == "search" and not is_final

    def _observation_for(self, res: _TurnResult, hits: list[list[Hit]] | None, error: str | None,
                         stats: Counter[str], others: dict[int, str] | None = None) -> str | list[str]:
        """What answers a turn whose action runs: the `<information>` block (tags), or each call's
        tool message (tool). `hits` holds one list per query of `res.queries` (None: retrieval failed);
        `others`: the answers of calls of tools other than search, when already run.

        An exception while answering one row (a bug, or a backend error no tool maps) is that row's
        failure observation, counted in `row_errors` and logged; a missing retriever URL still raises."""
        is_open = self._open is not None and res.action.kind == "open"
        if is_open and not self.config.search_url:
            raise ValueError("GenerationConfig.search_url (retriever.url) is required when the policy opens "
                             "documents (open_tag.enable)")
        if hits:   # the dumps' record of what came back (TurnTrace.doc_ids)
            res.doc_ids[:] = [tuple(hit.doc_id for hit in query_hits) for query_hits in hits]
        try:
            if self._tool is not None:
                return self._tool.answers(res, hits, error, stats, others)
            if is_open:
                return self._open.observe(res.action.content, stats)
            if hits is None:
                return actions.render_search_failure()
            return actions.render_observation(hits[0], bool(self._open))
        except Exception as err:
            self._row_error("answering the turn", err, stats)
            if self._tool is not None:
                return self._tool.failed_answers(res, err, stats)
            return actions.render_open_failure() if is_open else actions.render_search_failure()

    def _n_searches(self, res: _TurnResult) -> int:
        """The turn's searches, as valid_search_stats and search_failures count them: its search
        action (tags), or its well-formed search calls, each with all of its queries (tool)."""
        if self._tool is not None:
            return self._tool.n_searches(res)
        return len(res.queries)

    def _turn_limit(self) -> int:
        if self._tool is not None:
            return turn_limit(self.config)
        return self.config.max_turns + 1

    def _stop_before_turn(self, row: _Row) -> str | None:
        """A row that cannot take another turn (no room left in its response budget) ends here."""
        if self._tool is not None:
            return actions.CONTEXT_FULL if self._tool.remaining(row) <= 0 else None
        return actions.stop_if_context_full(row.response_len, self.config.max_response_length + self.config.max_obs_length,
                                            self.config.max_total_response_length)

    def _response_length(self, rows: Sequence[_Row]) -> int:
        """The decode budget of one engine call carrying `rows` (its `response_length`; the async loop's
        `max_tokens`, one row a call). Tags: `max_response_length` (a turn that would not fit stopped the
        row before it, `_stop_before_turn`). Tool: what is left of the row's budget of all turns; an engine
        call takes one length, so a sync call carrying several rows asks for the largest remainder and
        each row keeps only its own (`_clip_to_budget`): one call per turn, and the call lasts as long
        as its longest row whatever the others were given."""
        if self._tool is None:
            return self.config.max_response_length
        return min(self.config.max_response_length, max(self._tool.remaining(row) for row in rows))

    def _clip_to_budget(self, row: _Row, sampled: list[int], log_probs: list[float] | None
                        ) -> tuple[list[int], list[float] | None]:
        """Tool protocol: a turn keeps at most what is left of the row's budget (cut by position), so
        nothing sampled past it is kept, trained on or counted, whatever length the engine was asked for."""
        if self._tool is None:
            return sampled, log_probs
        room = self._tool.remaining(row)
        return sampled[:room], None if log_probs is None else log_probs[:room]

    # --- the loop ---------------------------------------------------------------------

    def _initial_rows(self, gen_batch: Any, initial_input_ids: torch.Tensor) -> tuple[list[_Row], torch.Tensor]:
        """Per-row prompt ids, checked against `max_start_length`; returns (rows, prompt mask (B, P))."""
        input_ids = gen_batch.batch[K.INPUT_IDS]
        attention_mask = gen_batch.batch[K.ATTENTION_MASK]
        width = initial_input_ids.shape[1]
        if initial_input_ids.shape[0] != input_ids.shape[0] or width > input_ids.shape[1]:
            raise ValueError(f"initial_input_ids {tuple(initial_input_ids.shape)} does not fit gen_batch "
                             f"'{K.INPUT_IDS}' {tuple(input_ids.shape)}")
        if not torch.equal(input_ids[:, input_ids.shape[1] - width:].long(), initial_input_ids.long()):
            raise ValueError(f"initial_input_ids must be the last columns of gen_batch '{K.INPUT_IDS}'")
        prompt_mask = attention_mask[:, attention_mask.shape[1] - width:].long()
        lengths = attention_mask.long().sum(dim=-1)
        for i, (total, kept) in enumerate(zip(lengths.tolist(), prompt_mask.sum(dim=-1).tolist(), strict=True)):
            if total != kept or kept > self.config.max_start_length:
                raise ValueError(f"prompt of row {i} has {total} tokens; max_start_length is "
                                 f"{self.config.max_start_length} (filter over-long prompts in the dataset)")
        rows = [_Row(prompt_ids=ids) for ids in real_tokens(initial_input_ids.long(), prompt_mask)]
        for row, info in zip(rows, row_extra_infos(gen_batch, len(rows)), strict=True):
            row.tools_kwargs = tools_kwargs_of(info)
        return rows, prompt_mask

    def run_llm_loop(self, gen_batch: Any, initial_input_ids: torch.Tensor) -> Any:
        """Roll out every row of `gen_batch`; returns the composed batch (see `_compose_final_output`).

        Reads gen_batch '{input_ids, attention_mask}' (left-padded) and meta_info
        'do_sample'/'temperature'; `initial_input_ids` is the prompt (last columns of
        input_ids) that becomes 'prompts'.
        """
        if self.config.openai_agent is not None:   # the user's agent via the OpenAI endpoint (openai_endpoint/)
            from search_r1.llm_agent.openai_endpoint.rollout import agent_rollout

            meta = self._generation_meta(gen_batch)
            with self._engines_awake():
                return agent_rollout(self, row_fields(gen_batch, len(gen_batch)), meta, eos_token_ids(meta))
        rows, prompt_mask = self._initial_rows(gen_batch, initial_input_ids)
        meta = self._generation_meta(gen_batch)
        self._log_probs_match_actor = True
        with self._engines_awake():
            if self.config.mode == "async":
                return self._run_async(initial_input_ids.long(), prompt_mask, meta, gen_batch)
            return self._run_sync(rows, initial_input_ids.long(), prompt_mask, meta)

    @contextmanager
    def _engines_awake(self) -> Iterator[None]:
        """The worker group's engines awake for every turn of this rollout, woken once (a no-op when
        the caller, e.g. the trainer, has them awake already; skipped for groups without engines).
        Not put back to sleep after an error: a rank may be stuck in a collective with the failed one."""
        wake = getattr(self.actor_rollout_wg, "rollout_wake_up", None)
        if wake is None:
            yield
            return
        wake()
        yield
        self.actor_rollout_wg.rollout_sleep()

    def _run_sync(self, rows: list[_Row], prompts: torch.Tensor, prompt_mask: torch.Tensor,
                  meta: dict[str, Any]) -> Any:
        """One engine call per turn for every row still active; one retrieval call per turn."""
        eos_ids = eos_token_ids(meta)
        stats: Counter[str] = Counter()
        timing = {"generate": 0.0, "retrieval": 0.0}
        versions: list[list[int]] | None = None if self.turn_version is None else [[] for _ in rows]
        if self._tool is not None:
            self._tool.start_rows(rows, stats)

        for turn in range(self._turn_limit()):
            is_final = turn == self.config.max_turns
            for row in rows:
                if row.active:
                    row.stop_reason = self._stop_before_turn(row)
            active = [i for i, row in enumerate(rows) if row.active]
            if not active:
                break
            contexts = []
            for i in active:
                ids, cut = self._context(rows[i])
                contexts.append(ids)
                stats["context_cuts"] += int(cut)
                if cut and rows[i].cut_from < 0:
                    rows[i].cut_from = rows[i].response_len

            turn_meta = {**meta, K.META_RESPONSE_LENGTH: self._response_length([rows[i] for i in active])}
            version = self.turn_version() if self.turn_version is not None else 0
            start = time.perf_counter()
            sampled, sampled_log_probs = self._generate(contexts, turn_meta)
            timing["generate"] += time.perf_counter() - start
            results = []
            for k, i in enumerate(active):
                lps = None if sampled_log_probs is None else sampled_log_probs[k]
                ids, lps = self._clip_to_budget(rows[i], sampled[k], lps)
                results.append((self._limit_calls(rows[i], self._cut_turn(ids, eos_ids, stats)), lps))

            running = [k for k, (i, (res, _)) in enumerate(zip(active, results, strict=True))
                       if self._runs_action(rows[i], res, is_final)]
            queries = [q for k in running for q in results[k][0].queries]
            start = time.perf_counter()
            hits, error = self._retrieve(queries)
            timing["retrieval"] += time.perf_counter() - start
            stats["search_failures"] += sum(self._n_searches(results[k][0]) for k in running) if hits is None else 0
            others = self._run_tools(rows, active, results, running, stats)
            observations: dict[int, str | list[str]] = {}
            position = 0
            for k in running:
                res = results[k][0]
                row_hits = None if hits is None else hits[position: position + len(res.queries)]
                if isinstance(others.get(k), BaseException):   # the row's tool calls raised: its failure answers
                    self._row_error("answering the turn", others[k], stats)
                    observations[k] = self._tool.failed_answers(res, others[k], stats)
                else:
                    observations[k] = self._observation_for(res, row_hits, error, stats, others.get(k))
                position += len(res.queries)

            for k, (i, (res, lps)) in enumerate(zip(active, results, strict=True)):
                stats["generated_tokens"] += res.generated
                stats["kept_tokens"] += len(res.kept_ids)
                self._apply_turn(rows[i], res, observations.get(k), is_final, stats, lps)
                if versions is not None:   # the turn(s) just appended were sampled by `version`
                    versions[i] += [version] * (len(rows[i].turns) - len(versions[i]))

        if self._tool is not None:
            self._tool.finish_rows(rows, stats)
        output = self._compose_final_output(rows, prompts, prompt_mask, stats, timing)
        attach_row_outputs(output, rows)
        if versions is not None:
            width = output.batch[K.RESPONSES].shape[-1]
            per_token = [[v for (policy, obs), v in zip(row.turns, vs, strict=True) for _ in range(len(policy) + len(obs))]
                         for row, vs in zip(rows, versions, strict=True)]
            output.batch[K.TOKEN_VERSIONS] = right_pad(per_token, -1, width)
        return output

    def _run_tools(self, rows: list[_Row], active: list[int], results: list, running: list[int],
                   stats: Counter[str]) -> dict[int, dict[int, str] | BaseException]:
        """Tool protocol, sync loop: the calls of tools other than search of every running row of the turn,
        at once (tool_turns.ToolTurns.run_turn); by position k in `active`."""
        if self._tool is None or not running:
            return {}
        answers = self._tool.run_turn([(rows[active[k]], results[k][0]) for k in running], stats)
        return dict(zip(running, answers, strict=True))

    def _run_async(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, meta: dict[str, Any],
                   gen_batch: Any = None) -> Any:
        """Each rollout worker runs its shard's trajectories as coroutines
        (`generate_trajectories`); the rows come back whole and are composed here."""
        from verl.protocol import DataProto

        batch = DataProto.from_dict(
            tensors={K.INPUT_IDS: prompts, K.ATTENTION_MASK: prompt_mask},
            non_tensors=dict(getattr(gen_batch, "non_tensor_batch", None) or {}),
            meta_info={**meta, META_AGENT_CONFIG: dataclasses.asdict(self.config)})
        start = time.perf_counter()
        out = self.actor_rollout_wg.generate_trajectories(batch)
        self._log_probs_match_actor = bool(out.meta_info.get(K.META_ROLLOUT_LOG_PROBS_MATCH_ACTOR, True))
        wall = time.perf_counter() - start
        rows = list(out.non_tensor_batch[AGENT_ROWS])
        per_row = list(out.non_tensor_batch[AGENT_STATS])
        if len(rows) != prompts.shape[0]:
            raise ValueError(f"generate_trajectories returned {len(rows)} rows for {prompts.shape[0]} prompts")
        stats: Counter[str] = Counter()
        for counts in per_row:
            stats.update(counts)
        # Generation and retrieval overlap: 'generate' is the rollout's wall time, 'retrieval'
        # the mean time a trajectory waited for the retriever.
        timing = {"generate": wall, "retrieval": stats.pop("retrieval_ms", 0) / 1000.0 / max(1, len(rows))}
        prompts, prompt_mask = prompts_of(rows, prompts, prompt_mask, self.tokenizer.pad_token_id)
        output = self._compose_final_output(rows, prompts, prompt_mask, stats, timing)
        attach_row_outputs(output, rows)
        return output

    def _apply_turn(self, row: _Row, res: _TurnResult, search_obs: str | list[str] | None, is_final: bool,
                    stats: Counter[str], sampled_log_probs: list[float] | None = None) -> None:
        """Append a turn and its observation to `row` and decide whether the row ends."""
        if self._tool is not None:
            self._tool.apply_turn(row, res, search_obs, stats, sampled_log_probs)
            row.record_turn(res)
            return
        row.n_turns += 1
        row.n_valid_actions += int(res.action.is_valid)
        reason = (actions.stop_if_answered(res.action)
                  or actions.stop_if_eos(res.action, res.emitted_eos)
                  or actions.stop_if_final_turn(res.action, is_final))
        obs_text = ""
        if search_obs is not None:
            row.n_opens += int(res.action.kind == "open")
            row.n_searches += int(res.action.kind != "open")
            obs_text = search_obs
        elif res.action.kind == "open":   # past max_opens, or in the final turn (the row then ends)
            obs_text = actions.OPEN_BUDGET_NOTICE
        elif reason == actions.MAX_TURNS:
            obs_text = actions.SEARCH_BUDGET_NOTICE
        elif reason is None:
            obs_text = self._invalid_notice
        obs_ids, truncated = self._observation_ids(obs_text) if obs_text else ([], False)
        stats["obs_truncated"] += int(truncated)
        row.append_turn(res.kept_ids, obs_ids, sampled_log_probs)
        row.stop_reason = reason
        row.record_turn(res)

    def _compose_final_output(self, rows: list[_Row], prompts: torch.Tensor, prompt_mask: torch.Tensor,
                              stats: Counter[str], timing: dict[str, float]) -> Any:
        """Writes prompts (B,P), responses (B,R), input_ids, attention_mask, position_ids,
        info_mask (B,P+R), loss_mask (B,R) and context_cut_mask (B,R), plus rollout statistics in meta_info."""
        from verl.protocol import DataProto

        ids_and_masks = [row.response() for row in rows]
        width = max(1, max(len(ids) for ids, _ in ids_and_masks))
        responses = right_pad([ids for ids, _ in ids_and_masks], self.tokenizer.pad_token_id, width)
        response_attention = right_pad([[1] * len(ids) for ids, _ in ids_and_masks], 0, width)
        loss_mask = right_pad([mask for _, mask in ids_and_masks], 0, width)
        cut_from = torch.tensor([row.cut_from if row.cut_from >= 0 else width for row in rows]).unsqueeze(1)
        context_cut_mask = loss_mask * (torch.arange(width).unsqueeze(0) >= cut_from).long()
        attention_mask = torch.cat([prompt_mask, response_attention], dim=1)
        tensors = {
            K.PROMPTS: prompts,
            K.RESPONSES: responses,
            K.INPUT_IDS: torch.cat([prompts, responses], dim=1),
            K.ATTENTION_MASK: attention_mask,
            K.POSITION_IDS: position_ids_from_mask(attention_mask),
            K.INFO_MASK: torch.cat([prompt_mask, loss_mask], dim=1),
            K.LOSS_MASK: loss_mask,
            K.CONTEXT_CUT_MASK: context_cut_mask,
        }
        row_log_probs = [row.response_log_probs() for row in rows]
        if all(lps is not None for lps in row_log_probs):
            tensors[K.ROLLOUT_LOG_PROBS] = torch.tensor(
                [lps + [0.0] * (width - len(lps)) for lps in row_log_probs], dtype=torch.float32)
        meta_info = rollout_statistics(rows, stats, timing, open_tag=self.config.open_tag)
        meta_info[K.META_ROLLOUT_LOG_PROBS_MATCH_ACTOR] = self._log_probs_match_actor
        traces = np.empty(len(rows), dtype=object)   # what each turn did, for the dumps
        traces[:] = [row.trace() for row in rows]
        return DataProto.from_dict(tensors=tensors, non_tensors={K.AGENT_TRACE: traces}, meta_info=meta_info)
