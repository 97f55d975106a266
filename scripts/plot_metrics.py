"""Plot training curves from a JSONL metrics log (one JSON object per step) to a PNG.

    python scripts/plot_metrics.py --metrics outputs/demo/checkpoints/logs/metrics.jsonl \
        --out outputs/demo/training_curves.png

Four panels: training reward (critic/score/mean), validation EM per data source
(val/test_score/*), mean response length, and searches per rollout
(env/number_of_valid_search). A panel whose metric is absent says so instead of failing.
No wandb needed: matplotlib with the Agg backend.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PANELS = (
    ("Training reward (EM)", ("critic/score/mean",)),
    ("Validation EM", ("val/test_score/",)),
    ("Response length (tokens)", ("response_length/mean",)),
    ("Searches per rollout", ("env/number_of_valid_search",)),
)


def read_metrics(path: str | Path) -> list[dict]:
    """Records of a JSONL log; a bad line raises naming the file and line."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: invalid JSON ({e.msg})") from e
            if "step" not in record:
                raise ValueError(f"{path}:{line_no}: record has no 'step' field")
            records.append(record)
    return records


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) where `key` is present and numeric."""
    steps, values = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool):
            steps.append(int(r["step"]))
            values.append(float(v))
    return steps, values


def matching_keys(records: list[dict], prefixes: tuple[str, ...]) -> list[str]:
    keys = sorted({k for r in records for k in r})
    return [k for k in keys for p in prefixes if k == p or (p.endswith("/") and k.startswith(p))]


def plot_metrics(metrics_path: str | Path, out_path: str | Path, title: str = "Search-R1 training",
                 panels: tuple[tuple[str, tuple[str, ...]], ...] = PANELS) -> Path:
    """One panel per (name, metric keys or "prefix/"), two a row; PANELS by default."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    rows = (len(panels) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(11, 3.5 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (name, prefixes) in zip(axes.flat, panels, strict=False):
        keys = matching_keys(records, prefixes)
        for key in keys:
            steps, values = series(records, key)
            label = key.rsplit("/", 1)[-1] if key.startswith("val/") else key if len(keys) > 1 else None
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, label=label)
        if not keys:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
        if any(k.startswith("val/") for k in keys) or len(keys) > 1:
            ax.legend(fontsize=8)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--metrics", required=True, help="metrics.jsonl written by trainer.logger=[...,jsonl]")
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--title", default="Search-R1 training")
    args = p.parse_args(argv)
    out = plot_metrics(args.metrics, args.out, args.title)
    print(out)
    return out


if __name__ == "__main__":
    main()
