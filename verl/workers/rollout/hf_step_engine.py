"""Continuous batching over a Hugging Face causal LM with a KV cache: the step engine the async
rollout drives (`async_engine.AsyncEngine`) when the rollout engine is `hf`.

    engine = AsyncEngine(HFStepEngine(module, params, tokenizer, max_num_seqs=64))

What a step costs on a GPU is what the host issues, not the tokens (docs/rollout.md "Sync and
async on a GPU"): so one step is one batched decode forward over every running row, one
batched draw (one `exponential_` a row for its own generator, the rest for the batch), and one
device-to-host copy (the ids and log-probs), whatever the number of rows; requests join in
groups (one prefill forward each), and the bookkeeping that trims the batch lives on the host.
`verl.workers.rollout.counters` counts all of it; tests/workers/test_step_engine_costs.py pins it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from verl.workers.rollout.async_engine import Completion, request_max_tokens
from verl.workers.rollout.sampling import (
    SamplingParams,
    StopStringMatcher,
    sample_next_token,
    sampled_log_probs,
)

# Stored on the device (B, T) with this dtype; the host copy of one step's ids and log-probs is float64
# (exact for ids below 2**53 and for float32 log-probs).
_STEP_COPY_DTYPE = torch.float64


@dataclass
class _Waiting:
    request_id: str
    prompt_ids: list[int]
    seed: int
    after_cohort: int               # the cohort of the request it continues (-1: none)


@dataclass
class _Live:
    request_id: str
    generator: torch.Generator
    length: int                     # its columns in the cache: prompt + tokens fed so far (host-side)
    cohort: int                     # the join (admission group) it came in with
    sampled: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)


def _kv_layers(cache: Any) -> list[Any]:
    layers = getattr(cache, "layers", None)
    if layers is None or any(getattr(layer, "is_sliding", False) or not hasattr(layer, "keys") for layer in layers):
        raise ValueError("actor_rollout_ref.rollout.mode=async with the hf engine needs a model whose KV cache is "
                         "a transformers DynamicCache of full-attention layers; use mode=sync for this model")
    return layers


def _left_pad_time(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """(B, H, T, D) -> (B, H, width, D), zeros on the left (masked out by the attention mask)."""
    missing = width - tensor.shape[-2]
    if missing <= 0:
        return tensor
    return torch.cat([tensor.new_zeros(*tensor.shape[:-2], missing, tensor.shape[-1]), tensor], dim=-2)


class HFStepEngine:
    """Continuous batching over a Hugging Face causal LM with a KV cache.

    The batch is left-aligned to a common width: requests that join are prefilled together on
    their own batch, then their cache, mask and positions are left-padded to the running batch's
    width and stacked under it; a request that finishes is dropped from every tensor, and
    columns no remaining request uses are trimmed. Padding is masked, positions are explicit,
    so a row's logits do not depend on its neighbours (beyond float rounding).

    Joining: a join is one more forward, which on a GPU costs about a decode step whatever its
    rows; joining as soon as a request arrived made the demo's async rollout 43 prefill forwards
    of 6 rows where sync made 3 of 88. So the waiting requests join together (one prefill) when
    nothing is decoding, or when they are at least as many as the requests decoding (the rest
    are stragglers sync mode would wait for), or when one of them continues a request whose
    cohort (the requests that joined with it, and those before) has all finished; sync mode
    starts the next turn when the whole turn has. Which requests join when changes only the
    timing: each row samples from its own generator, on logits its neighbours do not change."""

    # AsyncEngine steps it in a worker thread (it names its CUDA device there itself).
    steps_off_loop = True

    def __init__(self, module: nn.Module, params: SamplingParams, tokenizer: Any, max_num_seqs: int = 64,
                 accepts_logits_to_keep: bool = True) -> None:
        self.module = module
        self.params = params
        self.max_num_seqs = max(1, int(max_num_seqs))
        self.matcher = StopStringMatcher(tokenizer, params.stop)
        self._keep_last = {"logits_to_keep": 1} if accepts_logits_to_keep else {}
        self._waiting: list[_Waiting] = []
        self._cohorts = 0                              # joins so far
        self._live: list[_Live] = []
        self._max_tokens: dict[str, int] = {}          # request id -> its decode budget
        self._cache: Any = None
        self._mask: torch.Tensor | None = None        # (B, T)
        self._next_pos: torch.Tensor | None = None    # (B, 1)
        self._logits: torch.Tensor | None = None      # (B, V), the next token's
        self._eos = set(params.eos_token_ids)
        self.device = next(module.parameters()).device

    def add(self, request_id: str, prompt_ids: Sequence[int], seed: int, max_tokens: int | None = None,
            after_cohort: int = -1) -> None:
        """Queue a request with its decode budget (`max_tokens`, see request_max_tokens); `after_cohort`:
        the cohort of the completion it continues (see the class)."""
        if not prompt_ids:
            raise ValueError(f"request {request_id}: empty prompt")
        self._max_tokens[request_id] = request_max_tokens(request_id, max_tokens, self.params.response_length)
        self._waiting.append(_Waiting(request_id, list(prompt_ids), seed, after_cohort))

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._live)

    def abort(self, request_ids: Sequence[str]) -> None:
        """Drop these requests, waiting or decoding (a failed call must leave nothing behind)."""
        gone = set(request_ids)
        for request_id in gone:
            self._max_tokens.pop(request_id, None)
        self._waiting = [item for item in self._waiting if item.request_id not in gone]
        keep = [row for row, live in enumerate(self._live) if live.request_id not in gone]
        if len(keep) < len(self._live):
            self._select(keep)

    def step(self) -> list[tuple[str, Completion]]:
        """Admit waiting requests (see the class docstring), sample one token for every running
        row, and decode them; returns the requests that finished, with their completions."""
        # The CUDA device is per thread, and AsyncEngine may call this from a worker thread.
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            return self._step()

    @torch.no_grad()
    def _step(self) -> list[tuple[str, Completion]]:
        self._admit()
        if not self._live:
            return []
        logits = self._logits
        tokens = sample_next_token(logits, self.params, [live.generator for live in self._live])
        token_log_probs = sampled_log_probs(logits, tokens, self.params)
        # The step's one device->host copy: every row's id and log-prob together.
        host_tokens, host_log_probs = torch.stack(
            [tokens.to(_STEP_COPY_DTYPE), token_log_probs.to(_STEP_COPY_DTYPE)]).tolist()
        finished: list[tuple[str, Completion]] = []
        keep: list[int] = []
        for row, (live, token, log_prob) in enumerate(zip(self._live, host_tokens, host_log_probs, strict=True)):
            token = int(token)
            live.sampled.append(token)
            live.log_probs.append(log_prob)
            done = (len(live.sampled) >= self._max_tokens[live.request_id]
                    or (not self.params.ignore_eos and token in self._eos)
                    or self.matcher.completes_stop(live.sampled))
            if done:
                del self._max_tokens[live.request_id]
                finished.append((live.request_id, Completion(live.sampled, live.log_probs, live.cohort)))
            else:
                keep.append(row)
        if len(keep) < len(self._live):
            index = self._select(keep)
            if self._live:
                tokens = tokens.index_select(0, index)
        if self._live:
            self._decode(tokens)
        return finished

    # --- internals ----------------------------------------------------------------------

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A host tensor on the engine's device without a stream sync: from pinned memory, non-blocking
        (a pageable copy waits for the stream; pinned memory's lifetime is tracked by torch's host allocator)."""
        if self.device.type == "cuda":
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    def _joins_now(self, room: int) -> bool:
        """Whether the waiting requests join at this step (the class docstring says why)."""
        if not self._live or len(self._waiting) >= min(room, len(self._live)):
            return True
        oldest_running = min(live.cohort for live in self._live)
        return any(w.after_cohort < oldest_running for w in self._waiting)

    def _admit(self) -> None:
        room = self.max_num_seqs - len(self._live)
        if room <= 0 or not self._waiting or not self._joins_now(room):
            return
        joining, self._waiting = self._waiting[:room], self._waiting[room:]
        cohort, self._cohorts = self._cohorts, self._cohorts + 1
        width = max(len(w.prompt_ids) for w in joining)
        # (2, B, W) on the host: ids and mask, left-padded; one copy to the device.
        host = torch.zeros((2, len(joining), width), dtype=torch.long)
        host[0].fill_(self.params.pad_token_id)
        for row, w in enumerate(joining):
            host[0, row, width - len(w.prompt_ids):] = torch.as_tensor(w.prompt_ids, dtype=torch.long)
            host[1, row, width - len(w.prompt_ids):] = 1
        input_ids, mask = self._to_device(host).unbind(0)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.module(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                          **self._keep_last)
        # On the compute device: the draw over CUDA probabilities needs a CUDA generator.
        new_live = [_Live(w.request_id, torch.Generator(device=self.device).manual_seed(w.seed), len(w.prompt_ids),
                          cohort) for w in joining]
        self._stack(out.past_key_values, mask, positions[:, -1:] + 1, out.logits[:, -1, :].float(), new_live)

    def _stack(self, cache: Any, mask: torch.Tensor, next_pos: torch.Tensor, logits: torch.Tensor,
               live: list[_Live]) -> None:
        if not self._live:
            self._cache, self._mask, self._next_pos, self._logits, self._live = cache, mask, next_pos, logits, live
            return
        width = max(self._mask.shape[1], mask.shape[1])
        for old, new in zip(_kv_layers(self._cache), _kv_layers(cache), strict=True):
            old.keys = torch.cat([_left_pad_time(old.keys, width), _left_pad_time(new.keys, width)], dim=0)
            old.values = torch.cat([_left_pad_time(old.values, width), _left_pad_time(new.values, width)], dim=0)

        def pad_mask(m: torch.Tensor) -> torch.Tensor:
            return torch.cat([m.new_zeros(m.shape[0], width - m.shape[1]), m], dim=1)

        self._mask = torch.cat([pad_mask(self._mask), pad_mask(mask)], dim=0)
        self._next_pos = torch.cat([self._next_pos, next_pos], dim=0)
        self._logits = torch.cat([self._logits, logits], dim=0)
        self._live = self._live + live

    def _select(self, rows: list[int]) -> torch.Tensor | None:
        """Keep these rows (in this order); returns their index on the device (None when none are left)."""
        self._live = [self._live[row] for row in rows]
        if not rows:
            self._cache = self._mask = self._next_pos = self._logits = None
            return None
        index = self._to_device(torch.tensor(rows, dtype=torch.long))
        # Columns only departed rows used are dropped from the front; the rows' lengths are known
        # on the host, so finding them reads nothing back from the device.
        first = self._mask.shape[1] - max(live.length for live in self._live)
        self._mask = self._mask.index_select(0, index)[:, first:]
        for layer in _kv_layers(self._cache):
            layer.keys = layer.keys.index_select(0, index)[:, :, first:]
            layer.values = layer.values.index_select(0, index)[:, :, first:]
        self._next_pos = self._next_pos.index_select(0, index)
        self._logits = self._logits.index_select(0, index)
        return index

    def _decode(self, tokens: torch.Tensor) -> None:
        self._mask = torch.cat([self._mask, self._mask.new_ones(self._mask.shape[0], 1)], dim=1)
        out = self.module(input_ids=tokens.unsqueeze(-1), attention_mask=self._mask, position_ids=self._next_pos,
                          past_key_values=self._cache, use_cache=True)
        for live in self._live:
            live.length += 1
        self._cache = out.past_key_values
        self._logits = out.logits[:, -1, :].float()
        self._next_pos = self._next_pos + 1
