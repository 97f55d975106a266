"""Weights from the train pool to the rollout pool, over a collective group of their own.

With `trainer.pipeline` other than `sync` the policy lives on both pools: sharded over the train
pool's FSDP world in fp32 (the master weights the optimizer updates), and on every rollout rank only
inside its rollout engine, in the dtype the engine computes in (`PushManifest.dtype`: bf16 on a GPU,
fp32 for CPU engines). After an update every train rank casts its shard of a tensor to the engine's
dtype and takes part in gathering the full tensor (FSDP's all-gather), and the train pool's rank 0
broadcasts it in a process group of just itself and the rollout ranks (gloo on CPU, NCCL on GPU): no
files, no driver in the path. Each rollout rank feeds the tensor straight into its engine's weight load: no copy of
the model is staged, no FSDP module exists there.

    sender (train rank 0) ── broadcast ──> receivers (rollout ranks 0..R-1 = group ranks 1..R)

What moves is fixed once, when the group is joined: the sender's module lists its tensors
(`push_state`, state-dict order, a tied tensor once, checkpoint names) in a `PushManifest`, which
the driver hands to every member with the engine's dtype. The group is built from a TCP store on
the sender's host, apart from each pool's default group:

    group = WeightSyncGroup(host, port, rank=0, size=1 + R, device="cpu")
    manifest = push_manifest(actor_module, dtype=torch.bfloat16)
    sent = send_state(group, push_state(actor_module), manifest, "cuda")     # the sender (every train rank calls it)
    stream = ReceivedTensors(group, manifest, "cuda"); engine.load(stream); stream.finish()   # a receiver

A colocated engine (the rollout in the actor's own workers) takes the same tensors the same way,
without the broadcast: `local_push(push_state(actor_module), manifest)` is the stream its weight
load reads (verl/workers/rollout_role.py), in the engine's dtype, a tied tensor gathered once.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
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
# Components torch inserts into parameter names (activation checkpointing, torch.compile, FSDP1):
# not in the model's Hugging Face checkpoint, whose names every engine's loader expects.
_WRAPPER_COMPONENTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def checkpoint_name(name: str) -> str:
    """A module's parameter name as the model's Hugging Face checkpoint spells it."""
    for wrapper in _WRAPPER_COMPONENTS:
        name = name.replace(wrapper, "")
    return name


@dataclass(frozen=True)
class TensorSpec:
    """One pushed tensor: its checkpoint name, full (unsharded) shape, and the other names the same
    tensor has in the module (a tied lm_head is the embedding): sent once, loaded under each name."""

    name: str
    shape: tuple[int, ...]
    aliases: tuple[str, ...] = ()

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count


@dataclass(frozen=True)
class PushManifest:
    """Every tensor a push sends, in the order sent, and the dtype they travel (and land) in.
    `mode`: what the tensors are (verl/workers/lora_push.py): `full` the actor's weights, `adapter`
    a LoRA actor's adapter only (PEFT's names), `merged` a LoRA actor's merged weights."""

    tensors: tuple[TensorSpec, ...]
    dtype: torch.dtype
    mode: str = "full"

    @property
    def numel(self) -> int:
        return sum(spec.numel for spec in self.tensors)

    @property
    def nbytes(self) -> int:
        """Bytes one push broadcasts: every element once, in `dtype`."""
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    @property
    def load_names(self) -> list[str]:
        """The names an engine's weight load takes, in order: each tensor's, then its aliases."""
        return [name for spec in self.tensors for name in (spec.name, *spec.aliases)]

    def with_dtype(self, dtype: torch.dtype) -> PushManifest:
        return PushManifest(self.tensors, dtype, self.mode)


def _distinct_state(module: nn.Module) -> list[tuple[str, torch.Tensor, list[str]]]:
    """(name, tensor, other names of the same tensor) per distinct state-dict tensor, in state-dict order."""
    first: dict[int, tuple[str, torch.Tensor, list[str]]] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in first:
            first[id(tensor)][2].append(checkpoint_name(name))
        else:
            first[id(tensor)] = (checkpoint_name(name), tensor, [])
    return list(first.values())


def push_state(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of what a push sends: the module's state-dict entries (FSDP2: DTensor shards),
    in state-dict order, each tensor once (a tied lm_head is the embedding: sent once, as the
    embedding; the manifest names it as an alias, which the receiver loads from the same buffer)."""
    return [(name, tensor) for name, tensor, _ in _distinct_state(module)]


def push_manifest(module: nn.Module, dtype: torch.dtype) -> PushManifest:
    """The manifest of `push_state(module)` (full shapes: a DTensor's shape is the global one; no
    collective) travelling in `dtype`."""
    return PushManifest(tuple(TensorSpec(name, tuple(tensor.shape), tuple(aliases))
                              for name, tensor, aliases in _distinct_state(module)), dtype)


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


def gathered_state(state: Iterable[tuple[str, torch.Tensor]], manifest: PushManifest
                   ) -> Iterator[tuple[TensorSpec, torch.Tensor]]:
    """(spec, full tensor) per manifest entry: each tensor of `state` cast to the manifest's dtype and
    gathered whole (every rank of the train pool iterates it in the same order: the gather is a
    collective). The cast is the shard's, before the gather (the same values as casting the gathered
    tensor: rounding is per element), so the gather moves and holds the push's dtype: one full tensor
    in it at a time, plus this rank's cast shard. A tensor tied to others (a tied lm_head is the
    embedding) is in `state` once, so it is gathered once. Raises when `state` is not the manifest's."""
    for (name, tensor), spec in zip(state, manifest.tensors, strict=True):
        full = full_tensor(tensor.to(manifest.dtype))
        if name != spec.name or tuple(full.shape) != spec.shape:
            raise RuntimeError(f"weight push: the actor's tensor {name} {tuple(full.shape)} is not the manifest's "
                               f"{spec.name} {spec.shape} (the module changed since the manifest was made)")
        yield spec, full


