"""Tracking: the jsonl backend writes one record per step; unknown backends are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from verl.utils.tracking import JSONL_NAME, Tracking, read_jsonl


def test_jsonl_writes_one_object_per_step_with_the_step(tmp_path: Path, capsys) -> None:
    tracker = Tracking("p", "e", ["console", "jsonl"], config={"a": 1}, log_dir=tmp_path)
    tracker.log({"critic/score/mean": torch.tensor(0.25), "timing_s/gen": 1.5}, step=1)
    tracker.log({"critic/score/mean": 0.5, "val/test_score/nq": float("nan")}, step=2)
    tracker.finish()
    records = read_jsonl(tmp_path / JSONL_NAME)
    assert records == [
        {"step": 1, "critic/score/mean": 0.25, "timing_s/gen": 1.5},
        {"step": 2, "critic/score/mean": 0.5, "val/test_score/nq": None},
    ]
    assert "step:2" in capsys.readouterr().out


def test_jsonl_appends_across_a_resume(tmp_path: Path) -> None:
    for step in (1, 2):
        tracker = Tracking("p", "e", "jsonl", log_dir=tmp_path)
        tracker.log({"x": step}, step=step)
        tracker.finish()
    assert [r["step"] for r in read_jsonl(tmp_path / JSONL_NAME)] == [1, 2]


def test_unknown_backend_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'neptune'"):
        Tracking("p", "e", ["jsonl", "neptune"], log_dir=tmp_path)


def test_tensorboard_backend_writes_event_files(tmp_path: Path) -> None:
    tracker = Tracking("p", "e", ["tensorboard"], log_dir=tmp_path)
    tracker.log({"a": 1.0, "note": "text is skipped"}, step=3)
    tracker.finish()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_wandb_backend_runs_offline(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = Tracking("p", "e", ["wandb"], config={"a": 1}, log_dir=tmp_path)
    tracker.log({"critic/score/mean": 0.5}, step=1)
    tracker.finish()
    assert list((tmp_path / "wandb").glob("offline-run-*"))
