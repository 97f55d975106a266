"""scripts/gpu_checks/sharded_init.py on CPU (`--device cpu`): the GPU check's whole path (bf16
checkpoint, sharded init, from_pretrained comparison, the previous path's logits) runs here, so on
a lent GPU only the device placement under NCCL and the host-memory figure are new."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_sharded_init_gpu_check_passes_on_cpu() -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "scripts.gpu_checks.sharded_init", "--device", "cpu", "--hidden", "128",
         "--layers", "2", "--vocab", "1000"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
    summary = json.loads(done.stdout[done.stdout.index("{"):])
    assert summary["ok"] and summary["device"] == "cpu" and all(summary["checks"].values()), summary
    assert len(summary["checks"]) == 6   # the host-memory check runs on CUDA only
