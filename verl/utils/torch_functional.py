"""Tensor helpers shared by the actor, critic, rollout and the PPO algorithms.

Every statistic here is taken over `mask == 1` only: padding and observation
tokens (retrieved passages) must never move a mean, a variance or a loss.
Shapes: B = rows, R = response length, V = vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.optim.lr_scheduler import LambdaLR

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

# Rows per chunk in logprobs_from_logits: bounds the (rows, V) float32 temporary
# created by logsumexp, which dominates memory with a large vocabulary.
_LOGPROB_CHUNK_ROWS = 1024


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Sum of `values` where `mask` is 1 (a 0/1 mask).

    Selected, not multiplied: a NaN or inf outside the mask (a -inf log-prob on padding) would make
    `values * mask` NaN there, and the sum with it."""
    kept = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return kept.sum(dim=axis) if axis is not None else kept.sum()


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Mean of `values` where `mask` is 1 (an all-zero mask gives 0, not NaN)."""
    count = mask.sum(dim=axis) if axis is not None else mask.sum()
    return masked_sum(values, mask, axis) / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `values` over the masked entries (Bessel-corrected when `unbiased`)."""
    mean = masked_mean(values, mask)
    centred = values - mean
    variance = masked_mean(centred**2, mask)
    if unbiased:
        count = mask.sum()
        if count <= 1:
            raise ValueError(f"masked_var: need at least 2 masked entries for an unbiased variance, got {int(count)}")
        variance = variance * count / (count - 1)
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(values - mean) / std with both statistics over the masked entries."""
    mean = masked_mean(values, mask)
    count = mask.sum()
    variance = masked_var(values, mask, unbiased=bool(count > 1))
    whitened = (values - mean) * torch.rsqrt(variance + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[label] for every position; logits (..., V), labels (...).

    Computed as gather minus logsumexp, chunked over rows, so the full (N, V)
    log-softmax tensor is never materialised. With grad enabled, autograd still keeps each
    chunk's (rows, V) tensors for backward; the actor's training head uses
    `verl.utils.logprob_head` instead, which saves O(H) bytes per position.
    """
    batch_shape = labels.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1)
    pieces = []
    for start in range(0, flat_logits.shape[0], _LOGPROB_CHUNK_ROWS):
        chunk = flat_logits[start:start + _LOGPROB_CHUNK_ROWS].float()
        chunk_labels = flat_labels[start:start + _LOGPROB_CHUNK_ROWS]
        picked = chunk.gather(dim=-1, index=chunk_labels.unsqueeze(-1)).squeeze(-1)
        pieces.append(picked - torch.logsumexp(chunk, dim=-1))
    if not pieces:
        return torch.zeros(batch_shape, dtype=torch.float32, device=logits.device)
    return torch.cat(pieces).reshape(batch_shape)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last axis: logsumexp - sum(p * logits).

    Chunked over rows like `logprobs_from_logits`: the fp32 copy and the probabilities exist
    for one chunk of rows at a time, never for the whole (N, V)."""
    batch_shape = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    pieces = []
    for start in range(0, flat.shape[0], _LOGPROB_CHUNK_ROWS):
        chunk = flat[start:start + _LOGPROB_CHUNK_ROWS].float()
        probs = F.softmax(chunk, dim=-1)
        pieces.append(torch.logsumexp(chunk, dim=-1) - (probs * chunk).sum(dim=-1))
    if not pieces:
        return torch.zeros(batch_shape, dtype=torch.float32, device=logits.device)
    return torch.cat(pieces).reshape(batch_shape)


def rows_with_tokens(mask: torch.Tensor) -> int:
    """Rows of a (B, R) mask with at least one token: the rows a seq-mean loss averages over (a row
    whose every token was rejected or masked is not one of them)."""
    return int((mask.sum(dim=-1) > 0).sum())


def micro_batch_share(micro_mask: torch.Tensor, mini_mask_total: float, micro_rows: int, mini_rows: float,
                      loss_agg_mode: str, dp_size: int = 1) -> float:
    """The weight of one micro-batch's loss in its mini-batch's gradient.

    token-mean: its share of the mini-batch's loss tokens, so micro-batches of unequal token
    counts (dynamic batch size) sum to the token-mean of the whole mini-batch; the seq-mean
    modes (seq-mean-token-sum-norm included): its share of the rows, counting rows with at least one loss token only
    (`rows_with_tokens`, as `agg_loss` does), so `micro_rows` and `mini_rows` are such counts.
    Under data parallelism pass the totals over all ranks (`data_parallel_totals`) and their
    number: FSDP averages gradients over the ranks, so each share is scaled by `dp_size` and the
    update is the global mini-batch's loss, whatever the ranks' token counts."""
    if loss_agg_mode == "token-mean":
        return dp_size * float(micro_mask.sum()) / max(float(mini_mask_total), 1.0)
    return dp_size * micro_rows / max(float(mini_rows), 1.0)


def data_parallel_totals(tokens: float, rows: int, device: torch.device | str) -> tuple[float, float, int]:
    """(tokens, rows) of this rank's mini-batch summed over the data-parallel ranks, and their
    number; (tokens, rows, 1) without a process group. The tensor lives on `device` (NCCL reduces
    CUDA tensors only)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tokens, float(rows), 1
    totals = torch.tensor([tokens, float(rows)], dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    return float(totals[0]), float(totals[1]), dist.get_world_size()


def clip_by_value(x: torch.Tensor, lo: torch.Tensor | float, hi: torch.Tensor | float) -> torch.Tensor:
    """Element-wise clamp that also accepts tensor bounds."""
    return torch.clamp(x, min=lo, max=hi)


def get_response_mask(response_id: torch.Tensor, eos_token: int | Sequence[int] = 2,
                      dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """1 for every response token up to and including the first eos, 0 after it.  (B, R)"""
    eos_ids = [eos_token] if isinstance(eos_token, int) else list(eos_token)
    is_eos = torch.isin(response_id, torch.tensor(eos_ids, device=response_id.device))
    # Number of eos tokens strictly before each position; the first eos itself stays 1.
    eos_before = torch.cumsum(is_eos.long(), dim=-1) - is_eos.long()
    return (eos_before == 0).to(dtype)


def compute_position_id_with_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position ids for a (left-)padded batch: cumsum(mask) - 1, clipped at 0."""
    return torch.clip(torch.cumsum(mask, dim=-1) - 1, min=0)


def pad_2d_list_to_length(response: list[list[int]], pad_token_id: int, max_length: int | None = None) -> torch.Tensor:
    """Right-pad a list of token-id lists into a (B, L) long tensor; L = max(longest, max_length)."""
    longest = max((len(row) for row in response), default=0)
    target = longest if max_length is None else max(longest, max_length)
    rows = [list(row) + [pad_token_id] * (target - len(row)) for row in response]
    return torch.tensor(rows, dtype=torch.long).reshape(len(rows), target)


def pad_sequence_to_length(tensor: torch.Tensor, max_len: int, pad_value: float,
                           left_pad: bool = False) -> torch.Tensor:
    """Pad the last axis of `tensor` to `max_len` (no-op when already that long)."""
    missing = max_len - tensor.shape[-1]
    if missing <= 0:
        return tensor
    padding = (missing, 0) if left_pad else (0, missing)
    return F.pad(tensor, padding, "constant", pad_value)


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str,
             loss_scale_factor: float | None = None) -> torch.Tensor:
    """Reduce a (B, R) per-token loss to a scalar.

    token-mean: mean over all masked tokens of the batch (long answers weigh more);
    seq-mean-token-sum: per-row sum, then mean over rows;
    seq-mean-token-mean: per-row mean, then mean over rows (each row weighs the same);
    seq-mean-token-sum-norm (Dr. GRPO, arXiv:2503.20783): per-row sum divided by a constant,
    `loss_scale_factor` (actor.loss_scale_factor; None: R, the padded response length), then mean
    over rows -- no per-row length normalisation, so no length bias.
    The seq-mean modes average over the rows with at least one masked token (as veRL): a row
    whose tokens were all rejected (rollout correction) is out of the loss, denominator included.
    No rows with tokens: 0.
    (veRL's seq-mean-token-sum-norm sums over the micro-batch's rows without dividing by their
    number and relies on the micro-batch scaling; here it is a per-row mean like the other seq-mean
    modes, so a mini-batch split into micro-batches and ranks gives the unsplit loss.)
    """
    if loss_agg_mode == "token-mean":
        return masked_mean(loss_mat, loss_mask)
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        per_row = (masked_mean(loss_mat, loss_mask, axis=-1) if loss_agg_mode == "seq-mean-token-mean"
                   else masked_sum(loss_mat, loss_mask, axis=-1))
        if loss_agg_mode == "seq-mean-token-sum-norm":
            scale = float(loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
            if not scale > 0:
                raise ValueError(f"actor.loss_scale_factor must be > 0, got {loss_scale_factor!r}")
            per_row = per_row / scale
        rows = loss_mask.sum(dim=-1) > 0
        return masked_sum(per_row, rows) / rows.sum().clamp(min=1)
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r} (actor.loss_agg_mode); expected one of {LOSS_AGG_MODES}")


def get_constant_schedule_with_warmup(optimizer: torch.optim.Optimizer, num_warmup_steps: int,
                                      last_epoch: int = -1) -> LambdaLR:
    """Linear warm-up from 0 to the base lr over `num_warmup_steps`, then constant."""

    def lr_lambda(step: int) -> float:
        if step < num_warmup_steps:
            return float(step) / float(max(1, num_warmup_steps))
        return 1.0

    return LambdaLR(optimizer, lr_lambda, last_epoch)


def get_cosine_schedule_with_warmup(optimizer: torch.optim.Optimizer, num_warmup_steps: int,
                                    num_training_steps: int, min_lr_ratio: float = 0.0,
                                    num_cycles: float = 0.5, last_epoch: int = -1) -> LambdaLR:
    """Linear warm-up, then a cosine decay from the base lr to `min_lr_ratio` * base lr."""
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"optim.min_lr_ratio must lie in [0, 1], got {min_lr_ratio}")

    def lr_lambda(step: int) -> float:
        if step < num_warmup_steps:
            return float(step) / float(max(1, num_warmup_steps))
        progress = float(step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
        progress = min(progress, 1.0)
        cosine = 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))
        return min_lr_ratio + (1.0 - min_lr_ratio) * cosine

    return LambdaLR(optimizer, lr_lambda, last_epoch)
