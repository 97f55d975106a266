"""A worker process killed (SIGKILL) while the driver waits on it: the driver's error names the
role, rank, pid and node instead of Ray's bare ActorDiedError (kept as __cause__)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest
import ray
import ray.cloudpickle

from verl.single_controller.base import Dispatch, Worker, register
from verl.single_controller.ray import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    WorkerDiedError,
    create_colocated_worker_cls,
    worker_death,
)

# pytest imports this file under a name Ray's workers cannot import; ship its classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class NapWorker(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def nap(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def nap_async(self, seconds: float) -> int:
        return self.nap(seconds)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def fail_after(self, seconds: float) -> None:
        time.sleep(seconds)
        raise RuntimeError("Connection closed by peer")   # what gloo raises when a peer process dies


class CriticNap(NapWorker):
    pass


@pytest.fixture
def group(ray_cluster):
    pool = RayResourcePool([2], use_gpu=False)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(NapWorker))
    yield group
    group.shutdown()
    pool.release()


def _kill_later(pid: int, delay_s: float = 1.0) -> threading.Timer:
    timer = threading.Timer(delay_s, os.kill, args=(pid, signal.SIGKILL))
    timer.start()
    return timer


def test_a_peer_error_that_comes_first_is_reported_as_the_death_behind_it(group) -> None:
    # A rank in a collective with a process that dies fails at once ("connection closed"), which can
    # reach the driver before Ray reports the death itself; here rank 0 fails that way at 1 s and
    # rank 1 is killed at 1.5 s. The death is what the driver must name, not the symptom.
    pids = group.pid()
    handles = [group.workers[0].fail_after.remote(1.0), group.workers[1].nap.remote(120)]
    _kill_later(pids[1], delay_s=1.5)
    with pytest.raises(WorkerDiedError, match=rf"^NapWorker rank 1 \(pid {pids[1]}, ") as info:
        group._resolve(handles)
    assert isinstance(info.value.__cause__, ray.exceptions.ActorDiedError)


def test_a_killed_worker_is_named_by_role_rank_pid_and_node(ray_cluster) -> None:
    colocated = create_colocated_worker_cls(
        {"actor_rollout": RayClassWithInitArgs(NapWorker), "critic": RayClassWithInitArgs(CriticNap)})
    pool = RayResourcePool([2], use_gpu=False)
    group = RayWorkerGroup(pool, colocated)
    try:
        critic = group.spawn(prefix_set={"actor_rollout", "critic"})["critic"]
        pids = critic.pid()
        _kill_later(pids[1])
        start = time.monotonic()
        with pytest.raises(WorkerDiedError) as info:
            critic.nap(120)
        assert time.monotonic() - start < 60   # not the nap's 120 s
        message = str(info.value)
        assert message.startswith(f"critic rank 1 (pid {pids[1]}, node {ray.util.get_node_ip_address()}, "
                                  f"Ray actor {group.worker_names[1]}) died")
        assert isinstance(info.value.__cause__, ray.exceptions.ActorDiedError)
        assert info.value.place.rank == 1 and info.value.place.pid == pids[1]
    finally:
        group.shutdown()
        pool.release()


def test_a_death_seen_through_a_future_is_mapped_to_its_rank(ray_cluster) -> None:
    pool = RayResourcePool([1], use_gpu=False)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(NapWorker))
    try:
        pid = group.pid()[0]
        refs = group.nap_async(120)           # non-blocking: the caller resolves the refs itself
        _kill_later(pid)
        with pytest.raises(ray.exceptions.RayActorError) as info:
            ray.get(refs[0])
        death = worker_death(info.value, [group])
        assert death is not None and death.place.rank == 0
        assert str(death).startswith(f"NapWorker rank 0 (pid {pid}, ")
        assert worker_death(ValueError("not a death"), [group]) is None
    finally:
        group.shutdown()
        pool.release()
