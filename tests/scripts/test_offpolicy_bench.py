"""`python -m scripts.bench.offpolicy` end to end, small: the demo world, a delaying retrieval
server, a sync run and a one_step_off run, one JSON object on stdout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_the_offpolicy_bench_prints_both_modes_figures_at_a_retrieval_latency(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.bench.offpolicy", "--pipeline", "one_step_off", "--retrieval_latency_ms", "150",
         # the smallest run that shows every figure: 3 steps (the push of step 1's weights happens
         # before batch 3 is rolled out, and s_per_step is over the steps after the first), one run of
         # each mode, 2 prompts x 5, sync on one worker and the pipeline on 1 train + 1 rollout worker
         # (the bench's defaults, 2 and 2 + 1, start two more processes: ~9 s of CPU each, and more a step)
         "--steps", "3", "--repeats", "1", "--train_batch_size", "2", "--sync_workers", "1", "--pipeline_workers", "2",
         "--workdir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)          # stdout is the JSON object alone
    assert result["retrieval_latency_ms"] == 150.0 and result["pipeline"] == "one_step_off"
    assert result["speedup"] == pytest.approx(result["sync_s_per_step"] / result["pipeline_s_per_step"], rel=0.01)
    assert [r["pipeline"] for r in result["runs"]] == ["sync", "one_step_off"]
    assert (result["sync_workers"], result["pipeline_workers"]) == (1, 2)
    assert result["max_staleness_seen"] == 1.0
    assert 0 < result["sync_host_cpu_util"] <= 1 and 0 < result["pipeline_host_cpu_util"] <= 1
    assert result["overlap_ceiling"] == pytest.approx(1 / result["sync_host_cpu_util"], rel=0.01)
    sync_run, piped_run = result["runs"]
    assert "weight_push_bytes" not in sync_run
    assert piped_run["weight_pushes"] >= 1 and piped_run["weight_push_s"] > 0 and piped_run["weight_push_bytes"] > 0
    for run in result["runs"]:
        assert run["s_per_step"] > 0 and run["searches_per_rollout"] > 0
        # the server's delay reached the rollouts: at least one 150 ms round of searches a step
        assert run["retrieval_s_per_step"] >= 0.15
