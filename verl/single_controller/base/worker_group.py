"""WorkerGroup: the driver-side handle of N workers, with their @register methods bound on it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from verl.single_controller.base.decorator import (
    DISPATCH_TABLE,
    Dispatch,
    Execute,
    MeshRank,
    MethodSpec,
    check_mesh,
    get_method_spec,
)


class ResourcePool:
    """How many worker processes run on each node (process_on_nodes[i] on node i)."""

    def __init__(self, process_on_nodes: list[int] | None = None, max_colocate_count: int = 1) -> None:
        process_on_nodes = [1] if process_on_nodes is None else list(process_on_nodes)
        for i, count in enumerate(process_on_nodes):
            if not isinstance(count, int) or count < 1:
                raise ValueError(f"process_on_nodes[{i}] must be a positive int, got {count!r}")
        if max_colocate_count < 1:
            raise ValueError(f"max_colocate_count must be >= 1, got {max_colocate_count}")
        self._store = process_on_nodes
        self.max_colocate_count = max_colocate_count

    def add_node(self, process_count: int) -> None:
        self._store.append(process_count)

    @property
    def world_size(self) -> int:
        return sum(self._store)

    @property
    def store(self) -> list[int]:
        return self._store

    def __call__(self) -> list[int]:
        return self._store

    def local_world_size_list(self) -> list[int]:
        return [count for count in self._store for _ in range(count)]

    def local_rank_list(self) -> list[int]:
        return [local for count in self._store for local in range(count)]


class ClassWithInitArgs:
    """A class plus the arguments to build it with, constructed later inside each worker."""

    def __init__(self, cls: type, *args: Any, **kwargs: Any) -> None:
        self.cls = cls
        self.args = args
        self.kwargs = kwargs

    def __call__(self) -> Any:
        return self.cls(*self.args, **self.kwargs)


@dataclass(frozen=True)
class BoundMethodInfo:
    name: str
    spec: MethodSpec


def registered_methods(cls: type) -> dict[str, MethodSpec]:
    """Name -> @register spec for every registered method of cls (inherited ones included)."""
    found = {}
    for name in dir(cls):
        if name.startswith("__"):
            continue
        try:
            attr = getattr(cls, name)
        except AttributeError:
            continue
        spec = get_method_spec(attr)
        if spec is not None:
            found[name] = spec
    return found


class WorkerGroup:
    """Base class: subclasses provide `_execute_ranks` and `_resolve`; binding is shared."""

    def __init__(self, resource_pool: ResourcePool | None = None) -> None:
        self._resource_pool = resource_pool
        self._workers: list[Any] = []
        self._worker_names: list[str] = []
        self.bound_methods: dict[str, MethodSpec] = {}
        self._mesh_ranks: dict[str, list[MeshRank]] = {}

    @property
    def world_size(self) -> int:
        return len(self._workers)

    @property
    def workers(self) -> list[Any]:
        return self._workers

    @property
    def worker_names(self) -> list[str]:
        return self._worker_names

    # Subclasses: start `method_name` on the given ranks with per-rank args; return handles.
    def _execute_ranks(
        self, method_name: str, ranks: list[int], rank_args: list[tuple], rank_kwargs: list[dict]
    ) -> list[Any]:
        raise NotImplementedError

    # Subclasses: wait for the handles returned by _execute_ranks.
    def _resolve(self, handles: list[Any]) -> list[Any]:
        raise NotImplementedError

    def _make_group_method(self, method_name: str, spec: MethodSpec) -> Callable[..., Any]:
        table_row = DISPATCH_TABLE[spec.dispatch_mode]

        def group_method(*args: Any, **kwargs: Any) -> Any:
            if spec.mesh is not None:
                return self._call_on_mesh(method_name, spec, args, kwargs)
            call = table_row.dispatch_fn(self.world_size, *args, **kwargs)
            only_rank_zero = spec.execute_mode is Execute.RANK_ZERO or spec.dispatch_mode is Dispatch.RANK_ZERO
            ranks = [0] if only_rank_zero else list(range(self.world_size))
            handles = self._execute_ranks(method_name, ranks, call.rank_args[: len(ranks)], call.rank_kwargs[: len(ranks)])
            outputs = self._resolve(handles) if spec.blocking else handles
            if only_rank_zero:
                return outputs[0]
            return table_row.collect_fn(outputs, call)

        group_method.__name__ = method_name
        group_method.__qualname__ = f"{type(self).__name__}.{method_name}"
        return group_method

    def mesh_ranks(self, mesh: str) -> list[MeshRank]:
        """Each worker's place in `mesh`, asked of the workers once and kept."""
        if mesh not in self._mesh_ranks:
            ask = getattr(self, "get_mesh_rank", None)
            if ask is None:
                raise TypeError(f"a method dispatched over mesh {mesh!r} needs workers derived from Worker "
                                "(they answer get_mesh_rank)")
            ranks = list(ask(mesh))
            check_mesh(mesh, ranks)
            self._mesh_ranks[mesh] = ranks
        return self._mesh_ranks[mesh]

    def _call_on_mesh(self, method_name: str, spec: MethodSpec, args: tuple, kwargs: dict[str, Any]) -> Any:
        """Split over the mesh's dp ranks; every worker runs (a tensor-parallel group's ranks on the same
        chunk), and the collecting worker of each dp rank gives the result."""
        table_row = DISPATCH_TABLE[spec.dispatch_mode]
        ranks = self.mesh_ranks(spec.mesh)
        dp_size = ranks[0].dp_size
        call = table_row.dispatch_fn(dp_size, *args, **kwargs)
        handles = self._execute_ranks(method_name, list(range(self.world_size)),
                                      [call.rank_args[r.dp_rank] for r in ranks],
                                      [call.rank_kwargs[r.dp_rank] for r in ranks])
        collector = {r.dp_rank: worker for worker, r in enumerate(ranks) if r.collect}
        if spec.blocking:
            # Wait for every worker, so a failure on a non-collecting rank is not lost.
            resolved = self._resolve(handles)
            outputs = [resolved[collector[dp]] for dp in range(dp_size)]
        else:
            outputs = [handles[collector[dp]] for dp in range(dp_size)]
        return table_row.collect_fn(outputs, call)

    def _bind_worker_method(self, user_defined_cls: type, only: set[str] | None = None) -> list[str]:
        """Expose each @register method of user_defined_cls on self (only the names in `only`, if given)."""
        bound = []
        for name, spec in registered_methods(user_defined_cls).items():
            if only is not None and name not in only:
                continue
            if hasattr(type(self), name):
                raise ValueError(
                    f"worker method {user_defined_cls.__name__}.{name} clashes with WorkerGroup.{name}; rename it"
                )
            setattr(self, name, self._make_group_method(name, spec))
            self.bound_methods[name] = spec
            bound.append(name)
        return bound
