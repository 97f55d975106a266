"""The demo writes trajectory dumps by default and its summary prints the viewer command."""

from __future__ import annotations

import shlex
from pathlib import Path

from scripts.demo.build import split_args
from scripts.demo.run_demo import DemoSummary, planned_config, print_summary, viewer_command


def test_the_demo_dumps_rollouts_and_validations_under_its_output_folder() -> None:
    settings, user = split_args(["demo.output_dir=/tmp/demo_out"])
    cfg = planned_config("grpo", settings, user)
    assert cfg.trainer.rollout_data_dir == "/tmp/demo_out/dumps/rollout"
    assert cfg.trainer.validation_data_dir == "/tmp/demo_out/dumps/validation"
    assert viewer_command(cfg, Path("/tmp/demo_out")) == \
        "python -m scripts.viewer /tmp/demo_out/dumps -o /tmp/demo_out/trajectories.html"
    # the user's own keys win; a folder of its own is named on its own
    settings, user = split_args(["trainer.validation_data_dir=/elsewhere/val", "trainer.rollout_data_dir=null"])
    cfg = planned_config("grpo", settings, user)
    assert cfg.trainer.rollout_data_dir is None and cfg.trainer.validation_data_dir == "/elsewhere/val"
    assert shlex.split(viewer_command(cfg, Path("out")))[3:] == ["/elsewhere/val", "-o", "out/trajectories.html"]


def test_the_summary_prints_the_viewer_command(capsys, tmp_path: Path) -> None:
    summary = DemoSummary(algorithm="grpo", val_em_before=0.1, val_em_after=0.5, val_em_before_by_source={},
                          val_em_after_by_source={}, rl_steps=2, wall_seconds=1.0, rl_seconds=1.0, checkpoint_dir="c",
                          hf_model_dir="h", metrics_path="m", plot_path="p", dumps_dir="outputs/demo/dumps",
                          viewer_command="python -m scripts.viewer outputs/demo/dumps -o outputs/demo/trajectories.html")
    print_summary(summary, tmp_path / "summary.json")
    assert "trajectories: python -m scripts.viewer outputs/demo/dumps -o outputs/demo/trajectories.html" in \
        capsys.readouterr().out
