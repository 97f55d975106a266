"""RayWorkerGroup on a CPU-only local Ray cluster: every dispatch mode, futures, gloo, colocated roles."""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import numpy as np
import pytest
import ray
import ray.cloudpickle
import torch

from verl.protocol import DataProto, DataProtoFuture
from verl.single_controller.base import Dispatch, Execute, Worker, register
from verl.single_controller.ray import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    create_colocated_worker_cls,
)
from verl.utils import batch_keys as K
from verl.utils.device import get_dist_backend

# pytest imports this file under a name Ray's workers cannot import; ship its classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class EchoWorker(Worker):
    def __init__(self, scale: int = 1) -> None:
        super().__init__()
        self.scale = scale
        self.bumps = 0

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def whoami(self, tag: str) -> dict:
        keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
        return {"tag": tag, "rank": self.rank, "world_size": self.world_size, **{k: os.environ[k] for k in keys}}

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def add_rank(self, x: int) -> int:
        return x + self.rank

    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def rank_zero_rank(self) -> int:
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def bump(self) -> int:
        self.bumps += 1
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get_bumps(self) -> int:
        return self.bumps

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def log_call(self, tag: str) -> None:
        self.calls = [*getattr(self, "calls", []), tag]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def call_log(self) -> list[str]:
        return list(getattr(self, "calls", []))

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def square(self, x: int, offset: int = 0) -> tuple[int, int]:
        return self.rank, x * x + offset

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:
        """Reads input_ids; writes values = scale * input_ids and the rank that did the row."""
        values = (data.batch[K.INPUT_IDS] * self.scale).float()
        return DataProto.from_dict({K.VALUES: values}, {"rank": np.full(len(data), self.rank, dtype=object)})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def compute_values_async(self, data: DataProto) -> DataProto:
        return self.compute_values(data)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def apply(self, fn, data: DataProto) -> DataProto:
        return fn(data)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def row_metrics(self, data: DataProto) -> dict:
        return {"rank": self.rank, "rows": len(data)}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def count_rows(self, data: DataProto) -> int:
        return len(data)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def gloo_all_reduce(self, value: float) -> float:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group(backend=get_dist_backend(), timeout=timedelta(seconds=60))
        tensor = torch.tensor([value * (self.rank + 1)])
        dist.all_reduce(tensor)
        return float(tensor.item())


def negate_values(data: DataProto) -> DataProto:
    return DataProto.from_dict({K.VALUES: -data.batch[K.INPUT_IDS].float()})


def negate_computed_values(data: DataProto) -> DataProto:
    return DataProto.from_dict({K.VALUES: -data.batch[K.VALUES]})


def rows(n: int) -> DataProto:
    return DataProto.from_dict(
        {K.INPUT_IDS: torch.arange(n).view(n, 1)}, {K.UID: [f"u{i}" for i in range(n)]}, {K.META_TEMPERATURE: 1.0}
    )


@pytest.fixture(scope="module")
def echo_group(ray_cluster):
    pool = RayResourcePool([2], use_gpu=False)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(EchoWorker, scale=10))
    yield group
    group.shutdown()
    pool.release()


def test_pool_without_gpus_reserves_cpu_only_bundles(echo_group):
    pool = echo_group._resource_pool
    assert pool.bundle() == {"CPU": 1.0}
    assert pool.world_size == 2 and len(pool.pgs) == 1


def test_workers_get_rank_and_shared_rendezvous_env(echo_group):
    infos = echo_group.whoami("hello")
    assert [i["rank"] for i in infos] == [0, 1]
    assert [i["RANK"] for i in infos] == ["0", "1"] and {i["WORLD_SIZE"] for i in infos} == {"2"}
    assert [i["LOCAL_RANK"] for i in infos] == ["0", "1"]
    assert len({(i["MASTER_ADDR"], i["MASTER_PORT"]) for i in infos}) == 1
    assert {i["tag"] for i in infos} == {"hello"}
    assert echo_group.world_size == 2 and len(echo_group.worker_names) == 2


def test_all_to_all_passes_args_to_every_worker(echo_group):
    assert echo_group.add_rank(5) == [5, 6]


def test_rank_zero_dispatch_returns_only_rank_zero_result(echo_group):
    assert echo_group.rank_zero_rank() == 0


def test_execute_rank_zero_runs_on_rank_zero_only(echo_group):
    before = echo_group.get_bumps()
    assert echo_group.bump() == 0
    after = echo_group.get_bumps()
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 0]


def test_dp_compute_gives_worker_i_element_i(echo_group):
    assert echo_group.square([2, 3], offset=[0, 100]) == [(0, 4), (1, 109)]
    with pytest.raises(ValueError, match="positional argument 0 must be a list of length world_size=2"):
        echo_group.square([1, 2, 3])


def test_dp_compute_proto_odd_batch_comes_back_whole_and_in_order(echo_group):
    out = echo_group.compute_values(rows(7))
    assert len(out) == 7
    assert out.batch[K.VALUES].view(-1).tolist() == [10.0 * i for i in range(7)]
    # 7 rows padded to 8: rank 0 did rows 0-3, rank 1 rows 4-6 (its padding row was dropped).
    assert out.non_tensor_batch["rank"].tolist() == [0, 0, 0, 0, 1, 1, 1]


def test_dp_compute_proto_with_func_ships_the_function(echo_group):
    out = echo_group.apply(negate_values, rows(5))
    assert out.batch[K.VALUES].view(-1).tolist() == [-float(i) for i in range(5)]


