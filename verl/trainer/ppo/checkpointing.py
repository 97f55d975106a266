"""Checkpoint folders: written under a temporary name, renamed into place, pruned, resumed.

Layout under `trainer.default_local_dir`:

    global_step_{N}/actor/     worker shards: model, optimizer, LR scheduler, worker RNG
    global_step_{N}/critic/    (gae only)
    global_step_{N}/hf/        HF-format export for inference (trainer.save_hf_model; LoRA: the adapter)
    global_step_{N}/hf_merged/ LoRA: the adapter merged into the base model (trainer.save_merged_lora)
    global_step_{N}/data.pt    driver state: dataloader position, global_step, driver RNG
    global_step_{N}/manifest.json   size and sha256 of every other file (verl/utils/checkpoint/manifest.py)
    latest_checkpointed_iteration.txt   N of the newest complete checkpoint

A step folder is first written as `global_step_{N}.tmp/`; once every part is on disk its
manifest is written and the folder renamed, so a crash mid-save never leaves a folder that
looks complete; the `latest` file is replaced atomically after the rename. A resume checks
the files against the manifest: `auto` falls back to the newest intact checkpoint, an
explicit path stops, each naming the file that differs.
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from verl.utils.checkpoint.manifest import (
    MANIFEST_FILE,
    CorruptCheckpointError,
    ManifestCheck,
    verify_manifest,
    write_manifest,
)

logger = logging.getLogger(__name__)

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
    """Write the manifest, rename the tmp folder into place, point `latest` at it, keep only the
    newest `max_to_keep`. Every rank's writes must have returned (the worker calls block)."""
    root = Path(root)
    tmp = root / f"global_step_{step}.tmp"
    final = step_dir(root, step)
    write_manifest(tmp)
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


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint: the one `latest_checkpointed_iteration.txt` names, else the
    newest step folder, else None. Its files are not verified here (find_resume_dir does that)."""
    candidates = _resume_candidates(root)
    return candidates[0] if candidates else None


def _resume_candidates(root: str | Path) -> list[Path]:
    """The folder `latest` names first, then every other complete step folder, newest first."""
    root = Path(root)
    found = list_checkpoints(root)[::-1]
    latest = root / LATEST_FILE
    if latest.is_file():
        try:
            named = step_dir(root, int(latest.read_text().strip()))
        except ValueError:
            named = None  # a garbled pointer: the folders themselves still say what is there
        if named is not None and named.is_dir():
            found = [named, *(p for p in found if p != named)]
    return found


def _warn_unverified(check: ManifestCheck) -> None:
    if not check.has_manifest:
        logger.warning("checkpoint %s has no manifest.json (saved before checkpoints carried one): "
                       "resuming from it without checking its files", check.folder)


def find_resume_dir(root: str | Path, resume_mode: str) -> Path | None:
    """The checkpoint folder to resume from per `trainer.resume_mode`, or None to start fresh.

    auto: the newest intact checkpoint, trying the one named in `latest_checkpointed_iteration.txt`
    first, then older folders (a corrupt one is skipped with a warning naming its bad file); none
    on disk: None; none intact: CorruptCheckpointError. disable: None. Anything else: a path to a
    global_step_N folder, which must be intact. Folders without a manifest are accepted unverified.
    """
    if resume_mode == "disable":
        return None
    if resume_mode == "auto":
        corrupt: list[ManifestCheck] = []
        for folder in _resume_candidates(root):
            check = verify_manifest(folder)
            if not check.intact:
                logger.warning("trainer.resume_mode=auto: checkpoint %s is corrupt: %s", folder, check.summary())
                corrupt.append(check)
                continue
            _warn_unverified(check)
            if corrupt:
                logger.warning(
                    "trainer.resume_mode=auto: resuming from %s (step %d), the newest intact checkpoint, instead "
                    "of the corrupt %s (%s); the steps after %d are trained again", folder, step_of(folder),
                    corrupt[0].folder, corrupt[0].summary(), step_of(folder))
            return folder
        if corrupt:
            listed = "; ".join(f"{c.folder.name}: {c.summary()}" for c in corrupt)
            raise CorruptCheckpointError(
                f"trainer.resume_mode=auto: no intact checkpoint under {root} to resume from ({listed}). "
                "A save was cut short (full disk? crashed node?). Free the space, then either move the corrupt "
                f"folders out of {root} (the run starts from step 0) or pass trainer.resume_mode=disable.")
        return None
    folder = Path(resume_mode)
    if not folder.is_dir():
        raise FileNotFoundError(f"trainer.resume_mode={resume_mode}: no such checkpoint folder")
    step_of(folder)
    if not (folder / DRIVER_STATE_FILE).is_file():
        raise FileNotFoundError(f"trainer.resume_mode={resume_mode}: folder has no {DRIVER_STATE_FILE}")
    check = verify_manifest(folder)
    if not check.intact:
        raise CorruptCheckpointError(
            f"trainer.resume_mode={resume_mode}: the checkpoint is corrupt: {check.summary()}. Resume from an "
            f"intact one: trainer.resume_mode=auto takes the newest intact checkpoint under {folder.parent}, "
            "or name an older global_step_N folder.")
    _warn_unverified(check)
    return folder


def load_failure_message(folder: str | Path, err: BaseException) -> str:
    """What to say when a worker fails to load `folder`: the worker's last error line, and whether
    the files were checked (a manifest matched: the checkpoint does not fit this run) or not (no
    manifest: a damaged file is likely, so an older checkpoint is the way on)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    last = lines[-1] if lines else type(err).__name__
    folder = Path(folder)
    if (folder / MANIFEST_FILE).is_file():
        hint = ("its files match its manifest, so it does not fit this run (another world size, model or "
                "optimizer?): resume with the settings it was saved with")
    else:
        hint = (f"it has no {MANIFEST_FILE} (saved before checkpoints carried one), so its files were not checked "
                f"and one may be damaged: resume from an older one (trainer.resume_mode=<path to an older "
                f"global_step_N under {folder.parent}>)")
    return (f"resuming from {folder}: a worker failed to load it ({last}); {hint}, "
            "or start afresh with trainer.resume_mode=disable")


