"""A local single-machine run starts Ray quietly: no token-authentication warning, no token file.

Ray 2.60 turns token auth on by default for a new local `ray.init()`: it warns on every run and
writes `~/.ray/auth_token`. The trainer's local cluster (no trainer.ray_address / RAY_ADDRESS)
sets RAY_AUTH_MODE=disabled unless the user chose a mode. Each case starts Ray the way the
trainer does (`main_ppo._init_ray`) in a subprocess whose HOME is a temporary folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WARNING = "Token authentication is enabled for this Ray cluster"
START = """
import ray
from verl.trainer.main_ppo import _init_ray, compose_config

config = compose_config(["trainer.device=cpu", "trainer.n_gpus_per_node=1"])
assert _init_ray(config, use_gpu=False), "a local Ray was not started"
print("auth mode:", __import__("os").environ.get("RAY_AUTH_MODE"), flush=True)
ray.shutdown()
"""


def _start_local_ray(home: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    return subprocess.run([sys.executable, "-c", START], cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**clean, "HOME": str(home), **env})


def _files_under(home: Path) -> list[str]:
    return sorted(str(p.relative_to(home)) for p in home.rglob("*"))


def test_local_ray_starts_without_token_auth_warning_or_token_file(tmp_path: Path) -> None:
    result = _start_local_ray(tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "auth mode: disabled" in result.stdout
    assert WARNING not in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / ".ray" / "auth_token").exists(), _files_under(tmp_path)


@pytest.mark.slow
def test_an_explicit_auth_mode_still_wins(tmp_path: Path) -> None:
    """RAY_AUTH_MODE=token set by the user is kept: Ray then writes its token under HOME as usual."""
    result = _start_local_ray(tmp_path, RAY_AUTH_MODE="token")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "auth mode: token" in result.stdout
    assert (tmp_path / ".ray" / "auth_token").is_file(), _files_under(tmp_path)
