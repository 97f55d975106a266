"""@register: how a worker method's arguments are spread over a group and its results gathered.

A worker class marks a method with `@register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)`; the
WorkerGroup then exposes a method of the same name that splits the call over its workers,
runs it, and collects the results. The split/collect functions sit in DISPATCH_TABLE, fixed
at import time. Calling the decorated method directly on an instance behaves as undecorated
(apart from resolving DataProtoFuture arguments).

A method may name a *mesh* (`@register(Dispatch.DP_COMPUTE_PROTO, mesh="rollout")`): then the
data is split over that mesh's data-parallel ranks rather than over every worker. Each worker
says where it sits in the mesh (`Worker.set_mesh_rank`): workers with the same `dp_rank` (the
ranks of one tensor-parallel group) receive the same chunk, and only the one marked `collect`
returns its result to the driver.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Any

from verl.protocol import DataProto, DataProtoFuture, pad_dataproto_to_divisor, unpad_dataproto
from verl.utils.batch_keys import META_METRICS
from verl.utils.profiler import profiled_range

# veRL's attribute name, kept so tools that inspect veRL workers keep working.
MAGIC_ATTR = "attrs_3141562937"


class Dispatch(Enum):
    ONE_TO_ALL = "one_to_all"
    ALL_TO_ALL = "all_to_all"
    RANK_ZERO = "rank_zero"
    DP_COMPUTE = "dp_compute"
    DP_COMPUTE_PROTO = "dp_compute_proto"
    DP_COMPUTE_PROTO_WITH_FUNC = "dp_compute_proto_with_func"
    DP_COMPUTE_METRIC = "dp_compute_metric"


class Execute(Enum):
    ALL = "all"
    RANK_ZERO = "rank_zero"


@dataclass(frozen=True)
class MethodSpec:
    """What @register attaches to a method (under MAGIC_ATTR)."""

    dispatch_mode: Dispatch
    execute_mode: Execute
    blocking: bool
    materialize_futures: bool
    mesh: str | None = None


@dataclass(frozen=True)
class MeshRank:
    """Where one worker sits in a named mesh: its data-parallel rank among `dp_size`, and whether
    its result is the one collected for that rank (one worker per tensor-parallel group)."""

    dp_rank: int
    dp_size: int
    collect: bool = True

    @staticmethod
    def identity(rank: int, world_size: int) -> MeshRank:
        return MeshRank(rank, world_size, True)


def check_mesh(name: str, ranks: list[MeshRank]) -> None:
    """Every worker agrees on dp_size, and each dp rank has exactly one collecting worker."""
    sizes = {r.dp_size for r in ranks}
    if len(sizes) != 1:
        raise ValueError(f"mesh {name!r}: workers disagree on the data-parallel size: {sorted(sizes)}")
    (dp_size,) = sizes
    collectors = sorted(r.dp_rank for r in ranks if r.collect)
    if collectors != list(range(dp_size)) or any(not 0 <= r.dp_rank < dp_size for r in ranks):
        raise ValueError(f"mesh {name!r}: each of the {dp_size} data-parallel ranks needs exactly one collecting "
                         f"worker; got dp ranks {[r.dp_rank for r in ranks]}, collecting {collectors}")


@dataclass
class DispatchedCall:
    """Per-rank arguments produced by a dispatch function.

    rank_args[i] / rank_kwargs[i] go to rank i. `pad_size` rows were appended to every DataProto
    argument so it divides evenly; the collect function removes them again.
    """

    rank_args: list[tuple]
    rank_kwargs: list[dict[str, Any]]
    pad_size: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------- dispatch functions
def dispatch_one_to_all(world_size: int, *args: Any, **kwargs: Any) -> DispatchedCall:
    return DispatchedCall([args] * world_size, [kwargs] * world_size)


def dispatch_all_to_all(world_size: int, *args: Any, **kwargs: Any) -> DispatchedCall:
    # Same arguments to every rank, untouched; the worker decides what to do with them.
    return DispatchedCall([args] * world_size, [kwargs] * world_size)


def dispatch_rank_zero(world_size: int, *args: Any, **kwargs: Any) -> DispatchedCall:
    return DispatchedCall([args], [kwargs])


def dispatch_dp_compute(world_size: int, *args: Any, **kwargs: Any) -> DispatchedCall:
    named = [(f"positional argument {i}", a) for i, a in enumerate(args)] + [
        (f"keyword argument {k!r}", v) for k, v in kwargs.items()
    ]
    for name, value in named:
        if not isinstance(value, (list, tuple)) or len(value) != world_size:
            got = f"a {type(value).__name__}" + (f" of length {len(value)}" if hasattr(value, "__len__") else "")
            raise ValueError(f"DP_COMPUTE: {name} must be a list of length world_size={world_size}, got {got}")
    rank_args = [tuple(a[i] for a in args) for i in range(world_size)]
    rank_kwargs = [{k: v[i] for k, v in kwargs.items()} for i in range(world_size)]
    return DispatchedCall(rank_args, rank_kwargs)


def _split_protos(world_size: int, args: tuple, kwargs: dict[str, Any]) -> DispatchedCall:
    """Pad every DataProto argument to a multiple of world_size and hand rank i its i-th chunk.

    A DataProtoFuture is resolved here, on the driver, because padding needs its length.
    Other arguments go to every rank unchanged.
    """
    args = tuple(a.get() if isinstance(a, DataProtoFuture) else a for a in args)
    kwargs = {k: v.get() if isinstance(v, DataProtoFuture) else v for k, v in kwargs.items()}
    named = [(f"positional argument {i}", a) for i, a in enumerate(args)] + [
        (f"keyword argument {k!r}", v) for k, v in kwargs.items()
    ]
    protos = [(name, v) for name, v in named if isinstance(v, DataProto)]
    if not protos:
        raise TypeError("DP_COMPUTE_PROTO needs at least one DataProto argument")
    lengths = {name: len(v) for name, v in protos}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"DP_COMPUTE_PROTO: DataProto arguments differ in length: {lengths}")
    pad_size = 0

    def chunks_of(value: Any) -> list[Any]:
        nonlocal pad_size
        if not isinstance(value, DataProto):
            return [value] * world_size
        padded, pad_size = pad_dataproto_to_divisor(value, world_size)
        return padded.chunk(world_size)

    split_args = [chunks_of(a) for a in args]
    split_kwargs = {k: chunks_of(v) for k, v in kwargs.items()}
    rank_args = [tuple(parts[i] for parts in split_args) for i in range(world_size)]
    rank_kwargs = [{k: parts[i] for k, parts in split_kwargs.items()} for i in range(world_size)]
    return DispatchedCall(rank_args, rank_kwargs, pad_size=pad_size)


def dispatch_dp_compute_proto(world_size: int, *args: Any, **kwargs: Any) -> DispatchedCall:
    return _split_protos(world_size, args, kwargs)


def dispatch_dp_compute_proto_with_func(world_size: int, *args: Any, **kwargs: Any) -> DispatchedCall:
    if not args or not callable(args[0]):
        raise TypeError("DP_COMPUTE_PROTO_WITH_FUNC: the first positional argument must be a function")
    func, rest = args[0], args[1:]
    call = _split_protos(world_size, rest, kwargs)
    call.rank_args = [(func, *a) for a in call.rank_args]
    return call


# ----------------------------------------------------------------------------- collect functions
def collect_list(outputs: list[Any], call: DispatchedCall) -> list[Any]:
    return list(outputs)


def collect_rank_zero(outputs: list[Any], call: DispatchedCall) -> Any:
    return outputs[0]


def _is_object_ref(value: Any) -> bool:
    try:
        import ray
    except ImportError:
        return False
    return isinstance(value, ray.ObjectRef)


def _merge_metrics(per_rank: list[dict[str, Any] | None]) -> dict[str, list[Any]]:
    """Every rank's metrics, as one list per name (concat alone would keep rank 0's only)."""
    merged: dict[str, list[Any]] = {}
    for metrics in per_rank:
        for name, value in (metrics or {}).items():
            values = merged.setdefault(name, [])
            if isinstance(value, (list, tuple)):
                values.extend(value)
            else:
                values.append(value)
    return merged


@dataclass(frozen=True)
class _ConcatUnpad:
    """Picklable collect step: concatenate worker DataProtos and drop dispatch padding."""

    pad_size: int

    def __call__(self, outputs: list[Any]) -> DataProto:
        for rank, out in enumerate(outputs):
            if not isinstance(out, DataProto):
                raise TypeError(
                    f"DP_COMPUTE_PROTO: rank {rank} returned a {type(out).__name__}; such methods must return DataProto"
                )
        merged = DataProto.concat(outputs)
        if any(META_METRICS in out.meta_info for out in outputs):
            merged.meta_info[META_METRICS] = _merge_metrics([out.meta_info.get(META_METRICS) for out in outputs])
        if len(merged) == 0:
            # Row-less results (e.g. update_actor returning only meta_info metrics) hold no padding.
            return merged
        return unpad_dataproto(merged, self.pad_size)


def collect_dp_compute_proto(outputs: list[Any], call: DispatchedCall) -> DataProto | DataProtoFuture:
    collect = _ConcatUnpad(call.pad_size)
    if outputs and _is_object_ref(outputs[0]):
        return DataProtoFuture(collect_fn=collect, futures=list(outputs))
    return collect(outputs)


@dataclass(frozen=True)
class DispatchSpec:
    dispatch_fn: Callable[..., DispatchedCall]
    collect_fn: Callable[[list[Any], DispatchedCall], Any]


DISPATCH_TABLE: MappingProxyType[Dispatch, DispatchSpec] = MappingProxyType({
    Dispatch.ONE_TO_ALL: DispatchSpec(dispatch_one_to_all, collect_list),
    Dispatch.ALL_TO_ALL: DispatchSpec(dispatch_all_to_all, collect_list),
    Dispatch.RANK_ZERO: DispatchSpec(dispatch_rank_zero, collect_rank_zero),
    Dispatch.DP_COMPUTE: DispatchSpec(dispatch_dp_compute, collect_list),
    Dispatch.DP_COMPUTE_PROTO: DispatchSpec(dispatch_dp_compute_proto, collect_dp_compute_proto),
    Dispatch.DP_COMPUTE_PROTO_WITH_FUNC: DispatchSpec(dispatch_dp_compute_proto_with_func, collect_dp_compute_proto),
    Dispatch.DP_COMPUTE_METRIC: DispatchSpec(dispatch_dp_compute_proto, collect_list),
})
assert set(DISPATCH_TABLE) == set(Dispatch), "every Dispatch mode needs a row in DISPATCH_TABLE"
# Modes whose data is split by rows, so a mesh can say over which ranks.
MESH_DISPATCH_MODES = frozenset({Dispatch.DP_COMPUTE_PROTO, Dispatch.DP_COMPUTE_PROTO_WITH_FUNC,
                                 Dispatch.DP_COMPUTE_METRIC})


def get_method_spec(method: Any) -> MethodSpec | None:
    """The @register spec of a function/method, or None if it is not registered."""
    return getattr(method, MAGIC_ATTR, None)


def _materialize_futures(args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    args = tuple(a.get() if isinstance(a, DataProtoFuture) else a for a in args)
    kwargs = {k: v.get() if isinstance(v, DataProtoFuture) else v for k, v in kwargs.items()}
    return args, kwargs


def register(
    dispatch_mode: Dispatch = Dispatch.ALL_TO_ALL,
    execute_mode: Execute = Execute.ALL,
    blocking: bool = True,
    materialize_futures: bool = True,
    mesh: str | None = None,
) -> Callable[[Callable], Callable]:
    """Mark a worker method so WorkerGroups expose it with this dispatch/execute behaviour.

    `mesh` (DP_COMPUTE_PROTO modes only) splits the data over the named mesh's data-parallel
    ranks instead of over every worker (see the module docstring)."""
    if not isinstance(dispatch_mode, Dispatch):
        raise TypeError(f"dispatch_mode must be a Dispatch, got {dispatch_mode!r}")
    if not isinstance(execute_mode, Execute):
        raise TypeError(f"execute_mode must be an Execute, got {execute_mode!r}")
    if mesh is not None and dispatch_mode not in MESH_DISPATCH_MODES:
        raise ValueError(f"mesh={mesh!r} needs one of {sorted(m.name for m in MESH_DISPATCH_MODES)}, "
                         f"got {dispatch_mode.name}")
    spec = MethodSpec(dispatch_mode, execute_mode, bool(blocking), bool(materialize_futures), mesh)

    def decorator(func: Callable) -> Callable:
        @functools.wraps(func)
        def inner(*args: Any, **kwargs: Any) -> Any:
            if materialize_futures:
                args, kwargs = _materialize_futures(args, kwargs)
            with profiled_range(func.__name__):   # names the call in a worker's global_profiler trace
                return func(*args, **kwargs)

        setattr(inner, MAGIC_ATTR, spec)
        return inner

    return decorator
