"""Build an FSDP2-sharded model from a Hugging Face folder without any rank holding it whole.

    module, report = load_sharded_model(lambda: build_causal_lm(path), path, mesh, "cuda",
                                        prepare=freeze_or_checkpoint, mixed_precision=gpu_mixed_precision())

1. Rank 0 of `mesh` opens the checkpoint (`verl/utils/checkpoint/hf_weights.py`: safetensors
   index + shards, or `.bin` files) and broadcasts its manifest: each tensor's name, dtype, shape.
2. Every rank builds the model with its parameters on the meta device (no storage; buffers such as
   the rotary `inv_freq` are computed for real on the CPU: they are small and not in the state
   dict), runs `prepare` (gradient checkpointing, freezing), applies FSDP2 (`fully_shard` per
   decoder layer, then the root) and materialises only its own shard (`to_empty(device)`).
3. One tensor at a time, in the model's parameter order (the same on every rank): rank 0 reads it
   in its stored dtype and broadcasts it (as bytes, so any dtype travels on gloo and NCCL alike);
   every rank copies its slice into its fp32 shard. Weights the checkpoint lacks (the critic's
   value head over a causal-LM checkpoint) are initialised the way `from_pretrained` would, on a
   CPU copy of the owning module seeded with `seed` (identical on every rank), and sliced the same
   way. A missing backbone weight is an error: it would train from noise.

Host-memory contract (verl/utils/memory_plan.py plans from it). Beyond its own shard (fp32, on
`device`: host memory only when `device` is the CPU):
- rank 0 holds one stored tensor at a time, read from the file's mapped pages (clean page cache,
  released with the tensor), plus its broadcast copy on `device` (none on the CPU, where the
  mapped tensor itself is sent);
- every other rank holds one full tensor at a time in the stored dtype, the broadcast buffer, on
  `device` (the process group's device: the GPU under NCCL, so no host memory at all);
- freshly initialised weights are made one owning module at a time, in fp32 on the CPU (the value
  head: hidden_size floats); the buffers the model computes at construction stay on the CPU
  until they are copied to `device`.
So no rank ever holds the whole model; at most one full tensor in fp32 (the largest, usually the
embedding: vocab x hidden x 4 bytes) beyond its shard, on rank 0 and every other rank alike.

Names (verl/utils/checkpoint/name_map.py, the one place they differ by architecture): a parameter is
read under its own name, or the name its checkpoint stores it under (Mixtral's `block_sparse_moe`).
A fused expert parameter of transformers 5's MoE models ((E, 2I, H) gate_up_proj, (E, H, I)
down_proj) is read as its pieces, the checkpoint's per-expert tensors, each one broadcast alone as
any other tensor is; a rank copies a piece only when its expert is in the rank's FSDP2 shard (dim 0
is the expert dimension), into that expert's rows. So the largest broadcast of an MoE checkpoint is
still one stored tensor, never a layer's fused experts.
Parameter construction on the meta device allocates each parameter's CPU storage for an
instant, never written, so never resident (the same trick as accelerate's init_empty_weights).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Shard

from verl.utils.checkpoint.hf_weights import HFWeights, TensorMeta
from verl.utils.checkpoint.name_map import NameMap, Piece
from verl.utils.fsdp_utils import apply_fsdp2

logger = logging.getLogger(__name__)


@dataclass
class LoadReport:
    """What one rank's load did: checkpoint tensors received in order, fresh weights, bytes moved."""

    loaded: list[str] = field(default_factory=list)     # checkpoint names, in broadcast order
    fresh: list[str] = field(default_factory=list)      # model names initialised here (not in the checkpoint)
    broadcast_bytes: int = 0                            # stored bytes received (or sent, on rank 0)
    largest_broadcast_bytes: int = 0
    broadcast_devices: set[str] = field(default_factory=set)


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (no storage) and their buffers
    for real: buffers are not all in the state dict (rotary `inv_freq`), so they must be computed
    by the constructor, while parameters come from the checkpoint or a fresh init later."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            attributes = dict(param.__dict__)
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
            param.__dict__.update(attributes)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta   # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register      # type: ignore[method-assign]


