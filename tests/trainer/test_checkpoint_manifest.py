"""Checkpoint manifests: written with every save, checked on resume; a corrupt newest checkpoint
falls back (auto) or stops (explicit path, or nothing intact left), naming the file."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException
from transformers import AutoModelForCausalLM

from verl.trainer.ppo import checkpointing as ck
from verl.utils.checkpoint import FSDPCheckpointManager
from verl.utils.checkpoint.manifest import MANIFEST_FILE, CorruptCheckpointError, verify_manifest

SHARD = "actor/dcp/__0_0.distcp"   # rank 0's model + optimizer shard, the biggest file


@pytest.fixture(scope="module")
def manager(tiny_model_dir: str) -> FSDPCheckpointManager:
    """The real checkpoint writer on a tiny model with one optimizer step taken (one process)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.tensor([[3, 4, 5, 6]])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return FSDPCheckpointManager(model, optimizer)


def _save(manager: FSDPCheckpointManager, root: Path, step: int) -> Path:
    """What RayPPOTrainer.save_checkpoint does, with the worker's writer called in-process."""
    tmp = ck.begin_checkpoint(root, step)
    manager.save_checkpoint(str(tmp / "actor"), global_step=step)
    ck.save_driver_state(tmp, step, {"pos": step})
    return ck.finalize_checkpoint(root, step, max_to_keep=3)