class CheckpointedTraining:
    """The trainer's checkpoints (mixed into RayPPOTrainer): the shared-folder probe, save, resume,
    and the resume hint a dead worker's error carries. Reads the trainer's config, worker groups,
    dataloader, KL controller and step."""

    _checked_checkpoint_root: str | None = None   # the root every rank was seen writing into

    def verify_checkpoint_root(self) -> None:
        """Before the first save or load: every rank writes a marker into trainer.default_local_dir
        and this driver must see them all (verl/utils/checkpoint/shared_dir.py); SharedDirError
        naming the ranks and the key otherwise. Once per root."""
        from verl.utils.checkpoint.shared_dir import verify_shared_dir

        root = str(self.config.trainer.default_local_dir)
        if self._checked_checkpoint_root == root:
            return
        verify_shared_dir(root, self.actor_rollout_wg.write_checkpoint_probe)
        self._checked_checkpoint_root = root

    def save_checkpoint(self) -> Path:
        trainer = self.config.trainer
        root = Path(trainer.default_local_dir)
        self.verify_checkpoint_root()
        tmp = begin_checkpoint(root, self.global_step)
        hf_path = str(tmp / "hf") if trainer.save_hf_model else None
        lora = int(self.config.actor_rollout_ref.model.get("lora_rank", 0) or 0) > 0
        merged_path = str(tmp / "hf_merged") if lora and trainer.get("save_merged_lora", False) else None
        self.actor_rollout_wg.save_checkpoint(str(tmp / "actor"), self.global_step, hf_path, merged_path)
        if self.use_critic:
            self.critic_wg.save_checkpoint(str(tmp / "critic"), self.global_step)
        # A pipelined run has drawn batches beyond the one trained: it records the position after that one.
        loader_state = (self._trained_loader_state if self._trained_loader_state is not None
                        else self.train_dataloader.state_dict())
        save_driver_state(tmp, self.global_step, loader_state,
                                        extra={"kl_coef": self.kl_ctrl.value})
        return finalize_checkpoint(root, self.global_step, int(trainer.max_ckpt_to_keep))

    def load_checkpoint(self) -> Path | None:
        """Resume per trainer.resume_mode; returns the folder loaded, or None for a fresh start."""
        trainer = self.config.trainer
        if int(trainer.save_freq) > 0:
            # at start-up, not after the first save_freq steps: a run that could never resume stops now
            self.verify_checkpoint_root()
        folder = find_resume_dir(trainer.default_local_dir, str(trainer.resume_mode))
        if folder is None:
            return None
        self.verify_checkpoint_root()   # the workers read their shards from where this driver found them
        state = load_driver_state(folder)
        try:
            self.actor_rollout_wg.load_checkpoint(str(folder / "actor"))
            if self.use_critic:
                self.critic_wg.load_checkpoint(str(folder / "critic"))
        except Exception as err:
            import ray

            if not isinstance(err, ray.exceptions.RayTaskError):
                raise   # a dead worker is explained by fit()
            raise RuntimeError(load_failure_message(folder, err)) from err
        self.global_step = state.global_step
        self.train_dataloader.load_state_dict(state.dataloader_state)
        restore_rng_state(state.rng_state)
        if "kl_coef" in state.extra:
            self.kl_ctrl.value = float(state.extra["kl_coef"])
        logger.info("resumed from %s at global_step %d", folder, self.global_step)
        return folder

    def _worker_death(self, err: BaseException) -> tuple[Exception, BaseException] | None:
        """A worker process's death (Ray's ActorDiedError, or the worker group's WorkerDiedError) as
        (an error naming its role, rank, pid and node, the last complete checkpoint and how to
        resume; Ray's original error, its cause); None for any other error."""
        from verl.single_controller.ray import WorkerDiedError, worker_death

        groups = [self.actor_rollout_wg, self.critic_wg]
        if self.rollout_wg is not self.actor_rollout_wg:
            groups.append(self.rollout_wg)
        death = worker_death(err, groups)
        if death is None:
            return None
        # The group's WorkerDiedError was raised from Ray's error: that one stays the cause.
        cause = err.__cause__ if isinstance(err, WorkerDiedError) and err.__cause__ is not None else err
        return WorkerDiedError(f"{death}. {self._resume_hint()}", death.place), cause

    def _resume_hint(self) -> str:
        """Where a new run of the same command would continue from, and what to pass for it."""
        trainer = self.config.trainer
        root = Path(trainer.default_local_dir).absolute()
        latest = latest_checkpoint(root)
        if latest is None:
            save_freq = int(trainer.save_freq)
            why = (f"trainer.save_freq={save_freq}" if save_freq > 0
                   else f"trainer.save_freq={save_freq} saves none; set trainer.save_freq=N to save every N steps")
            return (f"Last complete checkpoint: none under {root} ({why}); running the same command "
                    "starts again from step 0.")
        where = f"Last complete checkpoint: {latest} (step {step_of(latest)})."
        mode = str(trainer.resume_mode)
        if mode == "auto":
            return f"{where} Running the same command resumes from it (trainer.resume_mode=auto)."
        return (f"{where} To resume from it, run the same command with trainer.resume_mode=auto "
                f"(or trainer.resume_mode={latest}); this run had trainer.resume_mode={mode}.")