def load_sharded_model(build: Callable[[], nn.Module], path: str, mesh: Any, device: str | torch.device,
                       prepare: Callable[[nn.Module], None] | None = None,
                       mixed_precision: MixedPrecisionPolicy | None = None,
                       seed: int = 0, adapter: Any = None) -> tuple[nn.Module, LoadReport]:
    """`build()` sharded with FSDP2 over `mesh` on `device`, its weights read from `path` by the
    mesh's rank 0 alone and broadcast tensor by tensor (module docstring). Every rank of `mesh`
    must call this, with the same `build`.

    `prepare` runs on the meta-device model before the names are matched: it may add parameters
    (LoRA's adapters, verl/utils/lora.py). `adapter` (a LoraSpec, or None) then maps the wrapped
    base weights to their checkpoint names and initialises the adapter's parameters."""
    group = mesh.get_group()
    src = dist.get_global_rank(group, 0)
    weights = HFWeights.open(path) if dist.get_rank() == src else None
    manifest = _broadcast_manifest(weights, group, src)
    with parameters_on_meta():
        module = build()
    buffers = {name: buf.detach().clone() for name, buf in module.named_buffers(remove_duplicate=False)}
    if prepare is not None:
        prepare(module)
    entries = _state_entries(module)
    prefix = str(getattr(module, "base_model_prefix", "") or "")
    rename = _adapter_checkpoint_name if adapter is not None else (lambda name: name)
    names_map = NameMap.of(getattr(module, "config", None))
    sources = {entry.names[0]: _checkpoint_source([rename(n) for n in entry.names], tuple(entry.tensor.shape),
                                                  manifest, prefix, names_map)
               for entry in entries}
    _check_missing([e for e in entries if adapter is None or not _is_adapter(e.names[0])], sources, prefix, path)
    fresh = _FreshWeights(module, [name for name, ckpt in sources.items()
                                   if ckpt is None and _is_parameter(module, name)],
                          init=adapter.init_adapter if adapter is not None else None)
    apply_fsdp2(module, mesh, mixed_precision)
    module.to_empty(device=device)
    with torch.no_grad():
        for name, buf in module.named_buffers(remove_duplicate=False):
            buf.copy_(buffers.pop(name))
    report = LoadReport()
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)   # fresh weights: from_pretrained's draws after manual_seed(seed)
        for entry in _state_entries(module):
            target = entry.tensor
            ckpt_name = sources[entry.names[0]]
            if isinstance(ckpt_name, list):   # a fused expert parameter, piece by piece
                for piece in ckpt_name:
                    full = _receive(weights, piece.name, manifest[piece.name], torch.device(device), group, src,
                                    report)
                    report.loaded.append(piece.name)
                    _copy_piece_into(target, full, piece, entry.names[0])
                    del full
                continue
            if ckpt_name is not None:
                full = _receive(weights, ckpt_name, manifest[ckpt_name], torch.device(device), group, src, report)
                report.loaded.append(ckpt_name)
            elif entry.names[0] in fresh:
                full = fresh.value(entry.names[0])
                report.fresh.append(entry.names[0])
            else:
                continue   # a persistent buffer the checkpoint lacks keeps its constructed value
            _copy_into(target, full, entry.names[0])
            del full
    logger.info("%s: %d tensors (%.2f GiB as stored) received from rank %d; initialised fresh: %s", path,
                len(report.loaded), report.broadcast_bytes / 2**30, src, report.fresh or "none")
    return module, report


def _adapter_checkpoint_name(name: str) -> str:
    from verl.utils.lora import checkpoint_name

    return checkpoint_name(name)


def _is_adapter(name: str) -> bool:
    from verl.utils.lora import is_adapter_param

    return is_adapter_param(name)


# --------------------------------------------------------------------------- the state, entry by entry

@dataclass
class _Entry:
    names: list[str]          # every name of one tensor (a tied weight has several), model order
    tensor: torch.Tensor


def _state_entries(module: nn.Module) -> list[_Entry]:
    """Each parameter once (with all its names: tied embeddings), then each persistent buffer."""
    by_id: dict[int, _Entry] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        entry = by_id.setdefault(id(param), _Entry([], param))
        entry.names.append(name)
    entries = list(by_id.values())
    for name, buf in module.named_buffers(remove_duplicate=False):
        owner_name, _, local = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        if local not in owner._non_persistent_buffers_set:
            entries.append(_Entry([name], buf))
    return entries


def _is_parameter(module: nn.Module, name: str) -> bool:
    owner_name, _, local = name.rpartition(".")
    return local in module.get_submodule(owner_name)._parameters


def _checkpoint_name(names: list[str], manifest: dict[str, TensorMeta], prefix: str) -> str | None:
    """The checkpoint's name for a tensor known by `names`: one of them, or one with the base-model
    prefix added or removed (a checkpoint saved from the bare backbone, or for a model with a head)."""
    for name in names:
        if name in manifest:
            return name
    if prefix:
        for name in names:
            stripped = name.removeprefix(prefix + ".")
            for candidate in (stripped, f"{prefix}.{name}"):
                if candidate != name and candidate in manifest:
                    return candidate
    return None


