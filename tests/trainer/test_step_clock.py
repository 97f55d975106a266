"""perf/step_wall_s and perf/host_cpu_util: the clock between two training steps' ends."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from verl.trainer.ppo import metric_utils as mu


def _stat(path: Path, user: int, nice: int, system: int, idle: int, iowait: int, steal: int = 0) -> None:
    # the layout of Linux's /proc/stat: the aggregate line, then one per CPU
    path.write_text(f"cpu  {user} {nice} {system} {idle} {iowait} 3 4 {steal} 0 0\n"
                    f"cpu0 {user} {nice} {system} {idle} {iowait} 3 4 {steal} 0 0\nintr 1 2 3\n")


def test_util_is_the_busy_share_of_the_cpu_time_between_two_laps(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    _stat(stat, user=100, nice=10, system=20, idle=500, iowait=5)
    clock = mu.StepClock(str(stat))
    # +60 user, +20 nice, +10 system, +5 steal busy; +100 idle, +5 iowait idle: 95 of 200 ticks busy
    _stat(stat, user=160, nice=30, system=30, idle=600, iowait=10, steal=5)
    lap = clock.lap()
    assert lap["perf/host_cpu_util"] == pytest.approx(95 / 200)
    assert lap["perf/step_wall_s"] >= 0.0
    # the next lap starts where this one ended
    _stat(stat, user=160, nice=30, system=30, idle=700, iowait=10, steal=5)
    assert clock.lap()["perf/host_cpu_util"] == 0.0


def test_no_util_where_the_host_has_no_readable_stat(tmp_path: Path) -> None:
    clock = mu.StepClock(str(tmp_path / "missing"))
    time.sleep(0.01)
    lap = clock.lap()
    assert "perf/host_cpu_util" not in lap and lap["perf/step_wall_s"] >= 0.01
    bad = tmp_path / "bad"
    bad.write_text("intr 1 2\n")
    assert mu.host_cpu_times(str(bad)) is None
    bad.write_text("cpu  1 2 3 4 5 6 7\n")     # fewer than the 8 counters read
    assert mu.host_cpu_times(str(bad)) is None


def test_a_busy_loop_shows_on_this_hosts_clock() -> None:
    assert mu.host_cpu_times() is not None   # Linux: /proc/stat
    clock = mu.StepClock()
    end = time.monotonic() + 0.3
    while time.monotonic() < end:
        pass
    lap = clock.lap()
    assert lap["perf/step_wall_s"] >= 0.3
    assert 0.0 < lap["perf/host_cpu_util"] <= 1.0
