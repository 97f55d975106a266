"""Ray backend of the single controller: placement groups, named worker actors, colocated roles.

The driver builds a RayResourcePool (one placement group spanning the nodes, one bundle per node),
then a RayWorkerGroup that starts node i's actors in bundle i with their rank/rendezvous environment,
and binds the worker class's @register methods on itself. On a machine without GPUs the
bundles are CPU-only and everything (gloo process groups included) runs the same way.

A worker process that dies (killed, out of memory, its node lost) surfaces in the driver as
Ray's ActorDiedError naming only an actor id; the group turns it into a WorkerDiedError naming
the role, rank, pid and node (`worker_death`), the Ray error kept as its __cause__.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import ray
from ray.actor import ActorClass
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from verl.single_controller.base.decorator import MAGIC_ATTR, MethodSpec
from verl.single_controller.base.worker import Worker, get_availale_master_addr_port, get_free_port
from verl.single_controller.base.worker_group import (
    ClassWithInitArgs,
    ResourcePool,
    WorkerGroup,
    registered_methods,
)

PLACEMENT_GROUP_TIMEOUT_S = 120
# One group call's submissions (one per rank) are made under this lock: Ray runs an actor's calls in
# the order the driver submitted them, so two threads calling the same workers (a pipelined run's
# producer pushing weights while the trainer computes) must not interleave their per-rank loops,
# or rank 0 would run A then B and rank 1 B then A, and their collectives would cross.
_SUBMIT_LOCK = threading.Lock()
# After a worker's task fails, how long to look for a peer that died: a rank blocked in a gloo
# collective fails as soon as the process it talks to is gone, often before Ray reports that death.
DEATH_GRACE_S = 3.0


@dataclass(frozen=True)
class WorkerPlace:
    """Where one worker of a group runs (pid / node_ip None when it died before it could say)."""

    role: str
    rank: int
    actor_name: str
    pid: int | None
    node_ip: str | None

    def describe(self) -> str:
        pid = self.pid if self.pid is not None else "?"
        node = self.node_ip or "?"
        return f"{self.role} rank {self.rank} (pid {pid}, node {node}, Ray actor {self.actor_name})"


class WorkerDiedError(RuntimeError):
    """A worker process died under a running call; `place` says which (None when unknown)."""

    def __init__(self, message: str, place: WorkerPlace | None = None) -> None:
        super().__init__(message)
        self.place = place


def _where_am_i(_actor: Any) -> tuple[int, str]:
    # Run inside the actor through __ray_call__, before any work: once it is dead nobody can ask.
    return os.getpid(), ray.util.get_node_ip_address()


def _ray_exit_detail(err: BaseException) -> str:
    """Ray's reason for an actor death without its generic list of causes, or ''."""
    for line in str(err).splitlines():
        if "Worker exit detail:" in line:
            detail = line.split("Worker exit detail:", 1)[1].split(" Some common causes include", 1)[0]
            return detail.strip().rstrip(".")
    return ""


def _unwrap_actor_class(cls: Any) -> type:
    """The plain Python class behind a @ray.remote class (or cls itself)."""
    return cls.__ray_actor_class__ if isinstance(cls, ActorClass) else cls


def alive_nodes() -> list[dict[str, Any]]:
    """The cluster's live nodes as `ray.nodes()` reports them (NodeID, NodeManagerAddress, Resources)."""
    return [node for node in ray.nodes() if node.get("Alive")]


def node_fits(node: dict[str, Any], need: dict[str, float]) -> bool:
    """Whether a `ray.nodes()` entry's resources hold `need` (e.g. {"CPU": 8, "GPU": 8})."""
    total = node.get("Resources", {})
    return all(total.get(key, 0.0) >= amount for key, amount in need.items())


def describe_nodes(nodes: list[dict[str, Any]] | None = None, need: dict[str, float] | None = None) -> str:
    """One line naming every live node and its CPU/GPU totals (and whether it fits `need`)."""
    nodes = alive_nodes() if nodes is None else nodes
    parts = []
    for node in nodes:
        total = node.get("Resources", {})
        text = (f"{node.get('NodeManagerAddress')} [node {str(node.get('NodeID'))[:8]}] "
                f"CPU={total.get('CPU', 0):g} GPU={total.get('GPU', 0):g}")
        if need is not None:
            text += " (fits)" if node_fits(node, need) else " (too small)"
        parts.append(text)
    return f"{len(nodes)} live node(s): " + ("; ".join(parts) if parts else "none")


