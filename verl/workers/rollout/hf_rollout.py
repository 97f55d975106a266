"""Rollout with a Hugging Face causal LM and our own sampling loop (KV cache, stops, token-exact).

Why not `model.generate`: we need the exact sampled ids back (never decode and
re-encode), a stop rule that cuts at the token completing `</search>` or
`</answer>`, and a mask that marks exactly the tokens the model sampled (the EOS
it emitted included). Owning the loop makes all three explicit.

    rollout = HFRollout(fsdp_module, cfg.actor_rollout_ref.rollout, tokenizer)
    out = rollout.generate_sequences(prompts)   # prompts: input_ids / attention_mask / position_ids, left-padded
    out.batch["responses"]                      # (B, R) sampled ids, right-padded with pad_token_id
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from verl.utils import batch_keys as K
from verl.workers.rollout.base import BaseRollout, prompt_and_response_batch


@dataclass(frozen=True)
class SamplingParams:
    """How one generate_sequences call samples (meta_info overrides the rollout config)."""

    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    response_length: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    stop: tuple[str, ...]
    ignore_eos: bool


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / nucleus (top-p) set to -inf; logits (B, V)."""
    if top_k and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0.0 < top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p; the best one always stays.
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, sorted_idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next_token(logits: torch.Tensor, params: SamplingParams,
                      generators: Sequence[torch.Generator] | None = None) -> torch.Tensor:
    """(B, V) logits of the last position -> (B,) next token ids. With `generators` (one per row)
    each row draws from its own generator, so its sample does not depend on the other rows."""
    if not params.do_sample or params.temperature <= 0:
        return torch.argmax(logits, dim=-1)
    probs = torch.softmax(filter_top_k_top_p(logits.float() / params.temperature, params.top_k, params.top_p), dim=-1)
    if generators is None:
        return torch.multinomial(probs, num_samples=1).squeeze(-1)
    return torch.cat([torch.multinomial(probs[row], 1, generator=gen) for row, gen in enumerate(generators)])


def sampling_params_from(config: Any, meta: dict, tokenizer: Any = None) -> SamplingParams:
    """The rollout config with one call's meta_info on top (every engine reads them alike)."""
    eos = meta.get(K.META_EOS_TOKEN_ID, getattr(tokenizer, "eos_token_id", None))
    pad = meta.get(K.META_PAD_TOKEN_ID, getattr(tokenizer, "pad_token_id", None))
    if eos is None or pad is None:
        raise KeyError("meta_info needs eos_token_id and pad_token_id (or give the rollout a tokenizer)")
    eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (int(eos),)
    return SamplingParams(
        do_sample=bool(meta.get(K.META_DO_SAMPLE, config.get("do_sample", True))),
        temperature=float(meta.get(K.META_TEMPERATURE, config.get("temperature", 1.0))),
        top_k=int(meta.get("top_k", config.get("top_k", -1)) or 0),
        top_p=float(meta.get("top_p", config.get("top_p", 1.0))),
        response_length=int(meta.get(K.META_RESPONSE_LENGTH, config.get("response_length"))),
        eos_token_ids=eos_ids,
        pad_token_id=int(pad),
        stop=tuple(meta.get(K.META_STOP) or ()),
        ignore_eos=bool(config.get("ignore_eos", False)),
    )


