"""CI runs the README's test command exactly (.ci/run), on xdist workers with the groups honoured."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_test_command() -> str:
    lines = [ln for ln in (ROOT / "README.md").read_text().splitlines()
             if ln.startswith("bash scripts/setup_env.sh test && ")]
    assert len(lines) == 1, f"README.md should hold one test command line, found {lines}"
    return lines[0]


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert readme_test_command() in ci, ".ci/run does not run README.md's test command as written"


def test_the_readme_command_runs_on_workers_with_the_groups_kept() -> None:
    """`-n` without `--dist loadgroup` would ignore the xdist groups (tests/conftest.py): a module's
    shared fixture would then be built on every worker."""
    cmd = readme_test_command()
    assert re.search(r" -n \d+ ", f"{cmd} ") and " --dist loadgroup" in cmd, cmd
