"""CUDA paths that CPU tests can only pin by contract (issue 13 items 10, 11, 14), run on a real GPU.

    pytest -m gpu tests/gpu          # on a machine with one CUDA GPU; CI deselects `gpu`

Only what one GPU can show: NCCL across several GPUs (the SFT trainer and workers on 2+ ranks)
needs a multi-GPU machine.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def cuda_process_group():
    from verl.utils.device import get_dist_backend

    torch.cuda.set_device(0)
    dist.init_process_group(backend=get_dist_backend(), init_method=f"tcp://127.0.0.1:{_free_port()}",
                            rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_workers_group_reduces_cpu_and_cuda_tensors(cuda_process_group) -> None:
    on_cpu, on_gpu = torch.tensor([3.0]), torch.tensor([4.0], device="cuda")
    dist.all_reduce(on_cpu)     # gloo half of "cpu:gloo,cuda:nccl"
    dist.all_reduce(on_gpu)     # nccl half
    assert on_cpu.item() == 3.0 and on_gpu.item() == 4.0


def test_sft_trainer_picks_local_rank_gpu_and_reduces_there(monkeypatch: pytest.MonkeyPatch) -> None:
    from verl.trainer import fsdp_sft_trainer
    from verl.utils.device import dist_backend_for

    monkeypatch.setenv("LOCAL_RANK", "0")
    device = fsdp_sft_trainer._pick_device("cuda")
    assert device == torch.device("cuda", 0) and torch.cuda.current_device() == 0
    dist.init_process_group(backend=dist_backend_for(device), init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        # world_size=2 takes the collective path; a one-rank group sums to the value itself.
        assert fsdp_sft_trainer._global_sum(2.5, device, world_size=2) == 2.5
    finally:
        dist.destroy_process_group()


def test_offload_gives_reserved_memory_back() -> None:
    from verl.workers.fsdp_workers import _FSDPWorkerBase

    module = torch.nn.Linear(8192, 8192, device="cuda")        # 256 MiB of fp32 weights
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    _FSDPWorkerBase._offload(object(), module, None, OmegaConf.create({"param_offload": True}))
    torch.cuda.synchronize()
    after = torch.cuda.memory_reserved()
    assert module.weight.device.type == "cpu"
    # Without empty_cache the caching allocator would keep the 256 MiB reserved.
    assert before - after >= 200 * 2**20, (before, after)
