"""Tables (trainer.log_val_generations' samples) go to the trackers that show them; the others skip them."""

from __future__ import annotations

from pathlib import Path

from verl.utils.tracking import Tracking, read_jsonl


def test_a_table_reaches_tensorboard_and_is_skipped_by_jsonl(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = Tracking("p", "e", ["jsonl", "tensorboard"], log_dir=tmp_path)
    tracker.log({"val/score": 0.5}, step=3)
    tracker.log_table("val/generations", ["step", "input", "output", "score"],
                      [[3, "Who | what?", "<answer> a </answer>\nnext", 1.0]], step=3)
    tracker.finish()
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 3, "val/score": 0.5}]
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    (event,) = events.Tensors("val/generations/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 3
    assert text.splitlines()[0] == "| step | input | output | score |"
    assert "Who \\| what?" in text and "<answer> a </answer><br>next" in text