def wait_for_nodes(
    nnodes: int,
    need: dict[str, float] | Callable[[list[dict[str, Any]]], dict[str, float]],
    timeout_s: float,
    poll_s: float = 1.0,
    what: str = "",
) -> list[str]:
    """Block until `nnodes` live nodes each have at least `need` resources in total; returns their ids.

    `need` may be a function of the live nodes (re-evaluated each poll), e.g. GPUs once any node
    has one. After `timeout_s` raises RuntimeError naming what is missing; `what` says which
    settings asked for it (e.g. "trainer.nnodes=2 x trainer.n_gpus_per_node=8").
    """
    if nnodes < 1:
        raise ValueError(f"wait_for_nodes: nnodes must be >= 1, got {nnodes}")
    deadline = time.monotonic() + max(timeout_s, 0.0)
    while True:
        nodes = alive_nodes()
        wanted = need(nodes) if callable(need) else need
        fitting = [node for node in nodes if node_fits(node, wanted)]
        if len(fitting) >= nnodes:
            return [node["NodeID"] for node in fitting]
        if time.monotonic() >= deadline:
            raise RuntimeError(
                f"the Ray cluster has {len(fitting)} of the {nnodes} node(s) with {wanted} each that "
                f"{what or 'the resource pool'} needs (missing {nnodes - len(fitting)}) after waiting "
                f"{timeout_s:g}s; {describe_nodes(nodes, wanted)}. Start the missing node(s) with "
                f"`ray start --address=<head>:<port>` or lower the node/worker counts."
            )
        time.sleep(poll_s)


class RayResourcePool(ResourcePool):
    """Processes per node, reserved as Ray placement groups (created on first use)."""

    def __init__(
        self,
        process_on_nodes: list[int] | None = None,
        use_gpu: bool = True,
        name_prefix: str = "",
        max_colocate_count: int = 1,
        detached: bool = False,
    ) -> None:
        super().__init__(process_on_nodes, max_colocate_count)
        self.use_gpu = use_gpu
        self.name_prefix = name_prefix
        self.detached = detached
        self.pgs: list[PlacementGroup] | None = None

    def gpus_in_use(self) -> bool:
        """GPU bundles only when asked for and the cluster has GPUs; otherwise CPU-only bundles."""
        return bool(self.use_gpu and ray.cluster_resources().get("GPU", 0) > 0)

    def bundle(self, processes: int = 1) -> dict[str, float]:
        """Resources of `processes` worker processes on one node."""
        # max_colocate_count actors (one per colocated group) share each process's slot.
        bundle = {"CPU": float(self.max_colocate_count * processes)}
        if self.gpus_in_use():
            bundle["GPU"] = float(processes)
        return bundle

    def get_placement_groups(self) -> list[PlacementGroup]:
        """One placement group spanning the pool's nodes: bundle i holds node i's processes.

        STRICT_SPREAD puts every bundle on a different Ray node, so `process_on_nodes=[8, 8]`
        is 8 workers on each of two nodes (never 16 on one big node); the workers of node i
        share bundle i, each holding one process's share of it. Returned as a one-item list.
        """
        if self.pgs is not None:
            return self.pgs
        bundles = [self.bundle(count) for count in self._store]
        strategy = "STRICT_SPREAD" if len(bundles) > 1 else "STRICT_PACK"
        name = f"{self.name_prefix}verl_group" if self.name_prefix else ""
        lifetime = "detached" if self.detached else None
        pg = placement_group(bundles, strategy=strategy, name=name, lifetime=lifetime)
        try:
            ray.get(pg.ready(), timeout=PLACEMENT_GROUP_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError as err:
            remove_placement_group(pg)
            raise RuntimeError(
                f"RayResourcePool(process_on_nodes={self._store}) could not reserve {strategy} bundles {bundles} "
                f"within {PLACEMENT_GROUP_TIMEOUT_S}s; {describe_nodes()}"
            ) from err
        self.pgs = [pg]
        return self.pgs

    def release(self) -> None:
        """Give the reserved bundles back to the cluster (kill the pool's actors first)."""
        for pg in self.pgs or []:
            remove_placement_group(pg)
        self.pgs = None


class RayClassWithInitArgs(ClassWithInitArgs):
    """A (ray.remote or plain) worker class, its init arguments, and extra actor options."""

    def __init__(self, cls: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(cls, *args, **kwargs)
        self._options: dict[str, Any] = {}

    @property
    def user_cls(self) -> type:
        return _unwrap_actor_class(self.cls)

    def update_options(self, options: dict[str, Any]) -> None:
        self._options.update(options)

    def create_actor(
        self,
        placement_group: PlacementGroup,
        bundle_index: int,
        env_vars: dict[str, str],
        name: str,
        num_cpus: float,
        num_gpus: float,
        detached: bool = False,
    ) -> ray.actor.ActorHandle:
        remote_cls = self.cls if isinstance(self.cls, ActorClass) else ray.remote(self.cls)
        options = dict(self._options)
        # User-supplied env vars are kept; the rank/rendezvous ones must win.
        runtime_env = dict(options.pop("runtime_env", None) or {})
        runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **env_vars}
        options.update(
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=placement_group, placement_group_bundle_index=bundle_index
            ),
            runtime_env=runtime_env,
            name=name,
            num_cpus=num_cpus,
            num_gpus=num_gpus,
        )
        if detached:
            options["lifetime"] = "detached"
        return remote_cls.options(**options).remote(*self.args, **self.kwargs)