def sampled_log_probs(logits: torch.Tensor, token: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(B,) log-prob of each sampled token under the temperature-scaled distribution, the
    quantity the actor recomputes as old_log_prob (greedy: temperature as configured)."""
    temperature = params.temperature if params.temperature > 0 else 1.0
    return torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, token.unsqueeze(-1)).squeeze(-1)


class StopStringMatcher:
    """Says whether the token just sampled completes one of the stop strings.

    Only a tail of the row is decoded: a stop string of n UTF-8 bytes is completed
    within the last n tokens (byte-level BPE tokens are at least one byte long).
    """

    def __init__(self, tokenizer: Any, stops: tuple[str, ...]) -> None:
        if stops and tokenizer is None:
            raise ValueError("stop strings need a tokenizer: pass one to HFRollout(module, config, tokenizer)")
        self.tokenizer = tokenizer
        self.stops = tuple(s for s in stops if s)
        self.window = max((len(s.encode("utf-8")) for s in self.stops), default=0) + 4

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def completes_stop(self, row_ids: list[int]) -> bool:
        if not self.stops:
            return False
        tail = row_ids[-self.window:]
        before, now = self._decode(tail[:-1]), self._decode(tail)
        # The match must end inside the last token's text, else an earlier token completed it.
        return any(now.find(s, max(0, len(before) - len(s) + 1)) != -1 for s in self.stops)


def _append(row: list[int], token_id: int) -> list[int]:
    row.append(token_id)
    return row


class HFRollout(BaseRollout):
    """Batched, KV-cached sampling from `module` (the actor's own FSDP module on CPU: no copy)."""

    def __init__(self, module: nn.Module, config: Any, tokenizer: Any = None) -> None:
        self.module = module
        self.config = config
        self.tokenizer = tokenizer
        # Every transformers causal LM takes logits_to_keep; a custom module may not.
        params = inspect.signature(module.forward).parameters
        self._accepts_logits_to_keep = "logits_to_keep" in params or any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

    def _sampling_params(self, meta: dict) -> SamplingParams:
        return sampling_params_from(self.config, meta, self.tokenizer)

    def step_engine(self, meta: dict) -> Any:
        """A continuous-batching engine over this module for the async rollout (`async_engine.py`);
        at most `micro_batch_size` requests decode together. The caller puts the module in eval mode."""
        from verl.workers.rollout.async_engine import HFStepEngine

        return HFStepEngine(self.module, self._sampling_params(meta), self.tokenizer,
                            max_num_seqs=int(self.config.get("micro_batch_size") or 64),
                            accepts_logits_to_keep=self._accepts_logits_to_keep)

    @torch.no_grad()
    def _generate_micro_batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                              position_ids: torch.Tensor, params: SamplingParams
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (responses (B, R), response_mask (B, R), log_probs (B, R)) with R = params.response_length."""
        batch_size = input_ids.shape[0]
        device = input_ids.device
        length = params.response_length
        responses = torch.full((batch_size, length), params.pad_token_id, dtype=torch.long, device=device)
        response_mask = torch.zeros((batch_size, length), dtype=attention_mask.dtype, device=device)
        log_probs = torch.zeros((batch_size, length), dtype=torch.float32, device=device)
        done = torch.zeros(batch_size, dtype=torch.bool, device=device)
        eos_ids = torch.tensor(params.eos_token_ids, dtype=torch.long, device=device)
        matcher = StopStringMatcher(self.tokenizer, params.stop)
        sampled_rows: list[list[int]] = [[] for _ in range(batch_size)]

        # Only the last position's logits are used: logits_to_keep=1 keeps the prompt forward from
        # materialising (B, T, V) logits (tens of GB at 64 rows x 2k tokens x 152k vocab).
        keep_last = {"logits_to_keep": 1} if self._accepts_logits_to_keep else {}
        out = self.module(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=True, **keep_last)
        past, logits = out.past_key_values, out.logits[:, -1, :]
        next_position = position_ids[:, -1:] + 1
        for step in range(length):
            token = sample_next_token(logits, params)
            token = torch.where(done, torch.full_like(token, params.pad_token_id), token)
            alive = ~done
            responses[:, step] = token
            response_mask[:, step] = alive.to(response_mask.dtype)
            log_probs[:, step] = sampled_log_probs(logits, token, params) * alive
            finished_now = torch.isin(token, eos_ids) & alive if not params.ignore_eos else torch.zeros_like(done)
            if matcher.stops:
                # One device->host copy per step (not one sync per live row).
                token_ids, alive_rows = token.tolist(), alive.tolist()
                stopped = [row for row in range(batch_size) if alive_rows[row]
                           and matcher.completes_stop(_append(sampled_rows[row], token_ids[row]))]
                if stopped:
                    finished_now[stopped] = True
            done = done | finished_now
            if bool(done.all()) or step == length - 1:
                break
            # Rows that are done feed a pad token with mask 0: never attended to, never kept.
            attention_mask = torch.cat([attention_mask, alive.to(attention_mask.dtype).unsqueeze(-1)], dim=-1)
            out = self.module(input_ids=token.unsqueeze(-1), attention_mask=attention_mask,
                              position_ids=next_position, past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[:, -1, :]
            next_position = next_position + 1
        return responses, response_mask, log_probs

    def generate_sequences(self, prompts: Any) -> Any:
        """Reads input_ids, attention_mask, position_ids (left-padded prompts); meta_info sampling keys.

        Writes prompts (B, P), responses (B, R), input_ids (B, P+R), attention_mask (B, P+R:
        1 on every sampled token, the emitted EOS included), position_ids (B, P+R).
        """
        params = self._sampling_params(prompts.meta_info)
        idx = prompts.batch[K.INPUT_IDS]
        attention_mask = prompts.batch[K.ATTENTION_MASK]
        position_ids = prompts.batch[K.POSITION_IDS]
        micro = int(self.config.get("micro_batch_size") or idx.shape[0])
        was_training = self.module.training
        self.module.eval()
        try:
            parts = [self._generate_micro_batch(i, m, p, params) for i, m, p in zip(
                idx.split(micro), attention_mask.split(micro), position_ids.split(micro), strict=True)]
        finally:
            self.module.train(was_training)
        responses = torch.cat([r for r, _, _ in parts], dim=0)
        response_mask = torch.cat([m for _, m, _ in parts], dim=0)
        log_probs = torch.cat([lp for _, _, lp in parts], dim=0)
        return prompt_and_response_batch(prompts, responses, response_mask, log_probs)
