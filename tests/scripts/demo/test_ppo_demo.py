"""`bash train_ppo.sh` on a machine with no GPU runs the offline demo with PPO (GAE + a critic),
not GRPO; the demo's PPO run learns and logs the critic (docs/demo.md, "GRPO and PPO")."""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.demo.build import split_args
from scripts.demo.run_demo import planned_config, run_demo, split_algorithm
from tests.scripts.demo.test_run_demo import tiny_args

ROOT = Path(__file__).resolve().parents[3]

# A stand-in python3: no GPU (`python3 -c` probe fails), every module found (use_venv.sh's `python3 -`
# lookup prints no missing one), and `python3 -m ...` records its arguments.
FAKE_PYTHON = """#!/bin/sh
[ "$1" = "-" ] && exit 0
[ "$1" = "-m" ] || exit 1
printf "%s\\n" "$@" > "$REC"
"""


def demo_argv(script: str, tmp_path: Path, *args: str) -> list[str]:
    """What `bash <script> <args>` with no BASE_MODEL and no GPU hands to `python3 -m scripts.demo.run_demo`."""
    fake_bin, rec = tmp_path / "bin", tmp_path / "argv.txt"
    fake_bin.mkdir(parents=True)
    (fake_bin / "python3").write_text(FAKE_PYTHON)
    (fake_bin / "python3").chmod(0o755 | stat.S_IEXEC)
    env = {k: v for k, v in os.environ.items() if k != "BASE_MODEL"}
    # an active venv: scripts/use_venv.sh then leaves PATH as it is (the stand-in python3 first)
    env.update(PATH=f"{fake_bin}{os.pathsep}{env['PATH']}", REC=str(rec), VIRTUAL_ENV=str(tmp_path))
    proc = subprocess.run(["bash", script, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    argv = rec.read_text().splitlines()
    assert argv[:2] == ["-m", "scripts.demo.run_demo"], argv
    return argv[2:]


def composed(argv: list[str]):
    algorithm, rest = split_algorithm(argv)
    settings, overrides = split_args(rest)
    return algorithm, planned_config(algorithm, settings, overrides)


def test_train_ppo_sh_on_cpu_runs_the_demo_with_gae_and_a_critic(tmp_path: Path) -> None:
    algorithm, cfg = composed(demo_argv("train_ppo.sh", tmp_path))
    assert algorithm == "ppo"
    assert cfg.algorithm.adv_estimator == "gae"
    # The critic starts from the warm start the actor starts from (a value head on top).
    assert cfg.critic.model.path == cfg.actor_rollout_ref.model.path
    assert cfg.actor_rollout_ref.rollout.n_agent == 1 and not cfg.actor_rollout_ref.actor.use_kl_loss
    # As many rollouts a step as the GRPO demo (32 prompts x 5 samples), so the step time is alike.
    assert cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n_agent == 160
    assert cfg.trainer.experiment_name == "demo-ppo"


def test_train_grpo_sh_on_cpu_still_runs_the_grpo_demo_and_arguments_still_win(tmp_path: Path) -> None:
    algorithm, cfg = composed(demo_argv("train_grpo.sh", tmp_path / "grpo"))
    assert (algorithm, cfg.algorithm.adv_estimator, cfg.actor_rollout_ref.rollout.n_agent) == ("grpo", "grpo", 5)
    # The user's arguments come after the hook's demo.algorithm=ppo, so they win.
    argv = demo_argv("train_ppo.sh", tmp_path / "ppo", "demo.algorithm=grpo", "critic.optim.lr=5e-4")
    algorithm, cfg = composed(argv)
    assert (algorithm, cfg.algorithm.adv_estimator) == ("grpo", "grpo")
    with pytest.raises(SystemExit, match="demo.algorithm takes grpo or ppo"):
        split_algorithm(["demo.algorithm=dpo"])


@pytest.mark.slow
def test_tiny_ppo_demo_runs_end_to_end_logs_the_critic_and_its_try_command_answers(tmp_path: Path) -> None:
    summary = run_demo([*tiny_args(tmp_path), "demo.algorithm=ppo", "critic.ppo_micro_batch_size=8"])
    written = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert written["algorithm"] == "ppo"
    records = [json.loads(line) for line in Path(summary.metrics_path).read_text().splitlines()]
    for key in ("critic/vf_loss", "critic/values/mean", "critic/vf_explained_var"):
        assert any(key in r for r in records), key
    assert Path(summary.plot_path).read_bytes()[:4] == b"\x89PNG"
    # The summary's "try it" line runs as printed: the demo's server comes up, the trained model answers.
    cmd = shlex.split(summary.try_command)
    assert cmd[:3] == ["python", "infer.py", "--demo"] and "--question" in cmd
    proc = subprocess.run([sys.executable, *cmd[1:], "--max_new_tokens", "24"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "# Answer:" in proc.stdout and "# Golden answer:" in proc.stdout
