"""Ulysses sequence-parallel (SP) groups in the FSDP workers (issue 35 item 2, the workers' part).

`ulysses_sequence_parallel_size` = P splits the world's W ranks into W/P groups of P consecutive
ranks (ranks 0..P-1, P..2P-1, ..., as veRL's (dp, sp) device mesh). FSDP2 still shards over all W
ranks (veRL does too): every rank of a group computes the same loss, so the gradients summed over
the group are P times the unsplit ones and FSDP's mean over W ranks gives the data-parallel mean
(verl/utils/ulysses.py). The data-parallel size is W/P: the workers divide the batch sizes by it.

The driver's dispatch is unchanged (DP_COMPUTE_PROTO hands each rank 1/W of the rows). At the start
of a pass every rank gathers its group's rows (`SPGroups.gather`: the group's consecutive chunks,
i.e. one data-parallel shard, the same on every rank of the group), runs the pass with Ulysses, and
hands back only its own chunk of the per-row output (`SPGroups.split`), so the driver's collect is
unchanged too.

    sp = SPGroups.build(rank, world_size, size)      # collective: every rank, in the same order
    data = sp.gather(data)                            # before data.to(device)
    out = sp.split(DataProto.from_dict(tensors={...}))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from omegaconf import open_dict

from verl.utils import ulysses

if TYPE_CHECKING:   # verl.protocol imports tensordict (and with it torch._dynamo): preflight's config checks read
    from verl.protocol import DataProto  # this module's settings without it

SP_KEY = "ulysses_sequence_parallel_size"


def sp_size(node: Any, where: str) -> int:
    """`node.ulysses_sequence_parallel_size` (default 1) as an int >= 1."""
    value = node.get(SP_KEY, 1)
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}.{SP_KEY}={value!r} must be an int >= 1")
    return int(value)


def check_sequence_parallel(size: int, world_size: int, use_remove_padding: bool, where: str,
                            model_config: Any = None) -> None:
    """SP > 1 needs packing (it splits packed rows), a size that divides the world, and head counts it
    divides (`model_config`: an HF config, checked when given)."""
    if size == 1:
        return
    if not use_remove_padding:
        raise ValueError(f"{where}.{SP_KEY}={size} splits packed rows: set the model's use_remove_padding=true "
                         f"(packing), or {where}.{SP_KEY}=1")
    if world_size % size != 0:
        raise ValueError(f"{where}.{SP_KEY}={size} must divide the {world_size} workers "
                         f"(trainer.nnodes x trainer.n_gpus_per_node)")
    if model_config is not None:
        heads = int(model_config.num_attention_heads)
        kv_heads = int(getattr(model_config, "num_key_value_heads", None) or heads)
        ulysses.check_heads(heads, kv_heads, size, key=f"{where}.{SP_KEY}")


def scale_token_budgets(node: Any, keys: tuple[str, ...], size: int) -> None:
    """veRL's meaning of `*_max_token_len_per_gpu` under SP: the tokens each rank holds, so a dynamic
    micro-batch (gathered over the group, then split) packs up to size x that many (in place)."""
    if size == 1:
        return
    with open_dict(node):
        for key in keys:
            if node.get(key) is not None:
                node[key] = int(node[key]) * size


@dataclass
class SPGroups:
    """This rank's SP group (`group`: the device backend, for the model's all-to-alls) and a gloo twin
    (`data_group`: the rows are gathered on the host, before they move to the device)."""

    size: int
    rank: int             # within the group
    group: Any = None
    data_group: Any = None
    _lengths: tuple[int, ...] = ()   # the rows each rank of the group brought to the last gather

    @classmethod
    def build(cls, rank: int, world_size: int, size: int) -> SPGroups:
        """Create every group (dist.new_group is collective: every rank creates all, in the same order)."""
        if size == 1:
            return cls(1, 0)
        mine = rank // size
        group = data_group = None
        for first in range(0, world_size, size):
            ranks = list(range(first, first + size))
            device_group = dist.new_group(ranks)
            gloo_group = dist.new_group(ranks, backend="gloo")
            if first // size == mine:
                group, data_group = device_group, gloo_group
        return cls(size, rank % size, group, data_group)

    @property
    def sp_group(self) -> Any:
        """What DataParallelPPOActor / DataParallelPPOCritic take: None without SP."""
        return self.group if self.size > 1 else None

    def gather(self, data: DataProto) -> DataProto:
        """The group's rows in rank order (every rank of the group gets the same batch); meta_info kept."""
        if self.size == 1:
            return data
        parts: list[Any] = [None] * self.size
        dist.all_gather_object(parts, data, group=self.data_group)
        self._lengths = tuple(len(part) for part in parts)
        gathered = type(data).concat(parts)
        gathered.meta_info = dict(data.meta_info)
        return gathered

    def split(self, output: DataProto) -> DataProto:
        """This rank's chunk of a per-row output computed on the gathered rows."""
        if self.size == 1:
            return output
        if len(output) != sum(self._lengths):
            raise RuntimeError(f"SP split: {len(output)} output rows, but the last gather brought {self._lengths}")
        start = sum(self._lengths[:self.rank])
        return output.slice(start, start + self._lengths[self.rank])
