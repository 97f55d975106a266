"""Continuous batching over a Hugging Face causal LM with a KV cache: the step engine the async
rollout drives (`async_engine.AsyncEngine`) when the rollout engine is `hf`.

    engine = AsyncEngine(HFStepEngine(module, params, tokenizer, max_num_seqs=64))
"""

from __future__ import annotations

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


@dataclass
class _Live:
    request_id: str
    generator: torch.Generator
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

    The batch is left-aligned to a common width: a request that joins is prefilled on its
    own batch, then its cache, mask and positions are left-padded to the running batch's
    width and stacked under it; a request that finishes is dropped from every tensor, and
    columns no remaining request uses are trimmed. Padding is masked, positions are explicit,
    so a row's logits do not depend on its neighbours (beyond float rounding)."""

    def __init__(self, module: nn.Module, params: SamplingParams, tokenizer: Any, max_num_seqs: int = 64,
                 accepts_logits_to_keep: bool = True) -> None:
        self.module = module
        self.params = params
        self.max_num_seqs = max(1, int(max_num_seqs))
        self.matcher = StopStringMatcher(tokenizer, params.stop)
        self._keep_last = {"logits_to_keep": 1} if accepts_logits_to_keep else {}
        self._waiting: list[tuple[str, list[int], int]] = []
        self._live: list[_Live] = []
        self._max_tokens: dict[str, int] = {}          # request id -> its decode budget
        self._cache: Any = None
        self._mask: torch.Tensor | None = None        # (B, T)
        self._next_pos: torch.Tensor | None = None    # (B, 1)
        self._logits: torch.Tensor | None = None      # (B, V), the next token's
        self._eos = set(params.eos_token_ids)
        self.device = next(module.parameters()).device

    def add(self, request_id: str, prompt_ids: Sequence[int], seed: int, max_tokens: int | None = None) -> None:
        if not prompt_ids:
            raise ValueError(f"request {request_id}: empty prompt")
        self._max_tokens[request_id] = request_max_tokens(request_id, max_tokens, self.params.response_length)
        self._waiting.append((request_id, list(prompt_ids), seed))

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._live)

    def abort(self, request_ids: Sequence[str]) -> None:
        """Drop these requests, waiting or decoding (a failed call must leave nothing behind)."""
        gone = set(request_ids)
        for request_id in gone:
            self._max_tokens.pop(request_id, None)
        self._waiting = [item for item in self._waiting if item[0] not in gone]
        keep = [row for row, live in enumerate(self._live) if live.request_id not in gone]
        if len(keep) < len(self._live):
            self._select(keep)

    @torch.no_grad()
    def step(self) -> list[tuple[str, Completion]]:
        self._admit()
        if not self._live:
            return []
        logits = self._logits
        tokens = sample_next_token(logits, self.params, [live.generator for live in self._live])
        token_log_probs = sampled_log_probs(logits, tokens, self.params).tolist()
        finished: list[tuple[str, Completion]] = []
        keep: list[int] = []
        for row, (live, token, log_prob) in enumerate(zip(self._live, tokens.tolist(), token_log_probs, strict=True)):
            live.sampled.append(token)
            live.log_probs.append(log_prob)
            done = (len(live.sampled) >= self._max_tokens[live.request_id]
                    or (not self.params.ignore_eos and token in self._eos)
                    or self.matcher.completes_stop(live.sampled))
            if done:
                del self._max_tokens[live.request_id]
                finished.append((live.request_id, Completion(live.sampled, live.log_probs)))
            else:
                keep.append(row)
        if len(keep) < len(self._live):
            self._select(keep)
        if self._live:
            self._decode(tokens[keep] if len(keep) < tokens.shape[0] else tokens)
        return finished

    # --- internals ----------------------------------------------------------------------

    def _admit(self) -> None:
        room = self.max_num_seqs - len(self._live)
        if room <= 0 or not self._waiting:
            return
        joining, self._waiting = self._waiting[:room], self._waiting[room:]
        width = max(len(ids) for _, ids, _ in joining)
        input_ids = torch.full((len(joining), width), self.params.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(joining), width), dtype=torch.long)
        for row, (_, ids, _) in enumerate(joining):
            input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
            mask[row, width - len(ids):] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.module(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                          **self._keep_last)
        # On the compute device: multinomial on CUDA probabilities needs a CUDA generator.
        new_live = [_Live(request_id, torch.Generator(device=self.device).manual_seed(seed))
                    for request_id, _, seed in joining]
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

    def _select(self, rows: list[int]) -> None:
        self._live = [self._live[row] for row in rows]
        if not rows:
            self._cache = self._mask = self._next_pos = self._logits = None
            return
        index = torch.tensor(rows, dtype=torch.long, device=self._mask.device)
        mask = self._mask.index_select(0, index)
        # Columns that only departed rows used are dropped from the front.
        first = int(mask.any(dim=0).nonzero()[0])
        self._mask = mask[:, first:]
        for layer in _kv_layers(self._cache):
            layer.keys = layer.keys.index_select(0, index)[:, :, first:]
            layer.values = layer.values.index_select(0, index)[:, :, first:]
        self._next_pos = self._next_pos.index_select(0, index)
        self._logits = self._logits.index_select(0, index)

    def _decode(self, tokens: torch.Tensor) -> None:
        self._mask = torch.cat([self._mask, self._mask.new_ones(self._mask.shape[0], 1)], dim=1)
        out = self.module(input_ids=tokens.unsqueeze(-1), attention_mask=self._mask, position_ids=self._next_pos,
                          past_key_values=self._cache, use_cache=True)
        self._cache = out.past_key_values
        self._logits = out.logits[:, -1, :].float()
        self._next_pos = self._next_pos + 1
