"""evaluate.sh's report (EM, F1, judge accuracy per source and row-weighted overall) and its judge settings."""

from __future__ import annotations

import os
import subprocess
import sys
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


def test_summary_adds_avg_and_pass_at_k_per_source_with_n_samples():
    history = [{"val/test_score/nq": 0.25, "val/test_score/hotpotqa": 0.5,
                "val-core/nq/reward/mean@4": 0.25, "val-aux/nq/reward/pass@4": 0.5,
                "val-core/hotpotqa/reward/mean@4": 0.5, "val-aux/hotpotqa/reward/pass@4": 1.0,
                "val-aux/nq/judge/mean@4": 0.3, "val-aux/nq/judge/pass@4": 0.6,
                "val-core/nq/reward/best@4/mean": 0.4, "val-aux/hotpotqa/reward/mean@1": 1.0}]
    report = summarize(history, {"nq": 3, "hotpotqa": 1})
    assert {k: v for k, v in report.items() if "@" in k} == {
        "avg@4/nq": 0.25, "pass@4/nq": 0.5, "avg@4/hotpotqa": 0.5, "pass@4/hotpotqa": 1.0,
        "avg@4_judge/nq": 0.3, "pass@4_judge/nq": 0.6,
        "overall_avg@4": pytest.approx((0.25 * 3 + 0.5) / 4), "overall_pass@4": pytest.approx((0.5 * 3 + 1.0) / 4),
        "overall_avg@4_judge": pytest.approx(0.3), "overall_pass@4_judge": pytest.approx(0.6)}
    greedy = summarize([{"val/test_score/nq": 1.0, "val-core/nq/reward/mean@1": 1.0}], {"nq": 3})
    assert set(greedy) == {"val/test_score/nq", "overall"}


def _evaluate_sh(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """evaluate.sh with a python3 that prints the overrides of the evaluation call instead of running it."""
    fake = tmp_path / "python3"
    fake.write_text(f'#!/bin/bash\nif [ "$1" = "-" ] && [ "$2" != "torch" ]; then shift; printf "ARG %s\\n" "$@"; '
                    f'cat >/dev/null; exit 0; fi\nexec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    env = {**os.environ, "BASE_MODEL": "unused", "N_GPUS": "1", "VIRTUAL_ENV": str(tmp_path),
           "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    return subprocess.run(["bash", "scripts/nq_hotpotqa/evaluate.sh", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_evaluate_sh_n_samples_each_question_n_times(tmp_path: Path):
    proc = _evaluate_sh(tmp_path, "--n", "4", "trainer.seed=3")
    args = [line.removeprefix("ARG ") for line in proc.stdout.splitlines() if line.startswith("ARG ")]
    assert args == ["actor_rollout_ref.rollout.val_kwargs.n=4", "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
                    "actor_rollout_ref.rollout.val_kwargs.temperature=0.6",
                    "actor_rollout_ref.rollout.val_kwargs.top_p=1.0", "trainer.seed=3"], proc.stdout + proc.stderr
    for bad in (["--n", "0"], ["--n=abc"], ["--n"]):
        proc = _evaluate_sh(tmp_path, *bad)
        assert proc.returncode == 2 and "--n takes the number of responses sampled per question" in proc.stderr
