"""Count the host (CPU) tensor bytes a piece of code holds at once: deterministic, unlike RSS.

    with LiveCpuTensorBytes() as count:
        model = load(...)
    count.peak    # the most bytes of CPU tensor storage alive at one moment inside the block

Every aten op run inside the block is seen (a TorchDispatchMode). An op's output whose storage
is none of its inputs' storages is a new allocation: its storage's bytes are added, and
subtracted when that storage is freed (a weakref finalizer on the storage, which torch keeps
alive exactly as long as the C++ storage). Views, in-place ops and storages made outside
dispatch (a safetensors tensor mapped from its file: page cache, not an allocation) add nothing.
Storages allocated before the block are not counted, nor are their frees. Only the ops of the
thread that entered the block are seen (dispatch modes are per thread): run code that loads in a
thread pool single-threaded (Hugging Face: HF_DEACTIVATE_ASYNC_LOAD=1) to count it.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _cpu_storages(values: Any) -> list[torch.Tensor]:
    """The plain CPU tensors in `values`, a DTensor standing for its local shard: a wrapper has no
    storage of its own, and the ops a DTensor runs on its shard are not dispatched to this mode."""
    out = []
    for value in tree_leaves(values):
        if isinstance(value, DTensor):
            value = value._local_tensor
        if isinstance(value, torch.Tensor) and type(value) in (torch.Tensor, torch.nn.Parameter) \
                and value.device.type == "cpu":
            out.append(value)
    return out


class LiveCpuTensorBytes(TorchDispatchMode):
    """`live`: CPU tensor bytes allocated inside the block and not yet freed; `peak`: its maximum."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.allocations = 0
        self._tracked: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in _cpu_storages((args, kwargs))}
        for tensor in _cpu_storages(out):
            self._track(tensor, inputs)
        return out

    def _track(self, tensor: torch.Tensor, inputs: set[int]) -> None:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in inputs or key in self._tracked:
            return
        nbytes = storage.nbytes()
        self._tracked.add(key)
        self.allocations += 1
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, nbytes)

    def _free(self, key: int, nbytes: int) -> None:
        self._tracked.discard(key)
        self.live -= nbytes