def _checkpoint_source(names: list[str], shape: tuple[int, ...], manifest: dict[str, TensorMeta], prefix: str,
                       names_map: NameMap) -> str | list[Piece] | None:
    """Where a model tensor known by `names` (of `shape`) is in the checkpoint: one stored tensor
    (under a name of its own or the one `names_map` says the checkpoint uses), the per-expert pieces
    of a fused expert parameter, or None (not there)."""
    found = _checkpoint_name([c for name in names for c in names_map.candidates(name)], manifest, prefix)
    if found is not None:
        return found
    for name in names:
        for candidate in [name] + ([name.removeprefix(prefix + "."), f"{prefix}.{name}"] if prefix else []):
            pieces = names_map.pieces(candidate, shape, manifest)
            if pieces is not None:
                return pieces
    return None


def _check_missing(entries: list[_Entry], sources: dict[str, str | None], prefix: str, path: str) -> None:
    """A missing head (outside the backbone `prefix`) is initialised fresh, as from_pretrained does;
    a missing backbone parameter means the checkpoint does not fit the architecture."""
    missing_backbone, missing_heads = [], []
    for entry in entries:
        name = entry.names[0]
        if sources[name] is not None or not isinstance(entry.tensor, nn.Parameter):
            continue
        (missing_backbone if prefix and name.startswith(prefix + ".") else missing_heads).append(name)
    if missing_backbone:
        raise ValueError(f"{path}: the checkpoint has no weight for {len(missing_backbone)} parameter(s) of the "
                         f"model's backbone, e.g. {missing_backbone[:3]}: the folder's weights do not match its "
                         "config.json (or the architecture renames its checkpoint keys in a way the loader's "
                         "name map, verl/utils/checkpoint/name_map.py, does not list)")
    if missing_heads:
        logger.info("%s: %s not in the checkpoint; initialised fresh (seeded, identical on every rank)",
                    path, missing_heads)


# --------------------------------------------------------------------------- moving one tensor

def _broadcast_manifest(weights: HFWeights | None, group: Any, src: int) -> dict[str, TensorMeta]:
    """Rank `src`'s manifest on every rank; an error reading it is raised on every rank (not only
    on `src`, which would leave the others waiting in the next broadcast)."""
    payload: list[Any] = [None]
    if weights is not None:
        try:
            payload = [weights.manifest()]
        except Exception as err:  # noqa: BLE001 - re-raised on every rank below
            payload = [f"{type(err).__name__}: {err}"]
    dist.broadcast_object_list(payload, src=src, group=group)
    if isinstance(payload[0], str):
        raise RuntimeError(f"rank {src} could not read the checkpoint: {payload[0]}")
    return payload[0]


def _receive(weights: HFWeights | None, name: str, meta: TensorMeta, device: torch.device, group: Any, src: int,
             report: LoadReport) -> torch.Tensor:
    """Checkpoint tensor `name` on every rank, in its stored dtype, on `device`."""
    if weights is not None:
        stored = weights.read(name)
        if stored.dtype != meta.dtype or tuple(stored.shape) != meta.shape:
            raise RuntimeError(f"{weights.folder}: {name} changed while loading ({stored.dtype} "
                               f"{tuple(stored.shape)}, manifest {meta})")
        # Bytes, not the dtype: gloo has no fp8, and a byte copy is exact for every dtype.
        buffer = stored.contiguous().reshape(-1).view(torch.uint8).to(device)
    else:
        buffer = torch.empty(meta.nbytes, dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src=src, group=group)
    report.broadcast_bytes += buffer.numel()
    report.largest_broadcast_bytes = max(report.largest_broadcast_bytes, buffer.numel())
    report.broadcast_devices.add(str(buffer.device))
    return buffer.view(meta.dtype).reshape(meta.shape)


