"""A newcomer's first commands (issue 43 item 15): the launchers from a new shell, no venv activated.

The launchers source scripts/use_venv.sh: with no virtual environment active, the repository's
.venv goes first on PATH, and a Python without the packages stops with the command that fixes it,
not a ModuleNotFoundError. A config mistake on the demo path prints its message alone, as main_ppo does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.demo.build import split_args

ROOT = Path(__file__).resolve().parents[1]
LAUNCHERS = ("train_grpo.sh", "train_ppo.sh", "retrieval_launch.sh", "scripts/nq_hotpotqa/evaluate.sh",
             "example/tool_recipe/run_qwen2.5-3b_instruct_search_multiturn.sh")


def new_shell_env(path: str) -> dict[str, str]:
    """What `env -i` leaves a login shell: no VIRTUAL_ENV, a PATH without any venv."""
    return {"PATH": path, "HOME": os.environ.get("HOME", "/tmp"), "LANG": "C.UTF-8"}


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_without_a_venv_a_launcher_prints_the_command_that_installs_the_packages(launcher: str,
                                                                                 tmp_path: Path) -> None:
    # A checkout with no .venv and a python3 that sees no site-packages (-S): a fresh machine's.
    for rel in (launcher, "scripts/use_venv.sh"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    env = new_shell_env(f"{bin_dir}:/usr/bin:/bin") | {"BASE_MODEL": "unused"}
    result = subprocess.run(["bash", str(tmp_path / launcher)], env=env, cwd=tmp_path, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    assert f"bash {tmp_path}/scripts/setup_env.sh" in result.stderr
    assert f"{tmp_path}/.venv does not exist" in result.stderr and "missing torch" in result.stderr \
        or "missing fastapi" in result.stderr
    assert "ModuleNotFoundError" not in result.stderr and "Traceback" not in result.stderr


needs_venv = pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "python").is_file(),
                                reason="needs the repository's .venv (bash scripts/setup_env.sh test)")


@needs_venv
def test_a_new_shell_gets_the_repository_venv_and_an_active_venv_is_kept() -> None:
    script = f"source {ROOT}/scripts/use_venv.sh && require_python_modules torch transformers ray hydra pandas " \
             "&& command -v python3 && command -v python"
    result = subprocess.run(["bash", "-c", script], env=new_shell_env("/usr/bin:/bin"), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [f"{ROOT}/.venv/bin/python3", f"{ROOT}/.venv/bin/python"]
    # An activated environment is the user's choice: PATH is left as it is.
    active = new_shell_env("/usr/bin:/bin") | {"VIRTUAL_ENV": "/opt/some-env"}
    result = subprocess.run(["bash", "-c", f"source {ROOT}/scripts/use_venv.sh && command -v python3"], env=active,
                            capture_output=True, text=True, timeout=60)
    assert not result.stdout.startswith(str(ROOT))


def test_a_config_error_on_the_demo_path_is_the_message_alone(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture) -> None:
    from transformers.utils import logging as hf_logging

    from scripts.demo import run_demo

    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")   # main() sets it; monkeypatch restores it
    monkeypatch.setattr(sys, "argv", ["run_demo.py", "trainer.bogus_key=1"])
    try:
        with pytest.raises(SystemExit) as stopped:
            run_demo.main()
    finally:
        hf_logging.enable_progress_bar()
    assert stopped.value.code == 1 and stopped.value.__cause__ is None and stopped.value.__suppress_context__
    err = capsys.readouterr().err
    assert err.startswith("[demo] config error:") and "trainer.bogus_key is not a setting of this project" in err


@pytest.mark.slow   # imports torch twice in fresh processes: 15 s idle, a minute on a busy 2-core machine
@needs_venv
def test_train_grpo_from_a_new_shell_runs_the_venv_up_to_a_config_error_printed_alone() -> None:
    # No `source .venv/bin/activate`; /usr/bin's python3 has none of the packages (pandas, torch).
    result = subprocess.run(["bash", str(ROOT / "train_grpo.sh"), "trainer.bogus_key=1"],
                            env=new_shell_env("/usr/bin:/bin"), cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 1, result.stderr
    assert "trainer.bogus_key is not a setting of this project" in result.stderr
    assert "Traceback" not in result.stderr and "ModuleNotFoundError" not in result.stderr


def test_a_demo_setting_of_the_wrong_type_names_the_setting() -> None:
    with pytest.raises(SystemExit, match=r"demo.n_val_per_kind takes an integer \(default \d+\), got 'many'"):
        split_args(["demo.n_val_per_kind=many"])
    with pytest.raises(SystemExit, match=r"demo.sft_steps takes comma-separated integers .*got '3,x'"):
        split_args(["demo.sft_steps=3,x"])
