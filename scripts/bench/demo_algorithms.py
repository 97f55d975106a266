"""The demo once per policy loss, advantage estimator and recipe: the table in docs/algorithms.md.

Each row is one `python -m scripts.demo.run_demo` (GRPO's demo settings: the shipped warm start, 12
steps, 32 prompts x 5 rollouts) with the row's overrides, run one after another in a subprocess, its
outputs under <out>/<row>/ and its checkpoints under verl_checkpoints/demo-table-<row>. Per row it
prints ONE JSON line (and appends it to <out>/table.jsonl): validation EM before and after, one-hop and
two-hop EM after, searches per rollout in the last step, RL and whole-command seconds, the mean
1-minute load average while it ran (EM does not depend on load: seeded, greedy validation; minutes
do), and the error tail when the run failed.

    python -m scripts.bench.demo_algorithms                     # every row (~2 h on an idle 2-core CPU)
    python -m scripts.bench.demo_algorithms --rows dapo,gspo    # some rows
    python -m scripts.bench.demo_algorithms --list
    python -m scripts.bench.demo_algorithms --markdown          # the table of <out>/table.jsonl (docs/algorithms.md)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from scripts.demo.build import ONEHOP_SOURCE, TWOHOP_SOURCE

LOSS = "actor_rollout_ref.actor.policy_loss.loss_mode"
ADV = "algorithm.adv_estimator"

# row name -> the demo's arguments (demo.recipe=... or Hydra overrides of the GRPO demo).
ROWS: dict[str, tuple[str, ...]] = {
    # recipes (scripts/demo/recipes.py)
    "dapo": ("demo.recipe=dapo",),
    "gspo": ("demo.recipe=gspo",),
    "drgrpo": ("demo.recipe=drgrpo",),
    "reinforce_plus_plus_baseline": ("demo.recipe=reinforce_plus_plus_baseline",),
    "rloo": ("demo.recipe=rloo",),
    # the GRPO demo itself: vanilla loss, grpo estimator
    "grpo": (),
    # policy losses on GRPO's advantages (gspo is its recipe above: it needs its own clip ratios)
    "loss_sapo": (f"{LOSS}=sapo",),
    "loss_gpg": (f"{LOSS}=gpg",),
    "loss_clip_cov": (f"{LOSS}=clip_cov",),
    "loss_kl_cov": (f"{LOSS}=kl_cov",),
    "loss_geo_mean": (f"{LOSS}=geo_mean",),
    "loss_cispo": (f"{LOSS}=cispo",),
    # advantage estimators with the vanilla loss (rloo, reinforce_plus_plus_baseline: recipes above)
    "adv_grpo_passk": (f"{ADV}=grpo_passk",),
    "adv_rloo_vectorized": (f"{ADV}=rloo_vectorized",),
    "adv_reinforce_plus_plus": (f"{ADV}=reinforce_plus_plus",),
    "adv_remax": (f"{ADV}=remax",),
    "adv_opo": (f"{ADV}=opo",),
    "adv_gpg": (f"{ADV}=gpg", f"{LOSS}=gpg"),    # GPG is the pair (estimator and loss), as in its paper
    "adv_optimal_token_baseline": (f"{ADV}=optimal_token_baseline", "actor_rollout_ref.actor.calculate_sum_pi_squared=true"),
    # LoRA (docs/demo.md "With a LoRA adapter"): rank 32 on every linear layer, alpha 64, 10x GRPO's lr
    "lora_r32": ("actor_rollout_ref.model.lora_rank=32", "actor_rollout_ref.model.lora_alpha=64",
                 "actor_rollout_ref.actor.optim.lr=1e-3"),
}


class LoadSampler:
    """The 1-minute load average every 10 s while a row runs."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(10.0):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def mean(self) -> float | None:
        return round(sum(self.samples) / len(self.samples), 2) if self.samples else None


def last_metric(metrics_path: Path, key: str) -> float | None:
    """`key` in the last training record of a metrics.jsonl that has it."""
    value = None
    if metrics_path.exists():
        for line in metrics_path.read_text().splitlines():
            record = json.loads(line)
            if key in record:
                value = record[key]
    return value


