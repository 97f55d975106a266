"""Run a launcher (train_*.sh, example/*.sh, an sbatch file) with stand-ins for `python3` (and,
for the sbatch files, `srun` and `scontrol`) that record what they were asked to do, so a test
can compose the exact Hydra overrides the launcher would hand to `verl.trainer.main_ppo`.

The stand-in python3 records only `python3 -m ...` calls (the launchers' GPU probe `python3 -c`
exits 0); the stand-in srun records its arguments and fails, which stops ray_on_slurm.sh at the
first step that would start a process on a node.
"""

from __future__ import annotations

import os
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.multinode._local_ray import REPO

# Variables of the developer's shell that would change what a launcher does.
_DROP = ("RAY_ADDRESS", "SLURM_NNODES", "BASE_MODEL", "RETRIEVER_URL", "N_GPUS", "NNODES", "GPUS_PER_NODE",
         "TP_SIZE", "TRAIN_SCRIPT", "SEARCH_R1_VENV", "SEARCH_R1_DIR", "WORKERS_PER_NODE",
         "VLLM_ATTENTION_BACKEND", "CRITIC_MICRO_BATCH_SIZE", "PREFLIGHT")

FAKE_PYTHON = """#!/bin/sh
[ "$1" = "-m" ] || exit 0
printf "%s\\n" "$@" > "$REC_DIR/argv.txt"
env > "$REC_DIR/env.txt"
"""
FAKE_SRUN = """#!/bin/sh
printf "%s\\n" "$*" >> "$REC_DIR/srun.txt"
exit 1
"""
FAKE_SCONTROL = """#!/bin/sh
# scontrol show hostnames <list>: one name per node (SLURM_NNODES of them)
i=1
while [ "$i" -le "${SLURM_NNODES:-1}" ]; do echo "node$i"; i=$((i + 1)); done
"""


@dataclass(frozen=True)
class Recorded:
    returncode: int
    output: str              # the launcher's stdout + stderr
    overrides: list[str]     # what it passed after `python3 -m verl.trainer.main_ppo` (empty if not reached)
    env: dict[str, str]      # the environment python3 saw
    srun_calls: list[str]    # sbatch path: each srun command line, in order


def _stand_in(folder: Path, name: str, text: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def run_recorded(script: str, tmp_path: Path, env: dict[str, str] | None = None, args: tuple[str, ...] = (),
                 real_python: bool = False) -> Recorded:
    """Run `bash <REPO>/<script> <args>` with the stand-ins; `real_python` keeps the venv's python3
    (the sbatch path then runs the real preflight) and replaces only srun and scontrol."""
    rec = tmp_path / "rec"
    fake_bin, fake_venv = tmp_path / "bin", tmp_path / "venv"
    _stand_in(fake_bin, "srun", FAKE_SRUN)
    _stand_in(fake_bin, "scontrol", FAKE_SCONTROL)
    if not real_python:
        _stand_in(fake_bin, "python3", FAKE_PYTHON)
        _stand_in(fake_venv / "bin", "python3", FAKE_PYTHON)   # ray_on_slurm.sh puts the venv first
    rec.mkdir(exist_ok=True)
    run_env = {k: v for k, v in os.environ.items() if k not in _DROP}
    path = os.environ["PATH"] if not real_python else f"{REPO / '.venv' / 'bin'}:{os.environ['PATH']}"
    run_env.update(PATH=f"{fake_bin}:{path}", REC_DIR=str(rec), EXPERIMENT_NAME=str(tmp_path / "exp"),
                   SEARCH_R1_VENV=str(REPO / ".venv") if real_python else str(fake_venv), SEARCH_R1_DIR=str(REPO),
                   # an active venv: scripts/use_venv.sh then leaves PATH as it is (the stand-in python3 first)
                   VIRTUAL_ENV=str(REPO / ".venv") if real_python else str(fake_venv))
    run_env.update(env or {})
    proc = subprocess.run(["bash", str(REPO / script), *args], env=run_env, capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    argv = (rec / "argv.txt").read_text().splitlines() if (rec / "argv.txt").exists() else []
    if argv:
        assert argv[:2] == ["-m", "verl.trainer.main_ppo"], argv[:3]
    seen_env = {}
    if (rec / "env.txt").exists():
        seen_env = dict(line.split("=", 1) for line in (rec / "env.txt").read_text().splitlines() if "=" in line)
    srun = (rec / "srun.txt").read_text().splitlines() if (rec / "srun.txt").exists() else []
    return Recorded(proc.returncode, proc.stdout + proc.stderr, argv[2:], seen_env, srun)


def slurm_env(nnodes: int, gpus_per_node: int) -> dict[str, str]:
    """What Slurm sets in a batch job of `nnodes` nodes with `gpus_per_node` GPUs each."""
    return {"SLURM_JOB_NODELIST": f"node[1-{nnodes}]", "SLURM_JOB_ID": "4242", "SLURM_NNODES": str(nnodes),
            "SLURM_GPUS_ON_NODE": str(gpus_per_node), "SLURM_SUBMIT_DIR": str(REPO)}
