"""The host plan of vLLM's level-1 sleep (LoRA, lora_sync=adapter; review finding 1): the base backed up
segment by segment (2 MiB units; torch's pinned rounding capped at 16 MiB by the workers'
PYTORCH_ALLOC_CONF), the LoRA stacked buffers, the runtime / cudagraph pools (an estimate); and
preflight's verdict, from the node's own memory when trainer.host_memory_gib is null."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.utils.test_host_memory_plan import OFFLOADED, _cfg
from verl.trainer.preflight import PreflightReport
from verl.trainer.preflight_memory import check_host_memory
from verl.utils.host_memory_plan import (
    VLLM_RUNTIME_POOLS_ESTIMATE,
    host_fit,
    pinned_backup_bytes,
    plan_host_memory,
)
from verl.utils.memory_plan import GIB

MIB = 1024 ** 2
LORA = ("actor_rollout_ref.model.lora_rank=64", "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.lora_sync=adapter")


def _segment(nbytes: int) -> int:
    return -(-nbytes // (2 * MIB)) * 2 * MIB


def test_pinned_backups_are_2_mib_segments_rounded_to_a_power_of_two_only_up_to_the_threshold() -> None:
    assert pinned_backup_bytes(1) == 2 * MIB
    assert pinned_backup_bytes(9 * MIB) == 16 * MIB                 # 10 MiB segment, under 16: a power of two
    assert pinned_backup_bytes(17 * MIB + 1) == 18 * MIB           # above: the segment as it is
    assert pinned_backup_bytes(272 * 10 ** 6, threshold_mb=None) == 512 * MIB   # torch's default: gate_up 2x


def test_the_7b_level_1_plan_is_the_rounded_sum_of_the_engines_segments() -> None:
    # Qwen2.5-7B, TP=1, bf16: the engine's tensors, written out by hand (vocab 152064 is a multiple of 64)
    h, inter, layers, vocab, q, kv = 3584, 18944, 28, 152064, 3584, 512
    big = [vocab * h] * 2 + [(q + 2 * kv) * h, q * h, 2 * inter * h, h * inter] * layers
    small = [h, h, q + 2 * kv] * layers + [h]                         # norms, qkv bias, final norm: one segment
    weights = sum(_segment(2 * n) for n in big) + 2 * MIB
    assert all(2 * n > 16 * MIB for n in big) and 2 * sum(small) < 2 * MIB
    assert weights / GIB == pytest.approx(14.29, abs=0.01)         # vs 26.8 GiB with torch's default rounding
    # LoRA stacked buffers, max_lora_rank 64, all-linear: r x (in + out) of qkv, o, gate_up, down = 90,112 a layer
    lora = 2 * 64 * 90112 * layers
    buffers = 2 * 131072 * 128 + 4 * 4 * 28                           # rotary table and scales, as at level 2
    training = {p.name: p for p in plan_host_memory(_cfg(*OFFLOADED[:10], *LORA)).phases}["training"]
    items = {k: v for k, v in training.certain.items() if k.startswith("vLLM")}
    assert sorted(items.values()) == sorted([8 * (weights + buffers), 8 * lora])
    assert list(training.estimated.values()) == [8 * VLLM_RUNTIME_POOLS_ESTIMATE["cuda graphs"]]
    need = training.total / GIB
    assert 8 * 14.29 + 16 < need < 8 * 14.29 + 20                     # ~132 GiB a node (the plan said 113)
    fits, message = host_fit(plan_host_memory(_cfg(*OFFLOADED[:10], *LORA)).phases, 100)
    assert fits is False and "trainer.host_memory_gib=100" in message and "vLLM level-1 sleep" in message
    assert host_fit(plan_host_memory(_cfg(*OFFLOADED[:10], *LORA)).phases, 200)[0] is True
    # only the targeted (fused) modules get stacked buffers: q_proj alone still stacks all of qkv_proj
    q_only = {p.name: p for p in plan_host_memory(_cfg(*OFFLOADED[:10], *LORA,
                                                        "actor_rollout_ref.model.target_modules=[q_proj]")).phases}
    (lora_q,) = [v for k, v in q_only["training"].certain.items() if "stacked" in k]
    assert lora_q == 8 * 2 * 64 * (3 * h + q + 2 * kv) * layers


def _report(monkeypatch: pytest.MonkeyPatch, *overrides: str, total_gib: float = 64) -> PreflightReport:
    import psutil

    from verl.trainer import preflight_memory

    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=int(total_gib * GIB)))
    monkeypatch.setattr(preflight_memory, "on_a_gpu_node", lambda: True)   # this machine is a node of the run
    monkeypatch.setattr(preflight_memory, "CGROUP_LIMITS", ())              # no container limit, no Slurm job
    monkeypatch.delenv("SLURM_MEM_PER_NODE", raising=False)
    report = PreflightReport()
    check_host_memory(_cfg(*OFFLOADED[:10], *LORA, *overrides), report, None)
    return report


def test_preflight_takes_the_nodes_memory_when_host_memory_gib_is_null_and_says_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    small = _report(monkeypatch, total_gib=64)
    assert small.host_fits is False and [e["key"] for e in small.errors] == ["trainer.host_memory_gib"]
    assert "MemTotal (psutil), 64.0 GiB" in small.host_message and "trainer.host_memory_gib=null" in small.host_message
    big = _report(monkeypatch, total_gib=512)
    assert big.host_fits is True and not big.errors and "MemTotal (psutil), 512.0 GiB" in big.host_message
    # a value given wins over the node's memory
    given = _report(monkeypatch, "trainer.host_memory_gib=100", total_gib=512)
    assert given.host_fits is False and "trainer.host_memory_gib=100" in given.host_message
    assert "psutil" not in given.host_message


def test_preflight_from_a_machine_that_is_not_a_node_gives_no_verdict_and_says_why(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from verl.trainer import preflight_memory

    monkeypatch.setattr(preflight_memory, "on_a_gpu_node", lambda: False)
    report = PreflightReport()
    check_host_memory(_cfg(*OFFLOADED[:10], *LORA), report, None)
    assert report.host_fits is None and not report.errors
    assert "has no GPU, so it is not taken for a node of the run: give trainer.host_memory_gib" in report.host_message


def test_a_jobs_memory_is_the_least_of_memtotal_its_cgroup_limit_and_slurms(tmp_path) -> None:
    import psutil

    from verl.trainer.preflight_memory import machine_memory_bytes

    total = int(psutil.virtual_memory().total)
    assert machine_memory_bytes({}, ()) == (total, "MemTotal (psutil)")
    unlimited, limited = tmp_path / "memory.max", tmp_path / "limit_in_bytes"
    unlimited.write_text("max\n")
    limited.write_text(f"{total // 2}\n")
    assert machine_memory_bytes({}, (str(unlimited),)) == (total, "MemTotal (psutil)")
    assert machine_memory_bytes({}, (str(unlimited), str(limited))) == (total // 2, f"cgroup memory limit ({limited})")
    slurm_mib = total // 4 // 1024 ** 2
    assert machine_memory_bytes({"SLURM_MEM_PER_NODE": str(slurm_mib)}, (str(limited),)) == (
        slurm_mib * 1024 ** 2, "Slurm job's SLURM_MEM_PER_NODE")



def test_a_ray_session_in_the_process_does_not_change_the_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    """Preflight starts no Ray: a session this process holds (a notebook, an earlier test) is not asked."""
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": {"GPU": 8, "memory": 1 * GIB}}])
    report = _report(monkeypatch, total_gib=512)
    assert report.host_fits is True and "MemTotal (psutil), 512.0 GiB" in report.host_message
