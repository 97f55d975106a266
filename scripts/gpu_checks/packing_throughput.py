"""Padded vs packed actor throughput on one GPU, packing through torch's varlen_attn (no flash-attn),
at the Qwen2.5-0.5B and Qwen2.5-3B shapes (example/model_configs; random weights), on the demo's
length distribution scaled to Search-R1's lengths (scripts/bench/packing.py does the work).

Prints ONE JSON object {"0.5b": report, "3b_gc": report} (each report: tokens/s and MFU per mode and
pass, packed / padded speedups, max |log-prob difference| of the first pass; at 3B also the padded
actor on 16 full rows of 2048 + 512, `padded.full_rows`: actor_throughput's measurement behind the
issue's 35 % baseline, on this device); --out writes it too, after each shape.

    python -m scripts.gpu_checks.packing_throughput                  # both shapes, ~2 minutes on an H100
    python -m scripts.gpu_checks.packing_throughput --only 0.5b --length-scale 4
    python -m scripts.gpu_checks.packing_throughput --device cpu --tiny   # the same path on CPU (tests)

Not run on a GPU yet (issue 35): the figures of the next GPU run go in docs/packing.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from scripts.bench import packing
from scripts.gpu_checks import memory_plan_vs_allocated as check

REPO = Path(__file__).resolve().parents[2]
# name -> (config.json, rows, micro, extra overrides, full rows (prompt, response) the padded actor is
# also timed on: actor_throughput's shape of the 35 % baseline, measured again on this device)
SHAPES: dict[str, tuple[str, int, int, tuple[str, ...], tuple[int, int] | None]] = {
    "0.5b": ("", 32, 8, (), None),    # "" = Qwen2.5-0.5B's config (memory_plan_vs_allocated.QWEN2_5_0_5B)
    "3b_gc": ("example/model_configs/qwen2.5-3b/config.json", 16, 4,
              ("actor_rollout_ref.model.enable_gradient_checkpointing=true",), (2048, 512)),
}
TINY_FULL_ROWS = (16, 8)


def model_config(path: str) -> dict[str, Any]:
    return json.loads((REPO / path).read_text()) if path else check.QWEN2_5_0_5B


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--only", help=f"comma-separated shapes of {list(SHAPES)}")
    parser.add_argument("--tiny", action="store_true", help="the tiny CPU model instead of each shape (tests)")
    parser.add_argument("--length-scale", type=float, default=4.0,
                        help="multiply the demo's lengths (4: prompts ~512, responses ~280, up to ~800)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="also write the JSON report to this file")
    parser.add_argument("overrides", nargs="*", help="trainer-config overrides, key=value (every shape)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run on a GPU machine, or pass --device cpu --tiny")
    names = args.only.split(",") if args.only else list(SHAPES)
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        raise SystemExit(f"--only {unknown}: not one of {list(SHAPES)}")
    report: dict[str, Any] = {}
    for name in names:
        path, rows, micro, extra, full = SHAPES[name]
        config = check.TINY if args.tiny else model_config(path)
        if args.tiny:
            rows, micro, full = 4, 2, full and TINY_FULL_ROWS
        full_rows = check.BatchShape(rows, micro, *full) if full else None
        report[name] = packing.run_bench(config, rows, micro, args.device, [*extra, *args.overrides], args.repeats,
                                         scale=args.length_scale, full_rows=full_rows)
        check.write_report(report, args.out, echo=False)    # after each shape: a later failure keeps these
    check.write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