def test_dp_compute_metric_collects_one_result_per_worker(echo_group):
    assert echo_group.row_metrics(rows(6)) == [{"rank": 0, "rows": 3}, {"rank": 1, "rows": 3}]


def test_non_blocking_call_returns_future_that_resolves(echo_group):
    future = echo_group.compute_values_async(rows(7))
    assert isinstance(future, DataProtoFuture)
    out = future.get()
    assert out.batch[K.VALUES].view(-1).tolist() == [10.0 * i for i in range(7)]


def test_future_argument_is_materialized_on_driver_and_in_workers(echo_group):
    # DP_COMPUTE_PROTO resolves a future argument on the driver (it needs the length to pad) ...
    chained = echo_group.apply(negate_computed_values, echo_group.compute_values_async(rows(3)))
    assert chained.batch[K.VALUES].view(-1).tolist() == [-10.0 * i for i in range(3)]
    # ... while ONE_TO_ALL ships the future itself and each worker resolves it.
    assert echo_group.count_rows(echo_group.compute_values_async(rows(3))) == [3, 3]


def test_execute_all_and_rank_zero_helpers(echo_group):
    assert [i["rank"] for i in echo_group.execute_all("whoami", "x")] == [0, 1]
    assert echo_group.execute_rank_zero("rank_zero_rank") == 0
    refs = echo_group.execute_all_async("add_rank", 1)
    assert ray.get(refs) == [1, 2]


def test_two_workers_form_a_gloo_group_and_all_reduce(echo_group):
    # rank r contributes 3 * (r + 1): 3 + 6
    assert echo_group.gloo_all_reduce(3.0) == [9.0, 9.0]


def test_two_threads_calling_one_group_reach_every_rank_in_the_same_order(echo_group):
    # A pipelined run's producer pushes weights while the trainer calls the same workers: every
    # rank must run the calls in one order, or their collectives would cross (gloo aborts).
    import threading

    def caller(name: str) -> None:
        for i in range(150):
            echo_group.log_call(f"{name}{i}")

    threads = [threading.Thread(target=caller, args=(name,)) for name in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    logs = echo_group.call_log()
    assert len(logs[0]) == 300 and all(log == logs[0] for log in logs)


def test_from_detached_reattaches_by_name(echo_group):
    again = RayWorkerGroup.from_detached(echo_group.worker_names, RayClassWithInitArgs(EchoWorker))
    assert again.add_rank(1) == [1, 2]


def test_dataproto_pickle_round_trip_through_object_store(ray_cluster):
    data = rows(4)
    restored = ray.get(ray.put(data))
    assert torch.equal(restored.batch[K.INPUT_IDS], data.batch[K.INPUT_IDS])
    assert restored.non_tensor_batch[K.UID].tolist() == data.non_tensor_batch[K.UID].tolist()
    assert restored.meta_info == data.meta_info


# ----------------------------------------------------------------------------- colocated roles
class PolicyRole(Worker):
    def __init__(self, bonus: float) -> None:
        super().__init__()
        self.bonus = bonus

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def describe(self) -> tuple[str, int]:
        return "policy", os.getpid()

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """Reads input_ids; writes old_log_probs."""
        return DataProto.from_dict({K.OLD_LOG_PROBS: data.batch[K.INPUT_IDS].float() + self.bonus})


class CriticRole(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def describe(self) -> tuple[str, int]:
        return "critic", os.getpid()

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:
        """Reads input_ids; writes values."""
        return DataProto.from_dict({K.VALUES: data.batch[K.INPUT_IDS].float() * 2})


def test_colocated_roles_share_processes_and_answer_their_methods(ray_cluster):
    colocated = create_colocated_worker_cls(
        {"actor_rollout": RayClassWithInitArgs(PolicyRole, bonus=0.5), "critic": RayClassWithInitArgs(CriticRole)}
    )
    pool = RayResourcePool([2], use_gpu=False)
    group = RayWorkerGroup(pool, colocated)
    try:
        roles = group.spawn(prefix_set={"actor_rollout", "critic"})
        policy, critic = roles["actor_rollout"], roles["critic"]
        policy_desc, critic_desc = policy.describe(), critic.describe()
        assert [d[0] for d in policy_desc] == ["policy", "policy"]
        assert [d[0] for d in critic_desc] == ["critic", "critic"]
        assert [d[1] for d in policy_desc] == [d[1] for d in critic_desc]  # same actor processes
        batch = rows(5)
        batch.union(policy.compute_log_prob(batch))
        batch.union(critic.compute_values(batch))
        assert batch.batch[K.OLD_LOG_PROBS].view(-1).tolist() == [i + 0.5 for i in range(5)]
        assert batch.batch[K.VALUES].view(-1).tolist() == [2.0 * i for i in range(5)]
        with pytest.raises(KeyError, match="ref"):
            group.spawn(prefix_set={"ref"})
    finally:
        group.shutdown()
        pool.release()


def test_rendezvous_ports_are_drawn_below_the_ephemeral_range_and_bind():
    # The kernel hands ports of 32768+ to outgoing connections at any moment: a rendezvous port from
    # there could be taken before the store binds it (a CI run met EADDRINUSE so).
    import socket

    from verl.single_controller.base.worker import get_free_port

    ports = {get_free_port() for _ in range(20)}
    assert all(20000 <= port < 32767 for port in ports) and len(ports) > 1
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", ports.pop()))
