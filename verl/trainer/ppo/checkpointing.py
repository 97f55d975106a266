"""Checkpoint folders: written under a temporary name, renamed into place, pruned, resumed.

Layout under `trainer.default_local_dir`:

    global_step_{N}/actor/     worker shards: model, optimizer, LR scheduler, worker RNG
    global_step_{N}/critic/    (gae only)
    global_step_{N}/hf/        HF-format export for inference (trainer.save_hf_model)
    global_step_{N}/data.pt    driver state: dataloader position, global_step, driver RNG
    latest_checkpointed_iteration.txt   N of the newest complete checkpoint

A step folder is first written as `global_step_{N}.tmp/` and renamed when every part
is on disk, so a crash mid-save never leaves a folder that looks complete; the
`latest` file is replaced atomically after the rename.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

LATEST_FILE = "latest_checkpointed_iteration.txt"
DRIVER_STATE_FILE = "data.pt"
STEP_DIR_RE = re.compile(r"^global_step_(\d+)$")


@dataclass
class DriverState:
    """What the single controller needs to continue exactly where it stopped."""

    global_step: int
    dataloader_state: dict[str, Any]
    rng_state: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)   # e.g. the adaptive KL coefficient


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"global_step_{step}"


def step_of(path: str | Path) -> int:
    """N of a `global_step_N` folder; ValueError naming the path otherwise."""
    match = STEP_DIR_RE.match(Path(path).name)
    if match is None:
        raise ValueError(f"not a checkpoint folder (expected .../global_step_N): {path}")
    return int(match.group(1))


def begin_checkpoint(root: str | Path, step: int) -> Path:
    """A fresh `global_step_{step}.tmp/` folder to write every part of the checkpoint into."""
    tmp = Path(root) / f"global_step_{step}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)  # left over from a save that crashed
    tmp.mkdir(parents=True)
    return tmp


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def finalize_checkpoint(root: str | Path, step: int, max_to_keep: int) -> Path:
    """Rename the tmp folder into place, point `latest` at it, keep only the newest `max_to_keep`."""
    root = Path(root)
    tmp = root / f"global_step_{step}.tmp"
    final = step_dir(root, step)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _atomic_write_text(root / LATEST_FILE, str(step))
    for old in list_checkpoints(root)[:-max_to_keep]:
        shutil.rmtree(old)
    return final


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete step folders under `root`, oldest first (tmp folders are not checkpoints)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR_RE.match(p.name)]
    return sorted(found, key=step_of)


def capture_rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_driver_state(folder: str | Path, global_step: int, dataloader_state: dict[str, Any],
                      extra: dict[str, Any] | None = None) -> None:
    state = {"global_step": global_step, "dataloader": dataloader_state, "rng": capture_rng_state(),
             "extra": dict(extra or {})}
    torch.save(state, Path(folder) / DRIVER_STATE_FILE)


def load_driver_state(folder: str | Path) -> DriverState:
    path = Path(folder) / DRIVER_STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {folder} has no {DRIVER_STATE_FILE} (driver state)")
    state = torch.load(path, weights_only=False)
    return DriverState(int(state["global_step"]), state["dataloader"], state["rng"], state.get("extra", {}))


def find_resume_dir(root: str | Path, resume_mode: str) -> Path | None:
    """The checkpoint folder to resume from per `trainer.resume_mode`, or None to start fresh.

    auto: the one named in `latest_checkpointed_iteration.txt` (else the newest complete
    folder, else none); disable: none; anything else: a path to a global_step_N folder.
    """
    if resume_mode == "disable":
        return None
    if resume_mode == "auto":
        root = Path(root)
        latest = root / LATEST_FILE
        if latest.is_file():
            folder = step_dir(root, int(latest.read_text().strip()))
            if folder.is_dir():
                return folder
        found = list_checkpoints(root)
        return found[-1] if found else None
    folder = Path(resume_mode)
    if not folder.is_dir():
        raise FileNotFoundError(f"trainer.resume_mode={resume_mode}: no such checkpoint folder")
    step_of(folder)
    if not (folder / DRIVER_STATE_FILE).is_file():
        raise FileNotFoundError(f"trainer.resume_mode={resume_mode}: folder has no {DRIVER_STATE_FILE}")
    return folder
