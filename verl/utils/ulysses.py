"""Ulysses sequence parallelism for packed rows: the core (issue 35 item 2, first part).

The ranks of a sequence-parallel (SP) group hold the same packed micro-batch; each runs the model on
one contiguous slice of its tokens (`slice_packed`). Everything but attention is per token, so it
runs on the slice alone; attention needs whole sequences, so the registered packed attention
(verl/utils/packed_attention.py) swaps layouts around it with two all-to-alls: from (all heads,
my tokens) to (my heads, all tokens), the varlen attention over the whole packed row, and back.
The heads must divide by the SP size, the key/value heads too or divide it (then each is repeated
up to the SP size; `check_heads`). Per-token results (the
log-probs) come back with `gather_tokens`, whose backward hands each rank the gradient of its slice.

    with sequence_parallel(group, packed_position_ids_1N):
        ids_1n, pos_1n, pad = slice_packed(input_ids_1N, position_ids_1N, group)
        logits = model(input_ids=ids_1n, position_ids=pos_1n, attention_mask=None).logits
        log_probs_N = gather_tokens(local_log_probs_n, group)[:N]

Every SP rank then computes the same loss; the parameter gradients summed over the SP group are
SP size times the SP=1 gradient (each rank's all-gather backward sums every rank's identical loss),
so FSDP's mean over ranks gives the SP=1 gradient. DataParallelPPOActor and DataParallelPPOCritic
run it when given `sp_group`; the FSDP workers build the groups and gather each group's rows
(verl/workers/sp_groups.py).

Gradient checkpointing recomputes each layer's forward inside `.backward()`, after the
`sequence_parallel` block has exited: the actor and critic re-enter the forward's state around each
micro-batch's backward (`with resumed(state): loss.backward()`), so the recomputed attention runs the
same all-to-alls.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn


@dataclass
class _SPState:
    group: Any
    size: int
    full_position_ids: torch.Tensor   # (1, N_padded): the whole packed row's positions
    # (cu_seqlens, max length) of that row, derived on the first layer's call and reused by every
    # other layer and by the recompute in the backward (the derivation syncs with the host twice)
    boundaries: tuple[torch.Tensor, int] | None = None


_STATE: _SPState | None = None


def active() -> _SPState | None:
    """The SP state of the forward running now, or None outside `sequence_parallel`."""
    return _STATE


def check_heads(num_heads: int, num_kv_heads: int, sp_size: int, key: str = "ulysses_sequence_parallel_size") -> None:
    """Each rank attends with a whole share of the attention heads, so they must divide by the SP size;
    the key/value heads must too, or divide it (each is then repeated sp_size / num_kv_heads times
    before the all-to-all, `heads_to_sequence`: veRL's rule)."""
    if sp_size < 1:
        raise ValueError(f"{key}={sp_size}: must be >= 1")
    if num_heads % sp_size or (num_kv_heads % sp_size and sp_size % num_kv_heads):
        raise ValueError(f"{key}={sp_size} does not fit the model's attention heads ({num_heads}) and key/value "
                         f"heads ({num_kv_heads}): the size must divide the attention heads, and either divide "
                         "the key/value heads or be a multiple of them (they are then repeated); choose such a size")


def padded_position_ids(position_ids: torch.Tensor, sp_size: int) -> tuple[torch.Tensor, int]:
    """(1, N) positions padded to a multiple of `sp_size` with one extra sequence 0, 1, ... (its own
    segment: no real token attends to it, nor it to them); returns (padded, pad)."""
    n = position_ids.shape[-1]
    pad = (-n) % sp_size
    if pad:
        extra = torch.arange(pad, device=position_ids.device, dtype=position_ids.dtype)[None]
        position_ids = torch.cat([position_ids, extra], dim=-1)
    return position_ids, pad


def slice_packed(input_ids: torch.Tensor, position_ids: torch.Tensor, group: Any
                 ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """This rank's contiguous slice of the (1, N) packed row, padded to a multiple of the group size."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    full_pos, pad = padded_position_ids(position_ids, size)
    ids = torch.cat([input_ids, input_ids.new_zeros(1, pad)], dim=-1) if pad else input_ids
    chunk = full_pos.shape[-1] // size
    sl = slice(rank * chunk, (rank + 1) * chunk)
    return ids[:, sl], full_pos[:, sl], pad


@contextmanager
def sequence_parallel(group: Any, position_ids: torch.Tensor) -> Iterator[_SPState]:
    """Within it, the packed attention runs Ulysses over `group`; `position_ids` is the whole (1, N)
    packed row's (padded here as slice_packed pads it). Yields the state, for `resumed`."""
    size = dist.get_world_size(group)
    with resumed(_SPState(group, size, padded_position_ids(position_ids, size)[0])) as state:
        yield state


@contextmanager
def resumed(state: _SPState | None) -> Iterator[_SPState | None]:
    """Re-enter a forward's SP state (None: no SP, a no-op), e.g. around its loss's `.backward()`:
    gradient checkpointing recomputes each layer's forward inside the backward, and its attention
    must run the same all-to-alls. A module global rather than a thread-local: autograd runs a CUDA
    backward (the recompute included) on its device threads, which see it while `.backward()` waits
    inside this context. Right for reentrant and non-reentrant checkpointing alike (both recompute
    within the backward call)."""
    global _STATE
    previous = _STATE
    _STATE = state if state is not None else previous
    try:
        yield state
    finally:
        _STATE = previous


def _all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    """x (P, ...) with dim 0 the destination rank -> (P, ...) with dim 0 the source rank (differentiable)."""
    x = x.contiguous()   # first: empty_like keeps a non-contiguous input's strides, the collective assumes none
    return dist_fn.all_to_all_single(torch.empty_like(x), x, group=group)


def heads_to_sequence(x: torch.Tensor, state: _SPState) -> torch.Tensor:
    """(1, H, n, D) all heads of my n tokens -> (1, H/P, P*n, D) my heads of every token.

    Key/value heads fewer than P (P a multiple of them, `check_heads`) are first repeated P/H times
    each, in place (repeat_interleave): rank r then holds key/value head r*H//P, the one its query
    heads share under GQA (query head h reads key/value head h // (Hq/H))."""
    p = state.size
    if x.shape[1] < p:
        x = x.repeat_interleave(p // x.shape[1], dim=1)
    _, heads, n, dim = x.shape
    out = _all_to_all(x.reshape(p, heads // p, n, dim), state.group)          # (src, H/P, n, D)
    return out.permute(1, 0, 2, 3).reshape(1, heads // p, p * n, dim)


def sequence_to_heads(y: torch.Tensor, state: _SPState) -> torch.Tensor:
    """(1, P*n, H/P, D) attention output of my heads -> (1, n, H, D) every head of my tokens."""
    _, total, heads_p, dim = y.shape
    p = state.size
    n = total // p
    out = _all_to_all(y.reshape(p, n, heads_p, dim), state.group)            # (src = head share, n, H/P, D)
    return out.permute(1, 0, 2, 3).reshape(1, n, p * heads_p, dim)


def gather_tokens(values: torch.Tensor, group: Any) -> torch.Tensor:
    """(n, ...) per-token values of my slice -> (P*n, ...) of the whole padded row, in rank order;
    the backward gives each rank the summed gradient of its slice."""
    return torch.cat(dist_fn.all_gather(values.contiguous(), group=group), dim=0)