def _copy_into(target: torch.Tensor, full: torch.Tensor, name: str) -> None:
    """This rank's part of `full` into `target` (an FSDP2 shard: dim-0 chunks, torch.chunk's split;
    or a whole buffer), cast to the target's dtype."""
    if not isinstance(target, DTensor):
        if tuple(target.shape) != tuple(full.shape):
            raise ValueError(f"{name}: the checkpoint's shape {tuple(full.shape)} != the model's {tuple(target.shape)}")
        target.copy_(full)
        return
    if tuple(target.shape) != tuple(full.shape):
        raise ValueError(f"{name}: the checkpoint's shape {tuple(full.shape)} != the model's {tuple(target.shape)} "
                         "(an override_config that changes shapes?)")
    placements = target.placements
    if len(placements) != 1 or not isinstance(placements[0], Shard):
        raise NotImplementedError(f"{name}: sharded as {placements}; only FSDP2's one-dimensional Shard(dim)")
    dim = placements[0].dim
    mesh = target.device_mesh
    chunks = torch.chunk(full, mesh.size(), dim=dim)
    rank = mesh.get_local_rank()
    piece = chunks[rank] if rank < len(chunks) else full.narrow(dim, 0, 0)
    local = target.to_local()
    if piece.shape != local.shape:
        raise RuntimeError(f"{name}: this rank's slice {tuple(piece.shape)} != its FSDP shard {tuple(local.shape)}")
    local.copy_(piece)


def _copy_piece_into(target: torch.Tensor, stored: torch.Tensor, piece: Piece, name: str) -> None:
    """One expert's stored tensor into its place in fused parameter `target` when this rank's shard
    holds that expert (FSDP2 shards dim 0, the experts, in torch.chunk's split), cast to its dtype."""
    local = target
    start = 0
    if isinstance(target, DTensor):
        placements = target.placements
        if len(placements) != 1 or not isinstance(placements[0], Shard) or placements[0].dim != 0:
            raise NotImplementedError(f"{name}: sharded as {placements}; fused experts load into FSDP2's Shard(0)")
        mesh = target.device_mesh
        per_rank = -(-target.shape[0] // mesh.size())   # torch.chunk's chunk size
        start = mesh.get_local_rank() * per_rank
        local = target.to_local()
    index = piece.expert - start
    if not 0 <= index < local.shape[0]:
        return   # another rank's expert
    region = local[index] if piece.rows is None else local[index, piece.rows[0]:piece.rows[1]]
    if tuple(region.shape) != tuple(stored.shape):
        raise ValueError(f"{name}: the checkpoint's {piece.name} {tuple(stored.shape)} does not fit expert "
                         f"{piece.expert}'s {tuple(region.shape)} (an override_config that changes shapes?)")
    region.copy_(stored)


# --------------------------------------------------------------------------- weights not in the checkpoint

class _FreshWeights:
    """Parameters the checkpoint lacks, initialised as from_pretrained initialises a missing weight:
    the nearest enclosing HF model's `_init_weights` on the owning module (torch's
    `reset_parameters` outside one), in fp32 on the CPU, from the global RNG the caller seeded.

    The owners are copied on the meta device before sharding (their parameters are plain then) and
    materialised one owner at a time, when the stream first reaches one of their parameters."""

    def __init__(self, module: nn.Module, names: list[str],
                 init: Callable[[str, nn.Module], bool] | None = None) -> None:
        self._module = module
        self._init = init   # tried first: True when it initialised the owner (LoRA adapters)
        self._names = set(names)
        self._replicas = {owner: copy.deepcopy(module.get_submodule(owner))
                          for owner in dict.fromkeys(name.rpartition(".")[0] for name in names)}
        self._ready: dict[str, nn.Module] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def value(self, name: str) -> torch.Tensor:
        owner_name, _, local = name.rpartition(".")
        if owner_name not in self._ready:
            self._ready = {owner_name: self._initialise(owner_name)}   # the previous owner is done
        return self._ready[owner_name]._parameters[local].detach()

    def _initialise(self, owner_name: str) -> nn.Module:
        replica = self._replicas.pop(owner_name)
        for param_name, param in list(replica._parameters.items()):
            if param is not None:
                replica._parameters[param_name] = nn.Parameter(torch.empty_like(param, device="cpu"),
                                                               requires_grad=param.requires_grad)
        init_weights = _enclosing_init(self._module, owner_name)
        if self._init is not None and self._init(owner_name, replica):
            pass
        elif init_weights is not None:
            init_weights(replica)
        elif hasattr(replica, "reset_parameters"):
            replica.reset_parameters()
        else:
            raise ValueError(f"{owner_name or 'the root module'} ({type(replica).__name__}) has parameters the "
                             "checkpoint lacks and no initialiser")
        return replica


def _enclosing_init(module: nn.Module, owner_name: str) -> Callable[[nn.Module], None] | None:
    """`_init_weights` of the deepest Hugging Face model containing submodule `owner_name`."""
    found = None
    for name, candidate in module.named_modules():
        inside = not name or owner_name == name or owner_name.startswith(name + ".")
        if inside and callable(getattr(candidate, "_init_weights", None)):
            if found is None or len(name) >= len(found[0]):
                found = (name, candidate._init_weights)
    return found[1] if found is not None else None
