"""Worker: the base class of every process in a worker group.

The group launches each worker with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK and
LOCAL_WORLD_SIZE in its environment, so a subclass can call
`torch.distributed.init_process_group(get_dist_backend())` with no further arguments.
"""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass

import torch

from verl.single_controller.base.decorator import Dispatch, Execute, MeshRank, register
from verl.utils.device import is_cuda_available


def get_node_ip() -> str:
    """This node's IP as Ray sees it (falls back to the host's address outside Ray)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return socket.gethostbyname(socket.gethostname())


# Rendezvous ports are drawn below the kernel's ephemeral range (32768+ on Linux), which every outgoing
# connection draws from at any moment (a port the kernel handed out as free could be taken before the
# store binds it: a CI run met EADDRINUSE so), and above Ray's worker ports (10002-19999).
_PORT_RANGE = (20000, 32767)


def get_free_port() -> int:
    """A TCP port free on this node a moment ago (bound on all interfaces, so peers can reach it),
    drawn from 20000-32767; one the kernel picks if none there binds."""
    draw = random.SystemRandom()     # not the seeded global RNG: every process would draw alike
    for _ in range(100):
        port = draw.randrange(*_PORT_RANGE)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def get_availale_master_addr_port() -> tuple[str, str]:
    """(node ip, free port) for rank 0 to publish; veRL's spelling kept on purpose."""
    return get_node_ip(), str(get_free_port())


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str | None
    master_port: str | None


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as err:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from err


def read_dist_env() -> DistInfo:
    """Distributed layout from the environment; a bare process is rank 0 of 1."""
    info = DistInfo(
        rank=_env_int("RANK", 0),
        world_size=_env_int("WORLD_SIZE", 1),
        local_rank=_env_int("LOCAL_RANK", 0),
        local_world_size=_env_int("LOCAL_WORLD_SIZE", 1),
        master_addr=os.environ.get("MASTER_ADDR"),
        master_port=os.environ.get("MASTER_PORT"),
    )
    if not 0 <= info.rank < info.world_size:
        raise ValueError(f"RANK={info.rank} is outside WORLD_SIZE={info.world_size}")
    return info


class Worker:
    """Base worker: knows its rank and the rendezvous address of its group."""

    def __init__(self) -> None:
        self._dist_info = read_dist_env()
        threads = os.environ.get("OMP_NUM_THREADS")
        if is_cuda_available():
            torch.cuda.set_device(self.local_device_index())
        elif threads:
            # Many CPU workers share few cores; torch's default of one thread per core oversubscribes.
            torch.set_num_threads(max(1, _env_int("OMP_NUM_THREADS", 1)))

    @property
    def _dist(self) -> DistInfo:
        # Read lazily too, so a subclass that forgets super().__init__() still knows its rank.
        info = self.__dict__.get("_dist_info")
        if info is None:
            info = self.__dict__["_dist_info"] = read_dist_env()
        return info

    @property
    def rank(self) -> int:
        return self._dist.rank

    @property
    def world_size(self) -> int:
        return self._dist.world_size

    @property
    def local_rank(self) -> int:
        return self._dist.local_rank

    @property
    def local_world_size(self) -> int:
        return self._dist.local_world_size

    def local_device_index(self) -> int:
        """This worker's accelerator among the ones it can see.

        Ray narrows CUDA_VISIBLE_DEVICES to the actor's own GPU, so such a worker uses index 0
        whatever its LOCAL_RANK; a process that sees the whole node (torchrun) uses LOCAL_RANK.
        """
        return 0 if torch.cuda.device_count() == 1 else self.local_rank

    def get_master_addr_port(self) -> tuple[str | None, str | None]:
        return self._dist.master_addr, self._dist.master_port

    def get_node_ip(self) -> str:
        return get_node_ip()

    def get_availale_master_addr_port(self) -> tuple[str, str]:
        return get_availale_master_addr_port()

    def set_mesh_rank(self, mesh: str, where: MeshRank) -> None:
        """Say where this worker sits in `mesh` (methods registered with `mesh=` dispatch by it)."""
        self.__dict__.setdefault("_mesh_ranks", {})[mesh] = where

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get_mesh_rank(self, mesh: str) -> MeshRank:
        """This worker's place in `mesh`; a mesh it never set is all workers, each its own dp rank."""
        return self.__dict__.get("_mesh_ranks", {}).get(mesh) or MeshRank.identity(self.rank, self.world_size)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get_dist_info(self) -> DistInfo:
        """Each rank's view of the layout (handy for checks and debugging)."""
        return self._dist

    @register(dispatch_mode=Dispatch.RANK_ZERO, execute_mode=Execute.RANK_ZERO)
    def get_rank_zero_addr_port(self) -> tuple[str | None, str | None]:
        return self.get_master_addr_port()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def start_profile(self, save_path: str, step: int, group: str) -> None:
        """global_profiler (tool torch): record this process's torch activity until `stop_profile`, for the
        chrome trace <save_path>/step_<step>/<group>_rank<rank>.json (verl/utils/profiler.py)."""
        from verl.utils.profiler import TorchTrace, trace_path

        trace = self.__dict__.setdefault("_torch_trace", TorchTrace())
        trace.start(trace_path(save_path, step, f"{group}_rank{self.rank}"))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def stop_profile(self) -> str | None:
        """Stop the recording `start_profile` began and write its trace; returns the file (None: none began)."""
        trace = self.__dict__.get("_torch_trace")
        return trace.stop() if trace is not None else None
