"""scripts/mutation.py's fast runner (`--fast`): mutmut generates the mutants and its per-function
test stats, long-lived pytest workers test them (see docs/testing.md, "Mutation testing").

mutmut's runner forks every mutant's pytest from a warm server and gives it a wall limit of
(tests' time + 30 s) x 10, over 5 minutes, so each mutant that loops forever (llm_agent has some)
costs 5 minutes, and every pytest session ends in collections of torch's whole heap. `--fast`
keeps mutmut for generating the mutants and collecting which tests reach each function, then runs
each mutant's tests (the same selection and pytest arguments as mutmut) in long-lived worker
processes that switch mutants through mutmut's trampolines, with a limit of 20 s + 5 x the tests'
time, and writes the verdicts (mutmut's exit codes) into mutmut's own .meta files, so
`mutmut results/show`, `--recheck` and the report work unchanged. docs/testing.md: its check.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

# Runs in the scratch root: mutmut's `run` up to and including its stats collection, then the plan
# (every mutant, its tests as mutmut would select them and their estimated time), fastest first.
GENERATE = """
import json, os, sys
from mutmut.__main__ import (collect_or_load_stats, collect_source_file_mutation_data, copy_also_copy_files,
    copy_src_dir, create_mutants, get_mutant_runner, setup_source_paths, store_lines_covered_by_tests,
    _check_test_to_mutant_associations)
from mutmut.mutation.trampoline import set_mutant_under_test
from mutmut.state import state
from mutmut.utils.format_utils import mangled_name_from_mutant_name
children = int(sys.argv[1])
set_mutant_under_test("mutant_generation")
os.makedirs("mutants", exist_ok=True)
copy_src_dir(); copy_also_copy_files(); setup_source_paths(); store_lines_covered_by_tests()
create_mutants(children)
collect_or_load_stats(get_mutant_runner(children), mutants_caught_by_type_checker={}, apply_config_invalidation=True)
mutants, by_path = collect_source_file_mutation_data(mutant_names=())
_check_test_to_mutant_associations(by_path)
plan = []
for data, name, _ in mutants:
    name = name.replace("__init__.", "")
    tests = sorted(state().tests_by_mangled_function_name.get(mangled_name_from_mutant_name(name), set()))
    plan.append({"name": name, "meta": str(data.meta_path), "tests": tests,
                 "estimate": sum(state().duration_by_test[t] for t in tests)})
plan.sort(key=lambda m: m["estimate"])
with open("mutants/fast-plan.json", "w") as f:
    json.dump(plan, f, indent=1)
