"""@register and the dispatch table, exercised in-process (no Ray) through a minimal WorkerGroup."""

from __future__ import annotations

import pytest
import torch

from verl.protocol import DataProto
from verl.single_controller.base import Dispatch, Execute, Worker, WorkerGroup, register
from verl.single_controller.base.decorator import (
    DISPATCH_TABLE,
    MAGIC_ATTR,
    MeshRank,
    check_mesh,
    dispatch_dp_compute_proto,
    get_method_spec,
)
from verl.single_controller.base.worker import read_dist_env


class InProcessGroup(WorkerGroup):
    """Runs each rank's call directly on local instances: the binding logic without Ray."""

    def __init__(self, workers: list[Worker]) -> None:
        super().__init__()
        self._workers = workers
        self._bind_worker_method(type(workers[0]))

    def _execute_ranks(self, method_name, ranks, rank_args, rank_kwargs):
        return [
            getattr(self._workers[r], method_name)(*a, **k) for r, a, k in zip(ranks, rank_args, rank_kwargs, strict=True)
        ]

    def _resolve(self, handles):
        return handles


class Doubler(Worker):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.my_rank = rank

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def double(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"y": data.batch["x"] * 2 + 100 * self.my_rank})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def metrics_only(self, data: DataProto) -> DataProto:
        return DataProto(meta_info={"metrics": {"rows": [len(data)]}})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def only_zero(self) -> int:
        return self.my_rank


def test_every_dispatch_mode_has_one_table_row():
    assert set(DISPATCH_TABLE) == set(Dispatch)
    with pytest.raises(TypeError):
        DISPATCH_TABLE[Dispatch.ONE_TO_ALL] = None  # fixed at import time


def test_register_attaches_spec_without_changing_local_calls():
    worker = Doubler(rank=0)
    spec = get_method_spec(Doubler.double)
    assert spec.dispatch_mode is Dispatch.DP_COMPUTE_PROTO and spec.blocking
    assert getattr(Doubler.double, MAGIC_ATTR) is spec
    out = worker.double(DataProto.from_dict({"x": torch.tensor([1, 2])}))
    assert out.batch["y"].tolist() == [2, 4]
    with pytest.raises(TypeError, match="dispatch_mode"):
        register(dispatch_mode="dp")


def test_dp_compute_proto_pads_and_records_pad_size():
    call = dispatch_dp_compute_proto(3, DataProto.from_dict({"x": torch.arange(7)}), 5)
    assert call.pad_size == 2
    assert [len(args[0]) for args in call.rank_args] == [3, 3, 3]
    assert [args[1] for args in call.rank_args] == [5, 5, 5]  # non-DataProto args go to every rank


def test_dp_compute_proto_rejects_arguments_of_different_lengths():
    a, b = DataProto.from_dict({"x": torch.arange(4)}), DataProto.from_dict({"x": torch.arange(3)})
    with pytest.raises(ValueError, match="differ in length"):
        dispatch_dp_compute_proto(2, a, other=b)


def test_group_binds_methods_and_strips_padding():
    group = InProcessGroup([Doubler(0), Doubler(1)])
    out = group.double(DataProto.from_dict({"x": torch.arange(5)}))
    # Rank 0 got rows 0-2, rank 1 rows 3-4 plus one padding row that must be gone.
    assert out.batch["y"].tolist() == [0, 2, 4, 106, 108]
    assert group.only_zero() == 0
    # A row-less answer (only metrics) on an odd batch is not un-padded; every rank's metrics are kept.
    assert group.metrics_only(DataProto.from_dict({"x": torch.arange(5)})).meta_info == {"metrics": {"rows": [3, 3]}}
    assert set(group.bound_methods) >= {"double", "only_zero", "get_dist_info"}


def test_worker_reads_its_rank_from_the_environment(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    worker = Worker()
    assert (worker.rank, worker.world_size) == (2, 4)
    assert worker.get_master_addr_port() == ("127.0.0.1", "29500")

    class ForgetsSuperInit(Worker):
        def __init__(self) -> None:
            pass

    assert ForgetsSuperInit().rank == 2
    monkeypatch.setenv("RANK", "4")
    with pytest.raises(ValueError, match="RANK=4 is outside WORLD_SIZE=4"):
        read_dist_env()
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="RANK='x'"):
        read_dist_env()


class TensorParallelEcho(Worker):
    """Rank r of a world of 4 in tensor-parallel groups of 2: {0,1} and {2,3} (vLLM's layout)."""

    TP = 2

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.my_rank = rank
        self.seen: list[int] = []
        self.set_mesh_rank("rollout", MeshRank(rank // self.TP, 4 // self.TP, rank % self.TP == 0))

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, mesh="rollout")
    def echo(self, data: DataProto) -> DataProto:
        self.seen = data.batch["x"].tolist()
        return DataProto.from_dict({"y": data.batch["x"] * 10 + self.my_rank})


def test_a_tensor_parallel_group_gets_the_same_rows_and_answers_once():
    workers = [TensorParallelEcho(rank) for rank in range(4)]
    group = InProcessGroup(workers)
    out = group.echo(DataProto.from_dict({"x": torch.arange(5)}))
    # Two dp ranks: rows 0-2 to workers 0 and 1, rows 3-4 (+1 padding row) to workers 2 and 3.
    assert [w.seen for w in workers] == [[0, 1, 2], [0, 1, 2], [3, 4, 0], [3, 4, 0]]
    # Results from each group's collecting worker (0 and 2) only, padding removed.
    assert out.batch["y"].tolist() == [0, 10, 20, 32, 42]
    assert group.mesh_ranks("rollout") == [MeshRank(0, 2, True), MeshRank(0, 2, False),
                                          MeshRank(1, 2, True), MeshRank(1, 2, False)]
    # A mesh a worker never declared is every worker on its own.
    assert workers[1].get_mesh_rank("other") == MeshRank(0, 1, True)


def test_a_mesh_with_a_missing_collector_is_refused():
    with pytest.raises(ValueError, match="exactly one collecting worker"):
        check_mesh("rollout", [MeshRank(0, 2, True), MeshRank(0, 2, True), MeshRank(1, 2, False), MeshRank(1, 2, False)])
    with pytest.raises(ValueError, match="disagree"):
        check_mesh("rollout", [MeshRank(0, 2, True), MeshRank(0, 1, True)])
    with pytest.raises(ValueError, match="mesh="):
        register(dispatch_mode=Dispatch.ONE_TO_ALL, mesh="rollout")
