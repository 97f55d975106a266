"""Level-1 sleep's pinned-allocator settings (verl/trainer/main_ppo.py `pinned_alloc_conf`), on a real GPU.

    pytest -m gpu tests/gpu/test_pinned_backups.py        # one CUDA GPU; CI deselects `gpu`

vLLM's level-1 sleep backs each weight segment up with a pinned host tensor, frees them all at wake and
asks for the same sizes again at the next sleep. With torch's round threshold alone, a block above it
keeps its exact size yet is cached in its power-of-two bucket, so a 32 MiB request can get a cached
26 MiB block back (Qwen2.5-7B's qkv_proj and o_proj segments): the backup's copy overruns it. With the
cache capped too (our setting), blocks above 16 MiB are freed, not cached: every backup gets its size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from verl.trainer.main_ppo import pinned_alloc_conf

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MIB = 1 << 20
SLEEP_WAKE_SLEEP = """
import json, torch
torch.cuda.init()
a = torch.empty(32 << 20, dtype=torch.uint8, pin_memory=True)   # first sleep: qkv_proj's backup
b = torch.empty(26 << 20, dtype=torch.uint8, pin_memory=True)   # o_proj's
del a, b                                                         # wake: both freed
c = torch.empty(32 << 20, dtype=torch.uint8, pin_memory=True)   # next sleep: qkv_proj's again
stats = torch.cuda.host_memory_stats()
print("STATS " + json.dumps({"allocated": stats["allocated_bytes.current"], "c": c.numel()}))
"""


def _pinned_bytes_after_sleep_wake_sleep(alloc_conf: str) -> int:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    out = subprocess.run([sys.executable, "-c", SLEEP_WAKE_SLEEP], env={**env, "PYTORCH_ALLOC_CONF": alloc_conf},
                         capture_output=True, text=True, timeout=120, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("STATS "))
    return json.loads(line.removeprefix("STATS "))["allocated"]


def test_level_one_settings_give_every_backup_a_block_of_its_own_size() -> None:
    ours = _pinned_bytes_after_sleep_wake_sleep(pinned_alloc_conf({})["PYTORCH_ALLOC_CONF"])
    threshold_only = _pinned_bytes_after_sleep_wake_sleep("pinned_max_round_threshold_mb:16")
    # ours: a and b were freed (above the 16 MiB cache cap), c is a fresh 32 MiB block
    assert ours == 32 * MIB, (ours, threshold_only)
    # the hazard the cache cap removes (torch 2.13): both cached, the 32 MiB request handed b's 26 MiB block
    print(f"threshold only: {threshold_only / MIB:.0f} MiB held (58 = the 26 MiB block reused for 32 MiB)")