"""

# A worker, in mutants/: reads one job per line on stdin ({"name": mutant, "tests": [...]}), runs
# pytest.main on the tests with that mutant active, writes `[name, exit code, seconds]` on its
# original stdout; pytest's own output goes to the log file (argv[2]).
_FAST_WORKER = """
import gc, json, os, sys, time
results = os.fdopen(os.dup(1), "w", buffering=1)
log = os.open(sys.argv[2], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
os.dup2(log, 1); os.dup2(log, 2)
import pytest
from mutmut.mutation.trampoline import set_mutant_under_test
args = json.loads(sys.argv[1])
for line in sys.stdin:
    job = json.loads(line)
    print(f"===== {job['name'] or '(no mutant)'}", flush=True)
    set_mutant_under_test(job["name"])
    start = time.monotonic()
    try:
        rc = int(pytest.main(args + job["tests"]))
    except Exception:
        rc = -1
    rc = -1 if rc == 4 else rc   # a usage error: mutmut's runner reports it as -1 (suspicious)
    set_mutant_under_test("")
    if not gc.get_freeze_count():
        # pytest ends each session with repeated gc.collect() (unraisableexception); with torch and
        # transformers imported that is ~0.5 s a mutant. Objects alive after the first session
        # (modules, import-time state) are left out of later collections, as in gc.freeze's doc.
        gc.collect()
        gc.freeze()
    results.write(json.dumps([job["name"], rc, round(time.monotonic() - start, 3)]) + "\\n")
"""

TIMEOUT_EXIT = 36   # mutmut's exit code for "timeout"; 33 is "no tests"
NO_TESTS_EXIT = 33
FAST_RESTART_EVERY = 100    # mutants per worker before its canary run and restart
FAST_TIMEOUT = (20.0, 5.0)  # a mutant's wall limit: 20 s + 5 x its tests' time in the stats run


class FastWorker:
    """One long-lived pytest process (in mutants/) that tests mutants one after another."""

    def __init__(self, mutants: Path, index: int, pytest_args: list[str], python: str) -> None:
        self.mutants, self.index, self.python = mutants, index, python
        self.pytest_args = [*pytest_args, f"--basetemp={mutants.parent / f'fast-basetemp-{index}'}"]
        self.log = mutants.parent / f"fast-worker-{index}.log"
        self.proc: subprocess.Popen[str] | None = None
        self.batch: list[dict] = []   # mutants tested since the worker started
        self.job: dict | None = None  # the one running now
        self.started = self.deadline = 0.0

    def start(self) -> None:
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        env.pop("MUTANT_UNDER_TEST", None)
        self.proc = subprocess.Popen([self.python, "-c", _FAST_WORKER, json.dumps(self.pytest_args), str(self.log)],
                                     cwd=self.mutants, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)
        self.batch = []

    def stop(self) -> int | None:
        """Kill the process (if any); its exit status."""
        if self.proc is None:
            return None
        self.proc.kill()
        code = self.proc.wait()
        self.proc = None
        return code

    def submit(self, job: dict, timeout_s: float) -> None:
        if self.proc is None:
            self.start()
        assert self.proc is not None and self.proc.stdin is not None
        self.job, self.started = job, time.monotonic()
        self.deadline = self.started + timeout_s
        self.proc.stdin.write(json.dumps({"name": job["name"], "tests": job["tests"]}) + "\n")
        self.proc.stdin.flush()

    def read_result(self) -> tuple[int, float] | None:
        """The running job's (exit code, seconds), or None if the process died."""
        assert self.proc is not None and self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            return None
        _, rc, seconds = json.loads(line)
        return rc, seconds


def fast_pytest_args(root: Path) -> list[str]:
    """The arguments mutmut's PytestRunner passes pytest for one mutant, less the tests."""
    try:
        from tomllib import loads
    except ImportError:   # Python 3.10
        from toml import loads
    cfg = loads((root / "pyproject.toml").read_text())["tool"]["mutmut"]
    return ["--rootdir=.", "--tb=native", "-x", "-q", "-p", "no:randomly", "-p", "no:random-order",
            *cfg.get("pytest_add_cli_args", [])]


def run_fast(root: Path, python: str, workers: int, only: list[str] | None = None, log: Path | None = None,
             restart_every: int = FAST_RESTART_EVERY, timeout: tuple[float, float] = FAST_TIMEOUT) -> dict:
    """Test the mutants of mutants/fast-plan.json (those matching the globs `only`, if given) in
    `workers` long-lived pytest processes, writing the verdicts into mutmut's .meta files.

    Guards against one mutant's leftovers deciding another's verdict: a baseline (no mutant) and
    mutmut's forced-fail check first; each worker restarts after `restart_every` mutants, after a
    crash and after a timeout; before a planned restart it reruns every test with no mutant (the
    canary), and if that fails, its batch is tested again with one fresh process per mutant."""
    import fnmatch
    import selectors
    mutants = root / "mutants"
    plan: list[dict] = json.loads((mutants / "fast-plan.json").read_text())
    if only:
        plan = [m for m in plan if any(fnmatch.fnmatch(m["name"], pattern) for pattern in only)]
    meta = {path: json.loads((root / path).read_text()) for path in {m["meta"] for m in plan}}
    all_tests = sorted({t for m in plan for t in m["tests"]})
    canary = {"name": "", "tests": all_tests, "estimate": max((m["estimate"] for m in plan), default=0.0),
              "canary": True}
    out = open(log or root / "fast-run.log", "a")

    def say(message: str) -> None:
        out.write(f"[fast {time.strftime('%H:%M:%S')}] {message}\n")
        out.flush()

    def record(job: dict, exit_code: int, seconds: float) -> None:
        data = meta[job["meta"]]
        data["exit_code_by_key"][job["name"]] = exit_code
        data["durations_by_key"][job["name"]] = round(seconds, 3)
        data["estimated_durations_by_key"][job["name"]] = job["estimate"]

    def save() -> None:
        for path, data in meta.items():
            tmp = root / (path + ".tmp")
            tmp.write_text(json.dumps(data, indent=4))
            tmp.replace(root / path)

    probe = FastWorker(mutants, 0, fast_pytest_args(root), python)
    for name, want_pass in (("", True), ("fail", False)):
        probe.submit({**canary, "name": name}, 3600)
        result = probe.read_result()
        if result is None or (result[0] == 0) != want_pass:
            probe.stop()
            raise SystemExit(f"fast mode: the {'baseline' if want_pass else 'forced-fail check'} gave {result}; "
                             f"see {probe.log}")
        say(f"{'baseline (no mutant)' if want_pass else 'forced-fail check'}: exit {result[0]} in {result[1]} s")
    probe.stop()

    queue = [m for m in plan if m["tests"]]
    for job in plan:
        if not job["tests"]:
            record(job, NO_TESTS_EXIT, 0.0)
    pool = [FastWorker(mutants, i, fast_pytest_args(root), python) for i in range(workers)]
    selector = selectors.DefaultSelector()
    retried: set[str] = set()
    done, start = 0, time.monotonic()

    def halt(worker: FastWorker) -> int | None:
        if worker.proc is not None:
            selector.unregister(worker.proc.stdout)   # type: ignore[arg-type]
        return worker.stop()

    def dispatch(worker: FastWorker) -> None:
        """Give `worker` its next job: the canary when its batch is full (or the queue empty), else
        the next mutant, in a fresh process if the worker has none or the mutant is to be isolated."""
        worker.job = None
        if worker.proc is not None and worker.batch and (len(worker.batch) >= restart_every or not queue):
            worker.submit(canary, timeout[0] + timeout[1] * canary["estimate"])
            return
        if not queue:
            halt(worker)
            return
        job = queue.pop(0)
        if job.get("isolated"):
            halt(worker)
        if worker.proc is None:
            worker.start()
            assert worker.proc is not None
            selector.register(worker.proc.stdout, selectors.EVENT_READ, worker)   # type: ignore[arg-type]
        worker.submit(job, timeout[0] + timeout[1] * job["estimate"])

    def finish(worker: FastWorker, job: dict, result: tuple[int, float]) -> None:
        nonlocal done
        if job.get("canary"):
            batch = worker.batch
            halt(worker)
            say(f"canary (no mutant, after {len(batch)} mutants): exit {result[0]} in {result[1]:.1f} s")
            if result[0] != 0:   # an earlier mutant broke the process: retest the batch, one process each
                say(f"canary failed (exit {result[0]}) after {len(batch)} mutants: retesting them isolated")
                queue[:0] = [{**m, "isolated": True} for m in batch]
                done -= len(batch)
        else:
            record(job, *result)
            done += 1
            say(f"{job['name']}: exit {result[0]} in {result[1]:.1f} s")
            worker.batch.append(job)
            if job.get("isolated"):
                halt(worker)
        dispatch(worker)

    for worker in pool:
        dispatch(worker)
    try:
        while any(w.proc is not None for w in pool):
            busy = [w for w in pool if w.proc is not None]
            events = selector.select(timeout=max(0.0, min(w.deadline for w in busy) - time.monotonic()))
            answered = set()
            for key, _ in events:
                worker: FastWorker = key.data
                job = worker.job
                assert job is not None
                answered.add(worker.index)
                result = worker.read_result()
                if result is None:   # the process died: retry once in a fresh one, else keep its exit status
                    code = halt(worker)
                    if job["name"] not in retried and not job.get("canary"):
                        retried.add(job["name"])
                        say(f"{job['name']}: worker died ({code}), retrying in a fresh one")
                        queue.insert(0, {**job, "isolated": True})
                        dispatch(worker)
                        continue
                    result = (code if code is not None else -1, time.monotonic() - worker.started)
                finish(worker, job, result)
            for worker in pool:
                if (worker.proc is not None and worker.index not in answered
                        and time.monotonic() > worker.deadline and worker.job is not None):
                    job = worker.job
                    halt(worker)
                    finish(worker, job, (TIMEOUT_EXIT if not job.get("canary") else 1,
                                         time.monotonic() - worker.started))
            save()
    finally:
        for worker in pool:
            worker.stop()
        save()
    elapsed = time.monotonic() - start
    say(f"{done} mutants tested in {elapsed:.0f} s ({60 * done / max(elapsed, 1e-9):.1f} a minute), "
        f"{len(plan) - len([m for m in plan if m['tests']])} without tests")
    return {"tested": done, "seconds": round(elapsed)}
