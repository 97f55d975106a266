"""Benchmark one PPO/GRPO training step end to end on this machine (CPU by default).

Builds the tiny Qwen2 (verl.utils.tiny_model) and a toy single-turn parquet, runs a few
steps of a fixed small config through `run_ppo` -> RayPPOTrainer with the real workers,
and prints one JSON object: mean per-stage seconds (timing_s/*, first step left out as
warm-up), tokens/s, and MFU of the actor update against a matmul peak measured on the
same machine (verl.utils.flops_counter.get_device_peak_flops).

    python -m scripts.bench.train_step                        # GRPO, 2 CPU workers
    python -m scripts.bench.train_step --adv gae --steps 4 --workers 2 --hidden 128
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np


def run_benchmark(adv: str = "grpo", steps: int = 4, workers: int = 2, batch_size: int = 8, n_agent: int = 4,
                  response_length: int = 32, hidden: int = 128, layers: int = 4) -> dict[str, Any]:
    """Train `steps` steps of the toy task; returns the summary that main() prints."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    from scripts.bench.toy_task import ContainsTokenReward, toy_overrides, write_toy_parquets
    from verl.trainer.main_ppo import compose_config, run_ppo
    from verl.utils.flops_counter import get_device_peak_flops
    from verl.utils.tiny_model import make_tiny_checkpoint

    with tempfile.TemporaryDirectory(prefix="bench_train_step_") as tmp:
        tmp_path = Path(tmp)
        model_dir = str(make_tiny_checkpoint(tmp_path / "model", hidden_size=hidden, num_layers=layers,
                                             intermediate_size=4 * hidden))
        paths = write_toy_parquets(tmp_path / "data", n_train=batch_size * steps, n_val=batch_size)
        overrides = toy_overrides(model_dir, paths, str(tmp_path / "ckpt"), adv_estimator=adv, n_workers=workers,
                                  batch_size=batch_size, n_agent=n_agent, response_length=response_length,
                                  steps=steps)
        cfg = compose_config([*overrides, "trainer.resume_mode=disable"])  # jsonl into tmp: stdout stays JSON
        tok = AutoTokenizer.from_pretrained(model_dir)
        history = run_ppo(cfg, reward_fn=ContainsTokenReward(tok))

    measured = history[1:] if len(history) > 1 else history
    timing = {k: float(np.mean([h[k] for h in measured if k in h]))
              for k in sorted({k for h in measured for k in h if k.startswith("timing_s/")})}
    tokens = float(np.mean([h["perf/total_num_tokens"] for h in measured]))
    return {
        "device": "cpu",
        "config": {"adv_estimator": adv, "steps": steps, "workers": workers, "prompts_per_step": batch_size,
                   "n_agent": n_agent, "response_length": response_length, "hidden": hidden, "layers": layers},
        "timing_s": timing,
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / timing["timing_s/step"],
        "mfu_actor_update": float(np.mean([h.get("perf/mfu/actor", 0.0) for h in measured])),
        "device_peak_tflops": get_device_peak_flops("cpu") / 1e12,
    }


def main() -> None:
    import verl.trainer.ppo.core_algos  # noqa: F401  (registers the built-in estimators)
    from verl.trainer.ppo.registry import adv_estimator_names

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adv", default="grpo", choices=adv_estimator_names())
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--n-agent", type=int, default=4)
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    result = run_benchmark(args.adv, args.steps, args.workers, args.batch_size, args.n_agent,
                           args.response_length, args.hidden, args.layers)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
