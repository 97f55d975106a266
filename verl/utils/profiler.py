"""veRL's `global_profiler` with `tool: torch`: chrome traces of chosen training steps, from the driver
and from every worker process (docs/performance.md "Profiling").

    global_profiler.tool=torch global_profiler.steps=[2] global_profiler.save_path=outputs/profile
    # -> outputs/profile/step_2/driver.json, step_2/actor_rollout_rank0.json, step_2/actor_rollout_rank1.json, ...

Each process records torch's CPU activity (and CUDA's where it has a GPU) from the start of the step to
its end; open a file in chrome://tracing or https://ui.perfetto.dev. The driver's trace names the
step's stages (the trainer's timers: gen, old_log_prob, update_actor, ...), a worker's the registered
methods it ran. A colocated critic shares its actor's process, so its work is in that trace.
Departure from veRL: one trace per process and step (veRL's torch tool writes one per role); veRL's
nsys tool is not wired in: run the job under nsys instead (the docs say how).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

TOOLS = ("torch",)
KEY = "global_profiler"


@dataclass(frozen=True)
class ProfilerConfig:
    """`global_profiler`: tool (null: off | torch), the training steps to profile (counted from 1), and
    where the traces go."""

    tool: str | None = None
    steps: tuple[int, ...] = ()
    save_path: str = "outputs/profile"

    @classmethod
    def from_config(cls, config: Any) -> ProfilerConfig:
        node = config.get(KEY) or {}
        return cls(tool=node.get("tool"), steps=tuple(int(s) for s in node.get("steps") or ()),
                   save_path=str(node.get("save_path") or "outputs/profile"))

    @staticmethod
    def errors(config: Any) -> list[str]:
        """What is wrong with `global_profiler`, each naming its key."""
        node, errors = config.get(KEY) or {}, []
        tool, steps = node.get("tool"), node.get("steps")
        if tool == "nsys":
            errors.append(f"{KEY}.tool=nsys is not wired into the trainer here: run the job under `nsys profile` "
                          "(docs/performance.md \"Profiling\"), or use tool=torch")
        elif tool is not None and tool not in TOOLS:
            errors.append(f"{KEY}.tool={tool!r} is unknown; choose null or one of {list(TOOLS)}")
        if steps is not None and (isinstance(steps, str | int) or not all(
                isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in steps)):
            errors.append(f"{KEY}.steps={steps!r} must be a list of training steps counted from 1 (e.g. [1, 3]) or null")
        if tool is not None and not steps:
            errors.append(f"{KEY}.tool={tool} profiles the steps in {KEY}.steps, which is empty")
        if not node.get("save_path", "outputs/profile"):
            errors.append(f"{KEY}.save_path must name a folder")
        return errors

    def profiles(self, step: int) -> bool:
        return self.tool == "torch" and step in self.steps


def profiled_range(name: str) -> AbstractContextManager:
    """A named range in this process's trace while a profile records; nothing otherwise (record_function
    costs ~0.1 ms even with no profiler)."""
    return torch.profiler.record_function(name) if torch.autograd._profiler_enabled() else nullcontext()


def trace_path(save_path: str | Path, step: int, name: str) -> Path:
    """Where process `name` writes its chrome trace of training step `step`."""
    return Path(save_path) / f"step_{step}" / f"{name}.json"


class TorchTrace:
    """This process's torch.profiler session, written as a chrome trace when stopped."""

    def __init__(self) -> None:
        self._prof: Any = None
        self._path: Path | None = None

    @property
    def active(self) -> bool:
        return self._prof is not None

    def start(self, path: Path) -> None:
        from torch.profiler import ProfilerActivity, profile

        if self._prof is not None:
            raise RuntimeError(f"a torch profile is already recording (to {self._path})")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._prof, self._path = profile(activities=activities), Path(path)
        self._prof.start()

    def stop(self) -> str | None:
        """Stop recording and write the trace; returns its path (None when nothing was recording)."""
        if self._prof is None:
            return None
        prof, path = self._prof, self._path
        self._prof = self._path = None
        prof.stop()
        assert path is not None
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
        return str(path)


class StepProfiler:
    """The driver's side: around each profiled training step, a trace of the driver and one per worker of
    each worker group (`groups()` -> [(name, worker group)], asked when a step starts). `begin(step)`
    before a training step's work, `end(done_steps)` after it: a step that takes several calls (dynamic
    sampling's generation batches) stays in one trace until the step count reaches it."""

    def __init__(self, cfg: ProfilerConfig, groups: Callable[[], Sequence[tuple[str, Any]]]) -> None:
        self.cfg = cfg
        self._groups = groups
        self._driver = TorchTrace()
        self._step: int | None = None
        self._recording: list[Any] = []
        self.written: list[str] = []

    def begin(self, step: int) -> None:
        if self._step is not None or not self.cfg.profiles(step):
            return
        self._step = step
        self._recording = []
        for name, group in self._groups():
            group.start_profile(self.cfg.save_path, step, name)
            self._recording.append(group)
        self._driver.start(trace_path(self.cfg.save_path, step, "driver"))

    def end(self, done_steps: int | None = None) -> None:
        """Write the traces when `done_steps` (the trainer's step count) reached the profiled step; None: now."""
        if self._step is None or (done_steps is not None and done_steps < self._step):
            return
        self._step = None
        path = self._driver.stop()
        if path is not None:
            self.written.append(path)
        for group in self._recording:
            self.written.extend(p for p in group.stop_profile() if p)
        self._recording = []

    def abort(self) -> None:
        """End a recording left open by a failed step, writing what can be written; a worker that cannot
        answer (it died) is logged, not raised, so the step's own error is the one reported."""
        step = self._step
        if step is None:
            return
        try:
            self.end()
        except Exception as exc:   # noqa: BLE001 -- the run is already failing with its own error
            logger.warning("global_profiler: the traces of step %s were not all written: %s", step, exc)
            self._step, self._recording = None, []


@contextmanager
def simple_timer(name: str, timing_raw: dict[str, float]) -> Iterator[None]:
    """veRL's timer, which its agent loops time engine and tool calls with: adds the block's seconds to
    `timing_raw[name]`."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timing_raw[name] = timing_raw.get(name, 0.0) + time.perf_counter() - start
