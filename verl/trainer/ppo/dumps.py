"""Trajectory dumps: one JSONL file per step, the viewer's input (`python -m scripts.viewer DIR`).

    dumps = TrajectoryDumps(DumpConfig.from_config(config), tokenizer)
    dumps.start(global_step, tracker)          # after a resume: files past the step are the old run's
    dumps.write_rollout(batch, step)           # end of a training step, before its checkpoint
    dumps.add_validation(batch, scores_B, val_reward_fn)   # each validation batch
    dumps.end_validation(step)                 # the validation file, and log_val_generations

Keys (veRL's, ppo_trainer.yaml): `trainer.rollout_data_dir` / `trainer.validation_data_dir` get
`<step>.jsonl` (one row per trajectory, dump_rows.py has the fields), `trainer.log_val_generations`
validation samples go to the trackers that have tables (wandb, tensorboard). Ours:
`trainer.dump_max_rows` caps a file's rows (whole groups: a GRPO group's samples in training, a
question's samples in validation, where they are the first questions, the same every time).

A file is written under a temporary name and renamed into place, so a reader never sees half a
step. The rollout file of step N is written before step N's checkpoint, so a run resumed from N
has it; at the start the files past the resumed step (a crashed run's steps the resumed run
redoes) are removed, so no step is in a folder twice or from two runs. A fresh run (step 0)
starts from empty folders.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from verl.trainer.config_schema import ConfigError
from verl.trainer.ppo.dump_rows import dump_rows, picked_rows, texts
from verl.trainer.ppo.reward_shaping import reward_parts
from verl.utils import batch_keys as K

if TYPE_CHECKING:   # verl.protocol imports tensordict (and with it torch._dynamo): preflight's config checks read
    from verl.protocol import DataProto  # this module's settings without it

logger = logging.getLogger(__name__)

STEP_FILE_RE = re.compile(r"^(\d+)\.jsonl$")
VAL_TABLE = "val/generations"


def step_file(folder: str | Path, step: int) -> Path:
    return Path(folder) / f"{int(step)}.jsonl"


def write_step_file(folder: str | Path, step: int, rows: list[dict[str, Any]]) -> Path:
    """`<folder>/<step>.jsonl`, written to a temporary file and renamed into place (atomic)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = step_file(folder, step)
    tmp = folder / f".{path.name}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, allow_nan=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def step_files(folder: str | Path) -> dict[int, Path]:
    """step -> file of a dump folder (files not named `<step>.jsonl` are not the dumps')."""
    folder = Path(folder)
    if not folder.is_dir():
        return {}
    return {int(m.group(1)): p for p in folder.iterdir() if (m := STEP_FILE_RE.match(p.name))}


def prune_after(folder: str | Path, step: int) -> list[int]:
    """Remove the step files a run starting at `step` writes again (past it; all when step is 0)
    and temporary files left by a crash; returns the steps removed."""
    removed = []
    for n, path in sorted(step_files(folder).items()):
        if n > step or step == 0:
            path.unlink()
            removed.append(n)
    for tmp in Path(folder).glob(".*.jsonl.tmp") if Path(folder).is_dir() else []:
        tmp.unlink()
    return removed


@dataclass(frozen=True)
class DumpConfig:
    rollout_dir: Path | None = None
    validation_dir: Path | None = None
    max_rows: int | None = 1000
    log_val_generations: int = 0

    @classmethod
    def from_config(cls, cfg: Any) -> DumpConfig:
        errors = dump_config_errors(cfg)
        if errors:
            raise ConfigError(errors[0], errors)
        trainer = cfg.trainer
        rollout, validation = trainer.get("rollout_data_dir"), trainer.get("validation_data_dir")
        cap = trainer.get("dump_max_rows", 1000)
        return cls(rollout_dir=Path(str(rollout)) if rollout else None,
                   validation_dir=Path(str(validation)) if validation else None,
                   max_rows=None if cap is None else int(cap),
                   log_val_generations=int(trainer.get("log_val_generations", 0) or 0))


def dump_config_errors(cfg: Any) -> list[str]:
    """The dump keys' problems, one message each naming the key."""
    trainer = cfg.trainer
    errors = []
    cap = trainer.get("dump_max_rows", 1000)
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        errors.append(f"trainer.dump_max_rows={cap!r} must be an int >= 1 (rows per step file), or null for all rows")
    n = trainer.get("log_val_generations", 0)
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        errors.append(f"trainer.log_val_generations={n!r} must be an int >= 0 (validation samples logged)")
    rollout, validation = trainer.get("rollout_data_dir"), trainer.get("validation_data_dir")
    if rollout and validation and Path(str(rollout)).resolve() == Path(str(validation)).resolve():
        errors.append(f"trainer.rollout_data_dir and trainer.validation_data_dir are the same folder ({rollout}): "
                      "both name their files <step>.jsonl; give each its own folder")
    return errors


