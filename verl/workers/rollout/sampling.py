"""Sampling rules every engine shares: one call's parameters, top-k / top-p, drawing the next
token, the sampled token's log-prob, and stop strings matched by token position.

    params = sampling_params_from(rollout_config, batch.meta_info, tokenizer)
    token = sample_next_token(logits_BV, params, generators)   # generators: one per row, optional
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from verl.utils import batch_keys as K


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
    return sample_rows_seeded(probs, generators)


def sample_rows_seeded(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """(B, V) probabilities -> (B,) ids, row b drawn from generators[b]: exactly what
    `torch.multinomial(probs[b], 1, generator=generators[b])` draws, batched.

    multinomial with one sample is argmax(p / q) with q ~ Exp(1) drawn into a fresh (V,) tensor
    (aten's Distributions.cpp); drawing each row's q into its row of one (B, V) tensor takes the
    same numbers from the same generator. One multinomial a row launched ~14 kernels (its checks
    included) and a row select; this is one exponential_ a row (a generator is one stream; vLLM's
    sampler draws seeded requests the same way) and one divide, argmax and check for the batch.
    """
    if len(generators) != probs.shape[0]:
        raise ValueError(f"{len(generators)} generators for {probs.shape[0]} rows")
    # multinomial's own check, batched, and device-side (no host sync on CUDA).
    valid = ((probs >= 0) & (probs < float("inf"))).all() & (probs.sum(dim=-1) > 0).all()
    torch._assert_async(valid, "probability tensor contains either `inf`, `nan` or element < 0, or a row sums to 0")
    noise = torch.empty_like(probs)
    for row_noise, gen in zip(noise.unbind(0), generators, strict=True):   # (V,) views, made in one call
        row_noise.exponential_(1.0, generator=gen)
    return probs.div(noise).argmax(dim=-1)


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