def _rendezvous_for(pg: PlacementGroup) -> tuple[str, str]:
    """(MASTER_ADDR, MASTER_PORT) on the node of the pool's first bundle, where rank 0 will run."""
    node_of_bundle = ray.util.placement_group_table(pg)["bundles_to_node_id"][0]
    if node_of_bundle == ray.get_runtime_context().get_node_id():
        return ray.util.get_node_ip_address(), str(get_free_port())
    probe = ray.remote(num_cpus=0)(get_availale_master_addr_port).options(
        scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=0)
    )
    return ray.get(probe.remote())


class RayWorkerGroup(WorkerGroup):
    """world_size named Ray actors of one worker class, placed in a RayResourcePool's bundles."""

    def __init__(
        self,
        resource_pool: RayResourcePool | None = None,
        ray_cls_with_init: RayClassWithInitArgs | None = None,
        name_prefix: str | None = None,
        detached: bool = False,
        worker_names: list[str] | None = None,
    ) -> None:
        super().__init__(resource_pool)
        self.ray_cls_with_init = ray_cls_with_init
        self.name_prefix = name_prefix if name_prefix is not None else uuid.uuid4().hex[:6]
        self._detached = detached
        self.master_addr: str | None = None
        self.master_port: str | None = None
        self._place_refs: list[ray.ObjectRef] = []
        # The name a death is reported under: the role for a view from spawn(), else the class.
        self.role = ray_cls_with_init.user_cls.__name__ if ray_cls_with_init is not None else ""
        if ray_cls_with_init is None:
            return  # an empty shell, filled in by spawn()
        if worker_names is not None:
            self._workers = [ray.get_actor(name) for name in worker_names]
            self._worker_names = list(worker_names)
            self._ask_places()
        else:
            if resource_pool is None:
                raise ValueError("RayWorkerGroup needs a resource_pool (or worker_names of detached workers)")
            self._start_workers(resource_pool, ray_cls_with_init)
        self._bind_worker_method(ray_cls_with_init.user_cls)

    def _start_workers(self, pool: RayResourcePool, cia: RayClassWithInitArgs) -> None:
        pgs = pool.get_placement_groups()
        use_gpu = pool.gpus_in_use()
        self.master_addr, self.master_port = _rendezvous_for(pgs[0])
        world_size = pool.world_size
        rank = 0
        (pg,) = pgs
        for node, local_world_size in enumerate(pool.store):
            for local_rank in range(local_world_size):
                env = {
                    "RANK": str(rank),
                    "WORLD_SIZE": str(world_size),
                    "LOCAL_RANK": str(local_rank),
                    "LOCAL_WORLD_SIZE": str(local_world_size),
                    "MASTER_ADDR": self.master_addr,
                    "MASTER_PORT": self.master_port,
                    "WG_PREFIX": self.name_prefix,
                    "WG_BACKEND": "ray",
                    # One string hash order on every worker: code that iterates a set of strings
                    # (vLLM frees finished requests' KV blocks that way) runs alike on the ranks of
                    # a tensor-parallel engine, which must schedule identically.
                    "PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", "0"),
                }
                name = f"{self.name_prefix}{cia.user_cls.__name__}_{node}:{local_rank}"
                # Ray sets CUDA_VISIBLE_DEVICES for actors that hold a GPU share; CPU actors hold none.
                actor = cia.create_actor(
                    pg,
                    bundle_index=node,
                    env_vars=env,
                    name=name,
                    num_cpus=1,
                    num_gpus=1 / pool.max_colocate_count if use_gpu else 0,
                    detached=self._detached,
                )
                self._workers.append(actor)
                self._worker_names.append(name)
                rank += 1
        self._ask_places()

    def _ask_places(self) -> None:
        """Ask every actor for its pid and node now (answers kept as object refs, read on a death)."""
        self._place_refs = [worker.__ray_call__.remote(_where_am_i) for worker in self._workers]

    @classmethod
    def from_detached(cls, worker_names: list[str], ray_cls_with_init: RayClassWithInitArgs) -> RayWorkerGroup:
        """Reattach to detached actors by name (e.g. from another driver)."""
        return cls(resource_pool=None, ray_cls_with_init=ray_cls_with_init, worker_names=worker_names)

    def spawn(self, prefix_set: Iterable[str]) -> dict[str, RayWorkerGroup]:
        """Per-role views of a colocated group: group[role].method calls `{role}_method` on the actors."""
        groups = {}
        for prefix in prefix_set:
            group = RayWorkerGroup(name_prefix=self.name_prefix)
            group.ray_cls_with_init = self.ray_cls_with_init
            group._resource_pool = self._resource_pool
            group._workers = self._workers
            group._worker_names = self._worker_names
            group._place_refs = self._place_refs
            group.role = prefix
            group.master_addr, group.master_port = self.master_addr, self.master_port
            user_cls = self.ray_cls_with_init.user_cls
            known_roles = getattr(user_cls, "role_methods", {})
            if prefix not in known_roles:
                raise KeyError(f"spawn: role {prefix!r} is not one of {sorted(known_roles)} in {user_cls.__name__}")
            full_names = {f"{prefix}_{short}": short for short in known_roles[prefix]}
            group._bind_worker_method(user_cls, only=set(full_names))
            for full_name, short in full_names.items():
                if hasattr(type(group), short):
                    raise ValueError(f"role {prefix!r} method {short!r} clashes with RayWorkerGroup.{short}")
                setattr(group, short, getattr(group, full_name))
                group.bound_methods[short] = group.bound_methods[full_name]
            groups[prefix] = group
        return groups

    # ------------------------------------------------------------------ execution
    def _execute_ranks(
        self, method_name: str, ranks: list[int], rank_args: list[tuple], rank_kwargs: list[dict]
    ) -> list[ray.ObjectRef]:
        with _SUBMIT_LOCK:
            return [
                getattr(self._workers[rank], method_name).remote(*args, **kwargs)
                for rank, args, kwargs in zip(ranks, rank_args, rank_kwargs, strict=True)
            ]

    def _resolve(self, handles: list[ray.ObjectRef]) -> list[Any]:
        """Every result, raising the first failure as soon as it happens: a worker that failed while
        its peers wait in a collective for it must not leave the driver waiting on those peers.

        A dead worker is raised as WorkerDiedError (role, rank, pid, node). When a task fails with
        an ordinary error, the other calls get DEATH_GRACE_S to show whether a worker died under
        them: a peer's broken collective is then a symptom, and the death is what is raised."""
        pending = list(handles)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(ready)   # raises the worker's error now
            except ray.exceptions.RayActorError as err:
                raise self.worker_death(err) from err
            except ray.exceptions.RayTaskError:
                died = _first_death(pending, DEATH_GRACE_S)
                if died is not None:
                    raise self.worker_death(died) from died
                raise
        return ray.get(handles)

    def rank_of(self, err: ray.exceptions.RayActorError) -> int | None:
        """The rank of the actor `err` is about, or None when it is not one of this group's."""
        actor_id = getattr(err, "actor_id", None)
        for rank, worker in enumerate(self._workers):
            if actor_id is not None and worker._actor_id.hex() == actor_id:
                return rank
        return None

    def place(self, rank: int) -> WorkerPlace:
        """Role, rank, actor name, pid and node of one worker (pid / node None if never answered)."""
        pid, node_ip = None, None
        if rank < len(self._place_refs):
            try:
                pid, node_ip = ray.get(self._place_refs[rank], timeout=1.0)
            except (ray.exceptions.RayError, ValueError):
                pass   # died before it answered: the message says '?'
        return WorkerPlace(self.role, rank, self._worker_names[rank], pid, node_ip)

    def worker_death(self, err: ray.exceptions.RayActorError) -> WorkerDiedError:
        """`err` as a WorkerDiedError naming this group's role and the rank that died (raise it `from err`)."""
        rank = self.rank_of(err)
        if rank is None:
            return WorkerDiedError(f"a Ray actor outside {self.role or 'this worker group'} died: "
                                   f"{str(err).splitlines()[0] if str(err) else type(err).__name__}")
        place = self.place(rank)
        detail = _ray_exit_detail(err)
        return WorkerDiedError(f"{place.describe()} died" + (f" ({detail})" if detail else "")
                               + "; a process dies this way when it is killed, runs out of host memory (see "
                               f"`dmesg` on {place.node_ip or 'its node'}) or crashes", place)

    def execute_all_async(self, method_name: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        """Call method_name with the same arguments on every worker; returns object refs."""
        ranks = list(range(self.world_size))
        return self._execute_ranks(method_name, ranks, [args] * len(ranks), [kwargs] * len(ranks))

    def execute_all(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self._resolve(self.execute_all_async(method_name, *args, **kwargs))

    def execute_all_sync(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self.execute_all(method_name, *args, **kwargs)

    def execute_rank_zero_async(self, method_name: str, *args: Any, **kwargs: Any) -> ray.ObjectRef:
        return self._execute_ranks(method_name, [0], [args], [kwargs])[0]

    def execute_rank_zero(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        return self._resolve([self.execute_rank_zero_async(method_name, *args, **kwargs)])[0]

    def shutdown(self) -> None:
        """Kill this group's actors (views from spawn() share them, so they go too)."""
        for worker in self._workers:
            ray.kill(worker, no_restart=True)
        self._workers = []


def _first_death(handles: list[ray.ObjectRef], grace_s: float) -> ray.exceptions.RayActorError | None:
    """The first of `handles` to fail because its actor died, waiting at most `grace_s`; else None."""
    deadline = time.monotonic() + grace_s
    pending = list(handles)
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as err:
                return err
            except ray.exceptions.RayError:
                continue
    return None


def worker_death(err: BaseException, groups: Iterable[RayWorkerGroup]) -> WorkerDiedError | None:
    """`err` as a WorkerDiedError when it is one, or when it is Ray's actor death of a worker in one
    of `groups` (the first that holds the actor names the role); None for any other error."""
    if isinstance(err, WorkerDiedError):
        return err
    if not isinstance(err, ray.exceptions.RayActorError):
        return None
    for group in groups:
        if group is not None and group.rank_of(err) is not None:
            return group.worker_death(err)
    return None


def _role_method(role: str, method_name: str, spec: MethodSpec) -> Any:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.worker_dict[role], method_name)(*args, **kwargs)

    method.__name__ = f"{role}_{method_name}"
    setattr(method, MAGIC_ATTR, spec)
    return method


def create_colocated_worker_cls(class_dict: dict[str, RayClassWithInitArgs]) -> RayClassWithInitArgs:
    """One actor class holding an instance per role; role methods appear as `{role}_{method}`."""
    if not class_dict:
        raise ValueError("create_colocated_worker_cls needs at least one role")
    roles = {role: (cia.user_cls, cia.args, cia.kwargs) for role, cia in class_dict.items()}
    role_methods: dict[str, list[str]] = {}

    class WorkerDict(Worker):
        def __init__(self) -> None:
            super().__init__()
            self.worker_dict = {role: user_cls(*args, **kwargs) for role, (user_cls, args, kwargs) in roles.items()}

    for role, (user_cls, _, _) in roles.items():
        for method_name, spec in registered_methods(user_cls).items():
            setattr(WorkerDict, f"{role}_{method_name}", _role_method(role, method_name, spec))
            role_methods.setdefault(role, []).append(method_name)
    # spawn() reads this map, because with roles like "actor" and "actor_rollout" a name prefix is ambiguous.
    WorkerDict.role_methods = role_methods
    WorkerDict.__name__ = WorkerDict.__qualname__ = "WorkerDict_" + "_".join(roles)
    return RayClassWithInitArgs(ray.remote(WorkerDict))
