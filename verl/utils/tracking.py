"""Experiment tracking: one `log(metrics, step)` call fans out to the chosen backends.

Backends (`trainer.logger`, veRL's names): console (one line per step), jsonl
(`<log_dir>/metrics.jsonl`, one JSON object per step with a "step" field -- the demo's plot
reads it; `file` is veRL's name for it and writes the same file), wandb (`WANDB_MODE=offline`
works with no network), tensorboard, and mlflow, swanlab, trackio, clearml
(verl/utils/tracking_backends.py: local or offline unless told otherwise). Every backend but
console and jsonl imports its package when the run starts, and says how to install it.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from verl.utils.tracking_backends import OPTIONAL_BACKENDS, import_backend

BACKENDS = ("console", "jsonl", "file", "wandb", "tensorboard", *OPTIONAL_BACKENDS)
JSONL_NAME = "metrics.jsonl"


def _plain(value: Any) -> Any:
    """Numbers as Python floats/ints (tensors and numpy scalars included); NaN/inf as None for JSON."""
    if hasattr(value, "item") and callable(value.item):
        try:
            value = value.item()
        except (ValueError, RuntimeError):
            return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class _Console:
    def __init__(self, stream=None) -> None:
        self.stream = stream or sys.stdout

    def log(self, data: dict[str, Any], step: int) -> None:
        parts = []
        for key, value in sorted(data.items()):
            value = _plain(value)
            parts.append(f"{key}:{value:.4g}" if isinstance(value, float) else f"{key}:{value}")
        print(f"step:{step} - " + " - ".join(parts), file=self.stream, flush=True)

    def finish(self) -> None:
        pass


class _Jsonl:
    def __init__(self, log_dir: Path) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.path = log_dir / JSONL_NAME
        # Append: a resumed run continues the same file.
        self.file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def log(self, data: dict[str, Any], step: int) -> None:
        record = {"step": int(step), **{k: _plain(v) for k, v in data.items()}}
        self.file.write(json.dumps(record, default=str) + "\n")
        self.file.flush()

    def finish(self) -> None:
        self.file.close()


class _Wandb:
    def __init__(self, project_name: str, experiment_name: str, config: Any, log_dir: Path) -> None:
        wandb = import_backend("wandb")
        self.wandb = wandb
        self.run = wandb.init(project=project_name, name=experiment_name, config=config, dir=str(log_dir))

    def log(self, data: dict[str, Any], step: int) -> None:
        self.run.log({k: _plain(v) for k, v in data.items()}, step=step)

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        self.run.log({name: self.wandb.Table(columns=columns, data=rows)}, step=step)

    def finish(self) -> None:
        self.run.finish()


class _Tensorboard:
    def __init__(self, log_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError("trainer.logger contains 'tensorboard' but tensorboard is not installed "
                              "(pip install tensorboard)") from exc
        self.writer = SummaryWriter(log_dir=str(log_dir / "tensorboard"))

    def log(self, data: dict[str, Any], step: int) -> None:
        for key, value in data.items():
            value = _plain(value)
            if isinstance(value, int | float) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        """A markdown table in the TEXT tab (one cell per value, `|` and newlines escaped)."""
        cell = lambda v: str(v).replace("|", "\\|").replace("\n", "<br>")  # noqa: E731
        lines = ["| " + " | ".join(map(cell, columns)) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(map(cell, row)) + " |" for row in rows]
        self.writer.add_text(name, "\n".join(lines), step)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


class Tracking:
    """Log a metrics dict per step to every backend in `default_backend`."""

    def __init__(
        self,
        project_name: str,
        experiment_name: str,
        default_backend: str | list[str],
        config: Any = None,
        log_dir: str | Path | None = None,
    ) -> None:
        names = [default_backend] if isinstance(default_backend, str) else list(default_backend)
        for name in names:
            if name not in BACKENDS:
                raise ValueError(f"Tracking: unknown logger backend {name!r}; choose from {list(BACKENDS)}")
        self.log_dir = Path(log_dir) if log_dir is not None else Path("logs") / experiment_name
        if config is not None and not isinstance(config, dict):
            from omegaconf import OmegaConf

            config = OmegaConf.to_container(config, resolve=True)
        self.backends: dict[str, Any] = {}
        try:
            for name in dict.fromkeys("jsonl" if n == "file" else n for n in names):   # file: the jsonl file
                if name == "console":
                    self.backends[name] = _Console()
                elif name == "jsonl":
                    self.backends[name] = _Jsonl(self.log_dir)
                elif name == "wandb":
                    self.backends[name] = _Wandb(project_name, experiment_name, config, self.log_dir)
                elif name == "tensorboard":
                    self.backends[name] = _Tensorboard(self.log_dir)
                else:
                    self.backends[name] = OPTIONAL_BACKENDS[name](project_name, experiment_name, config, self.log_dir)
        except BaseException:
            self.finish()   # the backends already started (an open file, a run) end here
            raise

    def log(self, data: dict[str, Any], step: int) -> None:
        for backend in self.backends.values():
            backend.log(data, step)

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        """A table (trainer.log_val_generations' samples) to each backend that has tables (its
        `log_table`); the others (console, jsonl) skip it."""
        for backend in self.backends.values():
            log_table = getattr(backend, "log_table", None)
            if log_table is not None:
                log_table(name, columns, rows, step)

    def finish(self) -> None:
        for backend in self.backends.values():
            backend.finish()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file, in order."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
