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
from typing import Any

import torch
from torch import nn

from verl.utils import batch_keys as K
from verl.workers.rollout.base import BaseRollout, prompt_and_response_batch
from verl.workers.rollout.hf_step_engine import HFStepEngine
from verl.workers.rollout.sampling import (
    SamplingParams,
    StopStringMatcher,
    filter_top_k_top_p,
    sample_next_token,
    sampled_log_probs,
    sampling_params_from,
)

__all__ = ["HFRollout", "SamplingParams", "StopStringMatcher", "filter_top_k_top_p", "sample_next_token",
           "sampled_log_probs", "sampling_params_from"]


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
