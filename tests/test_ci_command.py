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


def test_each_parameter_of_a_parametrized_shared_fixture_is_a_group_of_its_own(tmp_path: Path) -> None:
    """tests/conftest.py's xdist groups, read from a real collection: test_architectures_e2e.py's
    module-scoped `arch_world` (two models) gives two groups of four tests, which two workers can run at
    once; its test without the fixture has no group (it is handed out alone)."""
    import json
    import os
    import subprocess
    import sys

    (tmp_path / "group_probe.py").write_text(
        "import json\n"
        "def pytest_collection_finish(session):\n"
        "    from tests.conftest import _group_of\n"
        "    print('GROUPS=' + json.dumps({item.nodeid: _group_of(item) for item in session.items}))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "group_probe",
                           "-p", "no:cacheprovider", "tests/trainer/test_architectures_e2e.py"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("GROUPS=")), None)
    assert line is not None, proc.stdout[-2000:] + proc.stderr[-2000:]
    groups = json.loads(line.removeprefix("GROUPS="))
    path = "tests/trainer/test_architectures_e2e.py"
    by_group: dict[str | None, list[str]] = {}
    for nodeid, group in groups.items():
        by_group.setdefault(group, []).append(nodeid)
    assert sorted(g for g in by_group if g is not None) == [f"{path}[arch_world=qwen3]",
                                                            f"{path}[arch_world=qwen3_moe]"]
    for arch in ("qwen3", "qwen3_moe"):
        members = by_group[f"{path}[arch_world={arch}]"]
        assert len(members) == 4 and all(nodeid.endswith(f"[{arch}]") for nodeid in members)
    assert len(by_group[None]) == 2   # the PPO step of each model, without the search world
