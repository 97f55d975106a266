"""Per-test CPU accounting, on when SEARCH_R1_TEST_CPU names a folder (`.ci/run` sets it for the slow suite).

The suite is CPU-bound on 2 cores (docs/testing.md "Parallel runs"), so a test's wall time under xdist says
more about its neighbours than about itself. This records, for each test (setup, call and teardown
together), the CPU its process tree used: the pytest process itself, the children it reaped (CLI
subprocesses, spawned gloo ranks, a Ray it started and stopped) and the CPU of every descendant still alive
(the session's Ray and the actors it reaped). Each process appends one JSON line a test to
<folder>/<worker>.jsonl; the controller prints the tests that used the most CPU, and the CPU per file, at
the end of the run. What escapes it: processes that left the tree (a daemonised `ray start` node's), so the
multinode tests' figures are lower bounds.
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

CPU_DIR_VAR = "SEARCH_R1_TEST_CPU"
SHOWN = 40   # the top tests printed at the end


def tree_cpu_seconds() -> float:
    """User + system CPU seconds of this process, its reaped children and every live descendant
    (with the children those have reaped)."""
    import psutil

    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    for proc in psutil.Process().children(recursive=True):
        try:
            t = proc.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def _folder() -> Path | None:
    value = os.environ.get(CPU_DIR_VAR)
    return Path(value) if value else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    folder = _folder()
    if folder is None:
        yield
        return
    wall, cpu = time.monotonic(), tree_cpu_seconds()
    yield
    record = {"test": item.nodeid, "wall_s": round(time.monotonic() - wall, 2),
              "cpu_s": round(tree_cpu_seconds() - cpu, 2)}
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.jsonl", "a") as out:
        out.write(json.dumps(record) + "\n")


def read_records(folder: Path) -> list[dict]:
    """Every test's record of the run, from each process's file."""
    return [json.loads(line) for path in sorted(folder.glob("*.jsonl")) for line in path.read_text().splitlines()
            if line.strip()]


def summary_lines(records: list[dict], shown: int = SHOWN) -> list[str]:
    """The report: total CPU and wall of the tests, the `shown` tests that used the most CPU, then the CPU
    of each test file, largest first."""
    by_cpu = sorted(records, key=lambda r: -r["cpu_s"])
    per_file: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for r in records:
        totals = per_file[r["test"].split("::", 1)[0]]
        totals[0] += r["cpu_s"]
        totals[1] += r["wall_s"]
    lines = [f"{len(records)} tests: {sum(r['cpu_s'] for r in records):.0f} s of CPU in "
             f"{sum(r['wall_s'] for r in records):.0f} s of test time (their process trees; {CPU_DIR_VAR})",
             f"the {min(shown, len(records))} that used the most CPU (cpu_s wall_s test):"]
    lines += [f"{r['cpu_s']:8.1f} {r['wall_s']:8.1f}  {r['test']}" for r in by_cpu[:shown]]
    lines.append("CPU per file (cpu_s wall_s file):")
    lines += [f"{cpu:8.1f} {wall:8.1f}  {name}"
              for name, (cpu, wall) in sorted(per_file.items(), key=lambda kv: -kv[1][0])]
    return lines


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    folder = _folder()
    if folder is None or os.environ.get("PYTEST_XDIST_WORKER") or not folder.is_dir():
        return
    records = read_records(folder)
    if records:
        terminalreporter.section("CPU per test")
        for line in summary_lines(records):
            terminalreporter.write_line(line)
