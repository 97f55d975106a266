"""`python -m scripts.bench.async_rollout --counters` end to end, small: the demo's world, warm start
and BM25 server, sync and async in process, one JSON object on stdout with both modes' counters."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]



def test_the_counters_bench_prints_both_modes_counts() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.bench.async_rollout", "--counters", "--prompts", "2", "--n_agent", "2",
         "--repeats", "1"], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)          # stdout is the JSON object alone
    assert result["workload"]["rows"] == 4 and result["speedup"] > 0
    for mode in ("sync", "async"):
        counts = result["counters"][mode]
        assert counts["generated_tokens"] > 0 and counts["decode_forwards"] > 0 and counts["prefill_forwards"] >= 1
        assert counts["forwards"] == counts["prefill_forwards"] + counts["decode_forwards"]
        assert counts["prefill_tokens"] <= counts["prefill_positions"]
    # The async engine's step reads the device once (its ids and log-probs); joins and finishes add nothing.
    engine = result["counters"]["async"]
    assert set(engine["host_syncs_outside_forward"]) == {"tolist"} and engine["host_syncs_per_step"] <= 1.5