def run_row(name: str, out_root: Path) -> dict:
    out_dir = out_root / name
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "scripts.demo.run_demo", *ROWS[name], f"demo.output_dir={out_dir}",
           f"trainer.experiment_name=demo-table-{name}", "trainer.progress_bar=false"]
    start = time.time()
    with LoadSampler() as load, open(out_dir / "run.log", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False)
    row: dict = {"row": name, "args": list(ROWS[name]), "returncode": proc.returncode,
                 "command_seconds": round(time.time() - start, 1), "load_mean": load.mean}
    summary_path = out_dir / "summary.json"
    if proc.returncode != 0 or not summary_path.exists():
        row["error_tail"] = (out_dir / "run.log").read_text()[-2000:]
        return row
    s = json.loads(summary_path.read_text())
    metrics = Path(s["metrics_path"])
    row.update(
        val_em_before=round(s["val_em_before"], 3), val_em_after=round(s["val_em_after"], 3),
        onehop_after=round(s["val_em_after_by_source"].get(ONEHOP_SOURCE, float("nan")), 3),
        twohop_before=round(s["val_em_before_by_source"].get(TWOHOP_SOURCE, float("nan")), 3),
        twohop_after=round(s["val_em_after_by_source"].get(TWOHOP_SOURCE, float("nan")), 3),
        rl_minutes=round(s["rl_seconds"] / 60, 1), rl_steps=s["rl_steps"],
        searches_per_rollout_last_step=last_metric(metrics, "env/number_of_valid_search"),
        metrics_path=str(metrics))
    return row


def validation_curve(metrics_path: Path, weights: dict[str, float]) -> list[tuple[int, float]]:
    """(step, overall validation EM) of each validation in a run's metrics.jsonl, the sources weighted
    by their share of the validation questions."""
    curve = []
    for line in metrics_path.read_text().splitlines():
        record = json.loads(line)
        scores = {k.removeprefix("val/test_score/"): v for k, v in record.items() if k.startswith("val/test_score/")}
        if scores:
            curve.append((int(record["step"]), sum(weights[src] * v for src, v in scores.items())))
    return curve


def markdown(rows: list[dict], weights: dict[str, float]) -> str:
    """One table line per row (the last run of each name): EM before -> after, at the validations in
    between, one-hop / two-hop after, training reward and searches in the last step, minutes, load."""
    last = {row["row"]: row for row in rows}
    lines = ["| row | arguments | EM before → after | EM at the validations between | one-hop / two-hop after "
             "| train reward, searches (step 12) | RL minutes (load) |", "|---|---|---|---|---|---|---|"]
    for name in ROWS:
        row = last.get(name)
        if row is None:
            continue
        args = " ".join(f"`{a}`" for a in row["args"]) or "(the GRPO demo)"
        if row["returncode"] != 0 or "val_em_after" not in row:
            lines.append(f"| {name} | {args} | failed (returncode {row['returncode']}) | | | | |")
            continue
        metrics = Path(row["metrics_path"])
        between = ", ".join(f"{em:.3f} (step {step})" for step, em in validation_curve(metrics, weights)[1:-1])
        reward = last_metric(metrics, "critic/score/mean")
        searches = row.get("searches_per_rollout_last_step")
        lines.append(f"| {name} | {args} | {row['val_em_before']:.3f} → **{row['val_em_after']:.3f}** | {between} | "
                     f"{row['onehop_after']:.3f} / {row['twohop_after']:.3f} | {reward:.3f}, {searches:.2f} | "
                     f"{row['rl_minutes']} ({row['load_mean']}) |")
    return "\n".join(lines)


def source_weights(test_parquet: str | Path) -> dict[str, float]:
    import pandas as pd

    counts = pd.read_parquet(test_parquet)["data_source"].value_counts()
    return {str(k): float(v) / float(counts.sum()) for k, v in counts.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated row names (--list)")
    parser.add_argument("--out", default="outputs/demo_algorithms", help="folder for the rows' outputs")
    parser.add_argument("--list", action="store_true", help="print the rows and their arguments")
    parser.add_argument("--markdown", action="store_true", help="print the table of <out>/table.jsonl")
    parser.add_argument("--test-parquet", default="data/demo/test.parquet", help="the demo's validation questions")
    args = parser.parse_args(argv)
    if args.markdown:
        rows = [json.loads(line) for line in (Path(args.out) / "table.jsonl").read_text().splitlines() if line]
        print(markdown(rows, source_weights(args.test_parquet)))
        return
    if args.list:
        for name, row_args in ROWS.items():
            print(f"{name:32s} {' '.join(row_args) or '(the GRPO demo)'}")
        return
    names = [n for n in args.rows.split(",") if n]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        raise SystemExit(f"--rows: unknown row(s) {', '.join(unknown)}; rows: {', '.join(ROWS)}")
    out_root = Path(args.out)
    out_root.mkdir(parents=True, exist_ok=True)
    for name in names:
        row = run_row(name, out_root)
        line = json.dumps(row)
        print(line, flush=True)
        with open(out_root / "table.jsonl", "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
