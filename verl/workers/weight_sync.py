"""Weights from the train pool to the rollout pool, over a collective group of their own.

With `trainer.pipeline` other than `sync` the policy lives twice: sharded over the train pool's
FSDP world (which updates it) and sharded over the rollout pool's (which samples from it). After an
update, the train pool's rank 0 gathers each full tensor and broadcasts it to every rollout rank
in a process group that holds just those processes (gloo on CPU, NCCL on GPU): no files, no
driver in the path. Every rollout rank keeps its own shard of each tensor.

    sender (train rank 0) ── broadcast ──> receivers (rollout ranks 0..R-1 = group ranks 1..R)

The group is built from a TCP store on the sender's host, apart from each pool's default group:

    group = WeightSyncGroup(host, port, rank=0, size=1 + R, device="cpu")
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from verl.utils.fsdp_utils import full_tensor

JOIN_TIMEOUT = timedelta(seconds=600)
# A push's receivers start their broadcasts at once; the sender's may queue behind a train-pool call
# already running (an update, a checkpoint of a large model to slow storage): wait that long for it.
COLLECTIVE_TIMEOUT = timedelta(hours=2)


def endpoint() -> tuple[str, int]:
    """(this host's address, a TCP port free a moment ago) for the group's store."""
    import ray

    from verl.single_controller.base.worker import get_free_port

    return ray.util.get_node_ip_address(), get_free_port()


class WeightSyncGroup:
    """A process group of the sender (rank 0) and the rollout ranks; broadcast from rank 0 only."""

    def __init__(self, host: str, port: int, rank: int, size: int, device: str) -> None:
        self.rank, self.size, self.device = rank, size, device
        store = dist.TCPStore(host, port, world_size=size, is_master=rank == 0, timeout=JOIN_TIMEOUT,
                              wait_for_workers=True)
        store = dist.PrefixStore("search_r1_weight_sync", store)
        if device == "cuda":
            self.group: Any = dist.ProcessGroupNCCL(store, rank, size, COLLECTIVE_TIMEOUT)
        else:
            self.group = dist.ProcessGroupGloo(store, rank, size, COLLECTIVE_TIMEOUT)
        self._store = store   # kept alive with the group

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's `tensor` into every rank's (same shape and dtype, on this group's device)."""
        self.group.broadcast(tensor, 0).wait()


def send_state(group: WeightSyncGroup | None, state: Iterable[tuple[str, torch.Tensor]], device: str) -> int:
    """Gather each tensor of `state` (every rank of the train pool calls this, in the same order)
    and broadcast it from the group's rank 0 (the train pool's rank 0; `group` is None on the
    pool's other ranks). Returns the bytes sent (0 on the other ranks)."""
    sent = 0
    for _, tensor in state:
        full = full_tensor(tensor)
        if group is not None:
            buffer = full.to(device).contiguous()
            group.broadcast(buffer)
            sent += buffer.numel() * buffer.element_size()
    return sent


@torch.no_grad()
def receive_state(group: WeightSyncGroup, module: nn.Module, device: str) -> int:
    """Receive every state-dict tensor of `module` (in its state_dict order, the sender's too: the
    same model built the same way) and write this rank's shard of each in place. Returns bytes."""
    from torch.distributed.tensor import DTensor

    received = 0
    for tensor in module.state_dict().values():
        buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
        group.broadcast(buffer)
        received += buffer.numel() * buffer.element_size()
        if isinstance(tensor, DTensor):
            tensor.to_local().copy_(_local_shard(buffer, tensor))
        else:
            tensor.copy_(buffer.to(tensor.device))
    return received


def _local_shard(full: torch.Tensor, like: Any) -> torch.Tensor:
    """This rank's piece of `full` as the DTensor `like` holds it: FSDP2's Shard(0) over a 1-D mesh is
    torch.chunk's piece (empty past the last chunk); any other layout through distribute_tensor."""
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh, placements = like.device_mesh, like.placements
    if mesh.ndim == 1 and len(placements) == 1 and isinstance(placements[0], Shard) and placements[0].dim == 0:
        chunks = full.chunk(mesh.size(), dim=0)
        rank = mesh.get_local_rank()
        return chunks[rank] if rank < len(chunks) else full[:0]
    return distribute_tensor(full.to(like.device), mesh, placements).to_local()