@torch.no_grad()
def send_state(group: WeightSyncGroup | None, state: Iterable[tuple[str, torch.Tensor]], manifest: PushManifest,
               device: str) -> int:
    """`gathered_state` (every rank of the train pool calls this, in the same order), each full tensor
    broadcast by the group's rank 0 (the train pool's rank 0; `group` is None on the pool's other
    ranks). Returns the bytes sent (0 on the other ranks)."""
    sent = 0
    for _, full in gathered_state(state, manifest):
        if group is None:
            continue
        buffer = full.to(device).contiguous()
        group.broadcast(buffer)
        sent += buffer.numel() * buffer.element_size()
    return sent


@torch.no_grad()
def local_push(state: Iterable[tuple[str, torch.Tensor]], manifest: PushManifest) -> Iterator[tuple[str, torch.Tensor]]:
    """A colocated engine's weight load (the rollout in the actor's own workers, no group): the push's
    tensors as the (name, tensor) stream the engine's loader takes, straight from `gathered_state`
    (cast per shard, gathered once each); a tensor with aliases is handed out again under each, the
    same tensor (vLLM reloads a tied lm_head as a layer of its own), as `ReceivedTensors` does on a
    rollout pool. Every rank iterates it whole (the gathers are collectives)."""
    for spec, full in gathered_state(state, manifest):
        for name in (spec.name, *spec.aliases):
            yield name, full


class ReceivedTensors:
    """A receiver's side of one push, as the (name, tensor) stream an engine's weight loader takes.

    Each tensor is broadcast into a buffer of its own when the consumer asks for it (the loader may
    keep several until their fused layer is complete, as vLLM's does; never the whole model). After
    the load, `finish()` receives whatever the consumer left (the sender must not wait forever) and
    raises if anything was left. A tensor with aliases is handed out again under each (vLLM reloads
    a tied lm_head as a layer of its own: it must be given it). `names` is the order of the names
    handed out."""

    def __init__(self, group: WeightSyncGroup, manifest: PushManifest, device: str) -> None:
        self.group, self.manifest, self.device = group, manifest, device
        self.names: list[str] = []
        self.nbytes = 0
        self._next = 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        while self._next < len(self.manifest.tensors):
            spec = self.manifest.tensors[self._next]
            buffer = self._receive(spec)
            for name in (spec.name, *spec.aliases):
                self.names.append(name)
                yield name, buffer

    def _receive(self, spec: TensorSpec) -> torch.Tensor:
        buffer = torch.empty(spec.shape, dtype=self.manifest.dtype, device=self.device)
        self.group.broadcast(buffer)
        self._next += 1
        self.nbytes += buffer.numel() * buffer.element_size()
        return buffer

    def finish(self) -> int:
        """The bytes received; raises (after draining the rest) if the consumer stopped early."""
        for spec in self.manifest.tensors[self._next:]:
            self._receive(spec)
        expected = self.manifest.load_names
        if self.names != expected:
            raise RuntimeError(f"the rollout engine's weight load took {len(self.names)} of the push's {len(expected)} "
                               f"tensors; not loaded: {expected[len(self.names):][:5]}")
        return self.nbytes


def check_module_takes(manifest: PushManifest, module: nn.Module, device: str) -> None:
    """A plain module can receive pushes in place: every manifest tensor names one of its parameters
    or buffers, same shape, in the manifest's dtype on `device`, contiguous, and every parameter is
    covered (a tied one through its twin). Raises naming the first mismatch."""
    targets = module.state_dict(keep_vars=True)
    covered: set[int] = set()
    for spec in manifest.tensors:
        target = targets.get(spec.name)
        if target is None:
            raise ValueError(f"weight push: the rollout engine's module has no tensor {spec.name!r} "
                             "(the train pool and the rollout pool built different models)")
        if (tuple(target.shape) != spec.shape or target.dtype != manifest.dtype
                or target.device.type != torch.device(device).type or not target.is_contiguous()):
            raise ValueError(f"weight push: {spec.name} arrives as {spec.shape} {manifest.dtype} on {device}; the "
                             f"rollout module holds {tuple(target.shape)} {target.dtype} on {target.device}")
        covered.add(id(target))
        for alias in spec.aliases:
            if targets.get(alias, target) is not target:
                raise ValueError(f"weight push: {alias} is {spec.name} in the actor (tied) but a tensor of its own "
                                 "in the rollout module")
    missed = [name for name, p in module.named_parameters() if id(p) not in covered]
    if missed:
        raise ValueError(f"weight push: the rollout module's parameters {missed[:5]} are not pushed")


@torch.no_grad()
def receive_into_module(group: WeightSyncGroup, manifest: PushManifest, module: nn.Module) -> list[str]:
    """One push broadcast straight into `module`'s parameters (in place: no buffer; the module was
    checked with `check_module_takes`). Returns the names written, in order."""
    targets = module.state_dict(keep_vars=True)
    for spec in manifest.tensors:
        group.broadcast(targets[spec.name].data)
    return [spec.name for spec in manifest.tensors]