def _truncate(path: Path) -> None:
    """Half the file is left, as a full disk or a node crashing mid-write leaves it."""
    os.truncate(path, path.stat().st_size // 2)


def test_the_manifest_lists_every_file_with_its_size_and_sha256(manager, tmp_path: Path) -> None:
    folder = _save(manager, tmp_path, 1)
    files = json.loads((folder / MANIFEST_FILE).read_text())["files"]
    on_disk = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    assert sorted(files) == sorted(set(on_disk) - {MANIFEST_FILE})
    assert {SHARD, "actor/dcp/.metadata", "actor/extra_state_rank0.pt", ck.DRIVER_STATE_FILE} <= set(files)
    assert files[SHARD]["size"] == (folder / SHARD).stat().st_size
    assert len(files[SHARD]["sha256"]) == 64
    assert verify_manifest(folder).intact


def test_a_truncated_shard_breaks_the_load_that_the_manifest_check_prevents(manager, tmp_path: Path) -> None:
    # What resuming did before: the worker's raw CheckpointException (here in-process).
    folder = _save(manager, tmp_path, 1)
    _truncate(folder / SHARD)
    with pytest.raises(CheckpointException):
        manager.load_checkpoint(str(folder / "actor"))
    check = verify_manifest(folder)
    assert not check.intact and str(folder / SHARD) in check.summary() and "bytes" in check.summary()


def test_same_size_different_bytes_are_caught_by_the_checksum(manager, tmp_path: Path) -> None:
    folder = _save(manager, tmp_path, 1)
    path = folder / SHARD
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    check = verify_manifest(folder)
    assert check.problems == [f"{path}: sha256 differs from the manifest (same size, different bytes)"]


def test_auto_resume_skips_a_corrupt_newest_checkpoint_naming_the_file(manager, tmp_path, caplog) -> None:
    _save(manager, tmp_path, 1)
    newest = _save(manager, tmp_path, 2)
    _truncate(newest / SHARD)
    with caplog.at_level(logging.WARNING, logger=ck.__name__):
        assert ck.find_resume_dir(tmp_path, "auto") == tmp_path / "global_step_1"
    assert str(newest / SHARD) in caplog.text and "global_step_1 (step 1)" in caplog.text


def test_auto_resume_falls_back_to_the_newest_intact_checkpoint_not_the_oldest(manager, tmp_path, caplog) -> None:
    for step in (1, 2):
        _save(manager, tmp_path, step)
    newest = _save(manager, tmp_path, 3)
    _truncate(newest / SHARD)
    with caplog.at_level(logging.WARNING, logger=ck.__name__):
        assert ck.find_resume_dir(tmp_path, "auto") == tmp_path / "global_step_2"
    assert "global_step_2 (step 2)" in caplog.text
    (tmp_path / ck.LATEST_FILE).unlink()      # the same order from the folders alone
    assert ck.find_resume_dir(tmp_path, "auto") == tmp_path / "global_step_2"


def test_a_half_written_manifest_is_corrupt_never_a_checkpoint_without_one(manager, tmp_path, caplog) -> None:
    _save(manager, tmp_path, 1)
    newest = _save(manager, tmp_path, 2)
    _truncate(newest / MANIFEST_FILE)           # the JSON cut short: unreadable, but there
    check = verify_manifest(newest)
    assert check.has_manifest and not check.intact
    assert check.summary().startswith(f"{newest / MANIFEST_FILE}: unreadable manifest (")
    with caplog.at_level(logging.WARNING, logger=ck.__name__):
        assert ck.find_resume_dir(tmp_path, "auto") == tmp_path / "global_step_1"
    assert "no manifest.json" not in caplog.text
    with pytest.raises(CorruptCheckpointError, match="unreadable manifest"):
        ck.find_resume_dir(tmp_path, str(newest))


def test_an_explicit_corrupt_checkpoint_stops_naming_the_file_and_the_way_out(manager, tmp_path: Path) -> None:
    _save(manager, tmp_path, 1)
    newest = _save(manager, tmp_path, 2)
    (newest / "actor" / "extra_state_rank0.pt").unlink()
    with pytest.raises(CorruptCheckpointError) as info:
        ck.find_resume_dir(tmp_path, str(newest))
    message = str(info.value)
    assert str(newest / "actor" / "extra_state_rank0.pt") in message and "missing" in message
    assert "trainer.resume_mode=auto" in message
    assert ck.find_resume_dir(tmp_path, str(tmp_path / "global_step_1")) == tmp_path / "global_step_1"


def test_no_intact_checkpoint_left_stops_naming_each_corrupt_file(manager, tmp_path: Path) -> None:
    for step in (1, 2):
        _truncate(_save(manager, tmp_path, step) / SHARD)
    with pytest.raises(CorruptCheckpointError) as info:
        ck.find_resume_dir(tmp_path, "auto")
    message = str(info.value)
    for step in (1, 2):
        assert str(tmp_path / f"global_step_{step}" / SHARD) in message
    assert "trainer.resume_mode=disable" in message


def test_a_checkpoint_without_a_manifest_resumes_with_a_warning(manager, tmp_path: Path, caplog) -> None:
    folder = _save(manager, tmp_path, 1)
    (folder / MANIFEST_FILE).unlink()   # as saved before manifests existed
    with caplog.at_level(logging.WARNING, logger=ck.__name__):
        assert ck.find_resume_dir(tmp_path, "auto") == folder
        assert ck.find_resume_dir(tmp_path, str(folder)) == folder
    assert "no manifest.json" in caplog.text


def test_a_failed_load_says_whether_the_files_were_checked(manager, tmp_path: Path) -> None:
    folder = _save(manager, tmp_path, 1)
    _truncate(folder / SHARD)
    (folder / MANIFEST_FILE).unlink()   # an old checkpoint: resumed unverified, then the load fails
    with pytest.raises(CheckpointException) as info:
        manager.load_checkpoint(str(folder / "actor"))
    message = ck.load_failure_message(folder, info.value)
    assert message.startswith(f"resuming from {folder}: a worker failed to load it (")
    assert "central directory" in message   # the worker's innermost error line
    assert "no manifest.json" in message and "older" in message and "trainer.resume_mode=disable" in message
    checked = _save(manager, tmp_path, 2)   # carries a manifest
    assert "does not fit this run" in ck.load_failure_message(checked, info.value)


# Through the entry point (run_ppo falls back, stops, or names the unverified load): tests/trainer/test_resume.py,
# on the resume test's own run.
