"""Balance sequences by token count: across data-parallel ranks and into micro-batches.

Rows of a rollout batch differ a lot in length (a multi-turn trajectory with two
retrieved passages is many times longer than a one-turn answer), so splitting by
row count leaves some ranks / micro-batches with most of the tokens. Here rows are
grouped by their real token count (the sum of the attention mask).

    parts = get_seqlen_balanced_partitions([5, 1, 4, 2], k_partitions=2, equal_size=True)
    micro_batches, indices = rearrange_micro_batches(batch, max_token_len=4096)
    restored = torch.cat(outputs)[get_reverse_idx(sum(indices, []))]
"""

from __future__ import annotations

import heapq
import math
from typing import Any

import torch
import torch.distributed as dist


def get_seqlen_balanced_partitions(seqlen_list: list[int], k_partitions: int, equal_size: bool) -> list[list[int]]:
    """Split row indices into `k_partitions` groups with near-equal token sums.

    Greedy largest-first: each row, longest first, goes to the lightest group (that
    still has room when `equal_size`, which needs len(seqlen_list) % k == 0).
    Every group is non-empty when k <= number of rows; indices in a group are sorted.
    """
    n = len(seqlen_list)
    if k_partitions < 1 or k_partitions > n:
        raise ValueError(f"k_partitions={k_partitions} must lie in [1, {n}] (number of sequences)")
    if equal_size and n % k_partitions != 0:
        raise ValueError(f"equal_size needs the {n} sequences to divide evenly into {k_partitions} partitions")
    capacity = n // k_partitions if equal_size else n
    order = sorted(range(n), key=lambda i: (-seqlen_list[i], i))
    # Heap of (token sum, row count, partition id): the lightest partition pops first.
    heap = [(0, 0, p) for p in range(k_partitions)]
    partitions: list[list[int]] = [[] for _ in range(k_partitions)]
    for idx in order:
        full = []
        load, count, pid = heapq.heappop(heap)
        while count >= capacity:
            full.append((load, count, pid))
            load, count, pid = heapq.heappop(heap)
        partitions[pid].append(idx)
        heapq.heappush(heap, (load + seqlen_list[idx], count + 1, pid))
        for item in full:
            heapq.heappush(heap, item)
    return [sorted(p) for p in partitions]


def log_seqlen_unbalance(seqlen_list: list[int], partitions: list[list[int]], prefix: str) -> dict[str, float]:
    """Token-sum spread of `partitions` (min / max / max-min) as metrics under `prefix`."""
    sums = [sum(seqlen_list[i] for i in part) for part in partitions]
    return {
        f"{prefix}/min": float(min(sums)),
        f"{prefix}/max": float(max(sums)),
        f"{prefix}/minmax_diff": float(max(sums) - min(sums)),
        f"{prefix}/balanced_min": float(min(sums)),
        f"{prefix}/balanced_max": float(max(sums)),
        f"{prefix}/mean": float(sum(sums) / len(sums)),
    }


def _agree_on_max(value: int, device: torch.device | str = "cpu") -> int:
    """The largest `value` over all ranks (FSDP needs every rank to run the same number of passes).

    The tensor lives on `device`, the rank's compute device: an NCCL group reduces CUDA tensors only."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def num_micro_batches_for(seqlen_list: list[int], max_token_len: int) -> int:
    """Smallest k for which the greedy split keeps every micro-batch within `max_token_len` tokens."""
    longest = max(seqlen_list)
    if longest > max_token_len:
        raise ValueError(
            f"a sequence has {longest} tokens, more than the token budget max_token_len={max_token_len} "
            "(raise ppo_max_token_len_per_gpu / log_prob_max_token_len_per_gpu)")
    k = max(1, math.ceil(sum(seqlen_list) / max_token_len))
    while k < len(seqlen_list):
        parts = get_seqlen_balanced_partitions(seqlen_list, k, equal_size=False)
        if max(sum(seqlen_list[i] for i in p) for p in parts) <= max_token_len:
            break
        k += 1
    return k


def rearrange_micro_batches(batch: Any, max_token_len: int, sync_across_ranks: bool = True) -> tuple[list, list[list[int]]]:
    """Group the rows of `batch` into micro-batches of at most `max_token_len` real tokens.

    `batch` is a TensorDict (or anything indexable by a row-index tensor) holding
    `attention_mask`. Returns (micro_batches, indices): micro_batches[j] holds rows
    indices[j] of `batch`. With `sync_across_ranks`, every rank uses the same number
    of micro-batches (the largest any rank needs), so FSDP's collectives line up.
    """
    seqlen_list = batch["attention_mask"].sum(dim=-1).tolist()
    k = num_micro_batches_for(seqlen_list, max_token_len)
    if sync_across_ranks:
        k = min(_agree_on_max(k, device=batch["attention_mask"].device), len(seqlen_list))
    partitions = get_seqlen_balanced_partitions(seqlen_list, k, equal_size=False)
    micro_batches = [batch[torch.tensor(part, dtype=torch.long)] for part in partitions]
    return micro_batches, partitions


def get_reverse_idx(idx_map: list[int]) -> list[int]:
    """Inverse permutation: out[idx_map[i]] = i, so cat(outputs)[out] is in the original row order."""
    reverse = [0] * len(idx_map)
    for position, original in enumerate(idx_map):
        reverse[original] = position
    return reverse


def split_micro_batches(batch: Any, micro_batch_size: int | None, use_dynamic_bsz: bool,
                        max_token_len: int | None) -> tuple[list, list[list[int]] | None]:
    """Fixed-size micro-batches, or token-budget ones (with the row indices to undo the reorder)."""
    if use_dynamic_bsz:
        if not max_token_len or max_token_len <= 0:
            raise ValueError(f"use_dynamic_bsz needs a positive max_token_len, got {max_token_len!r}")
        return rearrange_micro_batches(batch, max_token_len)
    if not micro_batch_size or micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size must be a positive integer, got {micro_batch_size!r}")
    return list(batch.split(micro_batch_size)), None
