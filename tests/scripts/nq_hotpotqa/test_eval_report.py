"""evaluate.sh's report (EM, F1, judge accuracy per source and row-weighted overall) and its judge settings."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from scripts.nq_hotpotqa.eval_report import summarize

ROOT = Path(__file__).resolve().parents[3]


def test_summary_per_source_and_row_weighted_overall():
    history = [{"training/global_step": 0, "val/test_score/nq": 0.5, "val/test_f1/nq": 0.6,
                "val/test_score/hotpotqa": 0.2, "val/test_f1/hotpotqa": 0.3, "val/test_judge/nq": 0.7,
                "val/test_judge/hotpotqa": 0.4, "val/env/turns": 2.0}]
    report = summarize(history, {"nq": 300, "hotpotqa": 100, "unused": 5})
    assert report["val/test_score/nq"] == 0.5 and report["val/test_f1/hotpotqa"] == 0.3
    assert report["overall"] == pytest.approx((0.5 * 300 + 0.2 * 100) / 400)
    assert report["overall_f1"] == pytest.approx((0.6 * 300 + 0.3 * 100) / 400)
    assert report["overall_judge"] == pytest.approx((0.7 * 300 + 0.4 * 100) / 400)
    assert "val/env/turns" not in report
    no_judge = summarize([{"val/test_score/nq": 1.0, "val/test_f1/nq": 1.0}], {"nq": 3})
    assert set(no_judge) == {"val/test_score/nq", "val/test_f1/nq", "overall", "overall_f1"}


def test_summary_refuses_empty_validation_and_unknown_sources():
    with pytest.raises(ValueError, match="no val/test_score"):
        summarize([{"val/env/turns": 1.0}], {"nq": 1})
    with pytest.raises(ValueError, match=r"sources \['popqa'\] were scored but are not in the evaluated parquet"):
        summarize([{"val/test_score/popqa": 1.0}], {"nq": 1})


def test_evaluate_sh_needs_judge_model_with_judge_url():
    env = {**os.environ, "BASE_MODEL": "unused", "N_GPUS": "1", "JUDGE_URL": "http://127.0.0.1:1/v1"}
    env.pop("JUDGE_MODEL", None)
    proc = subprocess.run(["bash", "scripts/nq_hotpotqa/evaluate.sh"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "set JUDGE_MODEL" in proc.stderr
