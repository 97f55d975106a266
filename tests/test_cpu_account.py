"""tests/cpu_account.py: with SEARCH_R1_TEST_CPU set, each test's process-tree CPU is recorded and the
run ends with the tests that used the most, and the CPU per file; unset, nothing is written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.cpu_account import CPU_DIR_VAR, read_records, summary_lines

REPO = Path(__file__).resolve().parents[1]

# One test burns ~1 s of CPU in a child process it waits for, one in a grandchild it leaves running through the
# test's end (a live descendant), and one sleeps (wall time, no CPU). Each burner lives on for 2.5 s after
# burning (a sample, once a second, sees what it burnt); the grandchild says when it has burnt (a file), so a
# loaded machine only makes the test slower.
TESTS = '''
import os, subprocess, sys, time
BURN = "import sys, time\\nend = time.process_time() + 1.0\\nwhile time.process_time() < end: pass\\n" \\
       "open(sys.argv[1], 'w').close()\\ntime.sleep(2.5)"

def test_burns_in_a_reaped_child(tmp_path):
    subprocess.run([sys.executable, "-c", BURN, str(tmp_path / "burnt")], check=True)

def test_burns_in_a_live_grandchild(tmp_path):
    done = tmp_path / "burnt"
    proc = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.run([sys.executable, '-c', *sys.argv[1:]])",
                             BURN.replace("2.5", "5"), str(done)])
    deadline = time.monotonic() + 120
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(2.5)          # the grandchild has burnt its second and sleeps on, alive; a sample has seen it
    assert done.exists() and proc.poll() is None
    test_burns_in_a_live_grandchild.proc = proc

def test_sleeps():
    time.sleep(0.5)
'''


def _run(tmp_path: Path, cpu_dir: Path | None) -> subprocess.CompletedProcess:
    """pytest on TESTS in tmp_path with the accounting loaded as a plugin (-p tests.cpu_account), as the
    suite's conftest loads it."""
    (tmp_path / "test_burn.py").write_text(TESTS)
    env = {k: v for k, v in os.environ.items() if k not in (CPU_DIR_VAR, "PYTEST_XDIST_WORKER")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    if cpu_dir is not None:
        env[CPU_DIR_VAR] = str(cpu_dir)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.cpu_account", "-p", "no:randomly",
                           "-p", "no:cacheprovider", "-p", "no:xdist", "--rootdir", str(tmp_path), "-c", "/dev/null",
                           str(tmp_path / "test_burn.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_each_tests_tree_cpu_is_recorded_and_the_run_ends_with_the_report(tmp_path: Path) -> None:
    cpu_dir = tmp_path / "cpu"
    proc = _run(tmp_path, cpu_dir)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = {r["test"].rsplit("::", 1)[1]: r for r in read_records(cpu_dir)}
    assert set(records) == {"test_burns_in_a_reaped_child", "test_burns_in_a_live_grandchild", "test_sleeps"}
    assert records["test_burns_in_a_reaped_child"]["cpu_s"] >= 0.9
    assert records["test_burns_in_a_live_grandchild"]["cpu_s"] >= 0.9
    assert records["test_sleeps"]["cpu_s"] < 0.4 and records["test_sleeps"]["wall_s"] >= 0.5
    assert "CPU per test" in proc.stdout and "CPU per file" in proc.stdout
    assert proc.stdout.index("test_burns_in_a_") < proc.stdout.index("test_sleeps")   # most CPU first


def test_without_the_variable_nothing_is_written_or_printed(tmp_path: Path) -> None:
    proc = _run(tmp_path, None)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "CPU per test" not in proc.stdout
    assert not (tmp_path / "cpu").exists()


def test_the_report_sums_per_file_and_orders_by_cpu() -> None:
    records = [{"test": "tests/a.py::t1", "cpu_s": 1.0, "wall_s": 5.0},
               {"test": "tests/b.py::t2", "cpu_s": 7.0, "wall_s": 9.0},
               {"test": "tests/a.py::t3", "cpu_s": 3.0, "wall_s": 1.0}]
    lines = summary_lines(records, shown=2)
    assert lines[0].startswith("3 tests: 11 s of CPU in 15 s of test time")
    assert [line.split()[-1] for line in lines[2:4]] == ["tests/b.py::t2", "tests/a.py::t3"]
    per_file = lines[lines.index("CPU per file (cpu_s wall_s file):") + 1:]
    assert [line.split() for line in per_file] == [["7.0", "9.0", "tests/b.py"], ["4.0", "6.0", "tests/a.py"]]
