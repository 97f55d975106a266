"""The training-curve PNG is drawn from a JSONL metrics log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts.plot_metrics import main, read_metrics


def test_png_is_written_from_a_jsonl_log(tmp_path: Path) -> None:
    log = tmp_path / "metrics.jsonl"
    records = [{"step": 0, "val/test_score/demo_onehop": 0.3}]
    records += [{"step": i, "critic/score/mean": 0.1 * i, "response_length/mean": 50 + i,
                 "env/number_of_valid_search": 0.5 + 0.05 * i} for i in range(1, 6)]
    records += [{"step": 5, "val/test_score/demo_onehop": 0.7}]
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = main(["--metrics", str(log), "--out", str(tmp_path / "curves.png")])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 10_000


def test_a_record_without_step_is_rejected_with_its_line(tmp_path: Path) -> None:
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1}\n{"x": 2}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2"):
        read_metrics(log)