def val_generation_samples(samples: list[list[Any]], n: int) -> list[list[Any]]:
    """veRL's choice of the [input, output, score] samples to log: sorted by input, shuffled with a
    fixed seed, the first n (the same questions at every validation)."""
    ordered = sorted(samples, key=lambda s: s[0])
    np.random.RandomState(42).shuffle(ordered)
    return ordered[:n]


class TrajectoryDumps:
    """What the trainer calls to dump trajectories (a no-op for a folder not set)."""

    def __init__(self, cfg: DumpConfig, tokenizer: Any, eos_ids: frozenset[int] = frozenset()) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.tracker: Any = None
        self._val_rows: list[dict[str, Any]] = []
        self._val_samples: list[list[Any]] = []

    @property
    def collects_validation(self) -> bool:
        return self.cfg.validation_dir is not None or self.cfg.log_val_generations > 0

    def start(self, step: int, tracker: Any = None) -> None:
        """The run starts (or resumes) at `step`: drop the files it will write again."""
        self.tracker = tracker
        for folder in (self.cfg.rollout_dir, self.cfg.validation_dir):
            if folder is None:
                continue
            removed = prune_after(folder, step)
            if removed:
                logger.warning("dumps: removed %d step file(s) of %s past step %d (%s), which this run writes again",
                               len(removed), folder, step, ", ".join(map(str, removed[:10])))

    def write_rollout(self, batch: DataProto, step: int) -> Path | None:
        """`<rollout_data_dir>/<step>.jsonl` for a trained batch (advantages and all)."""
        if self.cfg.rollout_dir is None:
            return None
        picked = picked_rows(batch, self.cfg.max_rows, whole_groups=True)
        rows = dump_rows(batch, self.tokenizer, step, picked, eos_ids=self.eos_ids)
        return write_step_file(self.cfg.rollout_dir, step, rows)

    def add_validation(self, batch: DataProto, scores_B: torch.Tensor, reward_fn: Any = None) -> None:
        """Keep a validation batch's rows (up to the cap) with their scores and the reward's parts;
        with log_val_generations, every row's input, output and score (the samples are drawn from all)."""
        if not self.collects_validation:
            return
        scores = scores_B.float().cpu().tolist()
        if self.cfg.log_val_generations > 0:
            self._val_samples += [[i, o, s] for (i, o), s in zip(texts(batch, self.tokenizer), scores, strict=True)]
        room = len(batch) if self.cfg.max_rows is None else self.cfg.max_rows - len(self._val_rows)
        if self.cfg.validation_dir is None or room <= 0:
            return
        if K.REWARD_EXTRA_INFO not in batch.non_tensor_batch:
            breakdowns = getattr(reward_fn, "last_breakdowns", None)
            breakdowns = breakdowns if breakdowns is not None and len(breakdowns) == len(batch) else None
            batch.non_tensor_batch[K.REWARD_EXTRA_INFO] = reward_parts(
                scores, breakdowns, getattr(reward_fn, "last_row_metrics", None), None)
        picked = picked_rows(batch, room, whole_groups=True)   # a prompt's samples (val_kwargs.n) together
        self._val_rows += dump_rows(batch, self.tokenizer, 0, picked, scores=scores, eos_ids=self.eos_ids)

    def end_validation(self, step: int) -> Path | None:
        """Write the validation file of `step` and log the samples; forget the pass."""
        rows, self._val_rows = self._val_rows, []
        samples, self._val_samples = self._val_samples, []
        for row in rows:
            row["step"] = int(step)
        path = None
        if self.cfg.validation_dir is not None and rows:
            path = write_step_file(self.cfg.validation_dir, step, rows)
        if self.cfg.log_val_generations > 0 and samples:
            self.log_val_generations(samples, step)
        return path

    def log_val_generations(self, samples: list[list[Any]], step: int) -> None:
        """`trainer.log_val_generations` samples to the trackers with tables (Tracking.log_table)."""
        log_table = getattr(self.tracker, "log_table", None)
        if log_table is None:
            return
        chosen = val_generation_samples(samples, self.cfg.log_val_generations)
        log_table(VAL_TABLE, ["step", "input", "output", "score"], [[int(step), *s] for s in chosen], step)
