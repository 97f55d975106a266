"""verl.utils.device: the CUDA-only calls are made where they must be (issue 13 item 14), pinned on CPU."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from verl.utils import device as device_utils


@pytest.fixture
def empty_cache_calls(monkeypatch: pytest.MonkeyPatch) -> list[None]:
    calls: list[None] = []
    monkeypatch.setattr(device_utils, "empty_cache", lambda: calls.append(None))
    return calls


def test_empty_cache_releases_the_cuda_cache_only_when_cuda_is_there(monkeypatch: pytest.MonkeyPatch) -> None:
    released: list[None] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: released.append(None))
    monkeypatch.setattr(device_utils, "is_cuda_available", lambda: False)
    device_utils.empty_cache()
    assert released == []
    monkeypatch.setattr(device_utils, "is_cuda_available", lambda: True)
    device_utils.empty_cache()
    assert released == [None]


@pytest.mark.parametrize("flag", ["param_offload", "grad_offload", "optimizer_offload"])
def test_offload_gives_the_freed_memory_back(flag: str, empty_cache_calls: list[None]) -> None:
    from verl.workers.fsdp_workers import _FSDPWorkerBase

    module = nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(module.parameters())
    _FSDPWorkerBase._offload(object(), module, optimizer, OmegaConf.create({flag: True}))
    assert len(empty_cache_calls) == 1


def test_no_offload_no_cache_release(empty_cache_calls: list[None]) -> None:
    from verl.workers.fsdp_workers import _FSDPWorkerBase

    _FSDPWorkerBase._offload(object(), nn.Linear(4, 4), None, OmegaConf.create({}))
    assert empty_cache_calls == []


def test_leaving_generation_reshards_then_releases_the_cache(empty_cache_calls: list[None]) -> None:
    from verl.workers.sharding_manager.fsdp_hf import FSDPUnshardedForGeneration

    with FSDPUnshardedForGeneration(nn.Linear(4, 4)):
        assert empty_cache_calls == []
    assert len(empty_cache_calls) == 1
