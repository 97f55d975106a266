"""Sequence-length balancing: partitions, token budgets, and restoring the original order."""

from __future__ import annotations

import random

import pytest
import torch
from tensordict import TensorDict

from verl.utils.seqlen_balancing import (
    get_reverse_idx,
    get_seqlen_balanced_partitions,
    log_seqlen_unbalance,
    rearrange_micro_batches,
    split_micro_batches,
)


def test_partitions_cover_every_row_once_and_balance_tokens():
    rng = random.Random(0)
    seqlens = [rng.randint(1, 500) for _ in range(64)]
    parts = get_seqlen_balanced_partitions(seqlens, k_partitions=8, equal_size=True)
    assert sorted(i for p in parts for i in p) == list(range(64))
    assert all(len(p) == 8 for p in parts)
    sums = [sum(seqlens[i] for i in p) for p in parts]
    naive = [sum(seqlens[i * 8:(i + 1) * 8]) for i in range(8)]
    assert max(sums) - min(sums) < max(naive) - min(naive)
    assert max(sums) - min(sums) <= max(seqlens)
    metrics = log_seqlen_unbalance(seqlens, parts, prefix="global_seqlen")
    assert metrics["global_seqlen/minmax_diff"] == max(sums) - min(sums)


def test_partition_arguments_are_checked():
    with pytest.raises(ValueError, match="divide evenly"):
        get_seqlen_balanced_partitions([1, 2, 3], 2, equal_size=True)
    with pytest.raises(ValueError, match="k_partitions"):
        get_seqlen_balanced_partitions([1, 2], 3, equal_size=False)


def _batch(lengths: list[int], width: int = 16) -> TensorDict:
    mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).long()
    return TensorDict({"attention_mask": mask, "row": torch.arange(len(lengths))}, batch_size=[len(lengths)])


def test_micro_batches_respect_the_token_budget_and_reverse_restores_order():
    lengths = [16, 3, 9, 12, 1, 7, 5, 14]
    micro_batches, indices = rearrange_micro_batches(_batch(lengths), max_token_len=20)
    assert all(int(mb["attention_mask"].sum()) <= 20 for mb in micro_batches)
    assert sorted(i for p in indices for i in p) == list(range(len(lengths)))
    flat = [i for p in indices for i in p]
    rows = torch.cat([mb["row"] for mb in micro_batches])
    assert rows[torch.tensor(get_reverse_idx(flat))].tolist() == list(range(len(lengths)))


def test_a_sequence_longer_than_the_budget_is_refused():
    with pytest.raises(ValueError, match="max_token_len=8"):
        rearrange_micro_batches(_batch([9, 2]), max_token_len=8)


def test_fixed_micro_batches_keep_order():
    micro_batches, indices = split_micro_batches(_batch([1, 2, 3, 4, 5]), 2, False, None)
    assert indices is None
    assert [mb["row"].tolist() for mb in micro_batches] == [[0, 1], [2, 3], [4]]


class _Reduced(Exception):
    pass


def test_ranks_agree_on_micro_batch_count_with_a_tensor_on_their_device(monkeypatch) -> None:
    """Issue 13 item 11, pinned on CPU: an NCCL group refuses CPU tensors, so the count is reduced
    on the rank's device ("meta" stands in for "cuda" here)."""
    from verl.utils import seqlen_balancing

    devices: list[torch.device] = []

    def all_reduce(tensor, *args, **kwargs):
        devices.append(tensor.device)
        raise _Reduced

    monkeypatch.setattr(seqlen_balancing.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(seqlen_balancing.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(seqlen_balancing.dist, "all_reduce", all_reduce)
    with pytest.raises(_Reduced):
        seqlen_balancing._agree_on_max(3, device=torch.device("meta"))
    assert devices == [torch.device("meta")]


def test_rearrange_reduces_on_the_batch_device(monkeypatch) -> None:
    from verl.utils import seqlen_balancing

    seen: list[object] = []
    monkeypatch.setattr(seqlen_balancing, "_agree_on_max",
                        lambda value, device=None: seen.append(device) or value)
    batch = TensorDict({"attention_mask": torch.ones(4, 6, dtype=torch.long)}, batch_size=[4])
    rearrange_micro_batches(batch, max_token_len=12)
    assert seen == [batch["attention_mask"].device]


def _two_rank_worker(rank: int, port: int, lengths: list[list[int]], results) -> None:
    import torch.distributed as dist_

    from verl.utils import seqlen_balancing

    dist_.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        devices: list[str] = []
        real_all_reduce = dist_.all_reduce

        def recording_all_reduce(tensor, *args, **kwargs):
            devices.append(str(tensor.device))
            return real_all_reduce(tensor, *args, **kwargs)

        seqlen_balancing.dist.all_reduce = recording_all_reduce
        batch = _batch(lengths[rank])
        micro_batches, _ = rearrange_micro_batches(batch, max_token_len=16)
        results.put((rank, len(micro_batches), devices, str(batch["attention_mask"].device)))
    finally:
        dist_.destroy_process_group()


def test_ranks_agree_on_the_micro_batch_count_in_a_real_gloo_group() -> None:
    """Two real gloo ranks: rank 0 alone would need 1 micro-batch, rank 1 needs 4; both run 4,
    and every tensor handed to all_reduce lives on the batch's device."""
    import torch.multiprocessing as mp

    from tests.conftest import free_port

    port = free_port()
    lengths = [[2, 3, 4, 5], [16, 16, 16, 16]]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_two_rank_worker, args=(rank, port, lengths, results)) for rank in range(2)]
    for p in procs:
        p.start()
    got = sorted(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert [count for _, count, _, _ in got] == [4, 4]
    for _, _, devices, batch_device in got:
        assert devices == [batch_device]
