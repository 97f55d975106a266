"""Per-test CPU accounting, on when SEARCH_R1_TEST_CPU names a folder (`.ci/run` sets it for the slow suite).

The suite is CPU-bound on 2 cores (docs/testing.md "Parallel runs"), so a test's wall time under xdist says
more about its neighbours than about itself. This records, for each test (setup, call and teardown
together), the CPU its process tree used: the pytest process itself plus every descendant (CLI
subprocesses, spawned gloo ranks, the session's Ray and its actors), sampled once a second by a thread while
the test runs. Sampling, not the kernel's count of reaped children: Ray's raylet does not wait for the
actors it kills, so their CPU never reaches any parent's count. A process's last second, a process that
lived under a second, and processes that left the tree (a daemonised `ray start` node's) are missed: the
figures are lower bounds. Each process appends one JSON line a test to <folder>/<worker>.jsonl; the
controller prints the tests that used the most CPU, and the CPU per file, at the end of the run.
"""

from __future__ import annotations

import json
import os
import resource
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

CPU_DIR_VAR = "SEARCH_R1_TEST_CPU"
SHOWN = 40   # the top tests printed at the end


SAMPLE_S = 1.0   # how often a test's descendants are sampled (one scan of /proc: ~10-20 ms of CPU)


class TreeSampler:
    """The CPU (user + system) of this process's descendants while a test runs: each process (pid and
    start time) at its first and its latest sample; one that existed when the test began counts from there."""

    def __init__(self) -> None:
        self.seen: dict[tuple[int, float], list[float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="cpu-account")

    def sample(self, initial: bool = False) -> None:
        import psutil

        for proc in psutil.Process().children(recursive=True):
            try:
                with proc.oneshot():
                    key, times = (proc.pid, proc.create_time()), proc.cpu_times()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            cpu = times.user + times.system
            if key in self.seen:
                self.seen[key][1] = cpu
            else:
                self.seen[key] = [cpu if initial else 0.0, cpu]

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.sample()

    def start(self) -> None:
        self.sample(initial=True)
        self._thread.start()

    def stop(self) -> float:
        """Stop sampling; the descendants' CPU seconds since start()."""
        self._stop.set()
        self._thread.join()
        self.sample()
        return sum(last - first for first, last in self.seen.values())


def _self_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _folder() -> Path | None:
    value = os.environ.get(CPU_DIR_VAR)
    return Path(value) if value else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    folder = _folder()
    if folder is None:
        yield
        return
    sampler = TreeSampler()
    wall, own = time.monotonic(), _self_cpu()
    sampler.start()
    yield
    descendants = sampler.stop()
    record = {"test": item.nodeid, "wall_s": round(time.monotonic() - wall, 2),
              "cpu_s": round(_self_cpu() - own + descendants, 2)}
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
