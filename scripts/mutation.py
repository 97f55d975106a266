"""Mutation testing of the modules that decide what is trained (mutmut 3), one module at a time.

    nice -n 10 .venv/bin/python scripts/mutation.py                 # every module, smallest first
    nice -n 10 .venv/bin/python scripts/mutation.py core_algos reward  # some of them
    .venv/bin/python scripts/mutation.py --list                      # modules and their tests
    nice -n 10 .venv/bin/python scripts/mutation.py reward --no-fast   # mutmut's own runner
    nice -n 10 .venv/bin/python scripts/mutation.py reward --recheck tests/trainer/test_reward_edges.py
                                                  # after a run: its survivors against new tests only

Not part of CI: a full run of every module takes about 25 minutes on a 2-core machine. Each module runs against
the test files that cover it (MODULES below), in its own scratch copy of the working tree
(`--workdir`, default $TMPDIR/search_r1_mutation/<module>), so runs neither write `mutants/` into
the checkout nor share results between modules. The settings common to every module are the
`[tool.mutmut]` section of pyproject.toml; this script adds the files to mutate and the tests.

mutmut itself is the `mutation` extra (setup.py), not in requirements-lock.txt: unless it is
installed already, the script installs the pinned version into the running interpreter's
environment with the lock as constraints, so no locked package changes version.

Two runners. The fast one (the default) lets mutmut generate the mutants and collect which tests
reach each function, then tests each mutant against those same tests with mutmut's pytest arguments
in a long-lived worker (`run_fast`) with a 20-30 s limit instead of mutmut's 5 minutes, writing the
verdicts into mutmut's own files. mutmut's own (`--no-fast`) starts each mutant's pytest in a fresh
process, re-importing torch and rebuilding fixtures every time. Checked against it on 387 llm_agent
mutants (the same verdicts but one: killed vs timeout) and on all of reward_score (the same score
and survivors); docs/testing.md has the details.

Prints, per module, killed / total and every survivor's name; `mutmut show NAME` in the module's
scratch directory shows a survivor's diff. docs/testing.md lists the scores and the survivors.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script: the repo's `scripts`
from scripts.mutation_fast import GENERATE, run_fast  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MUTMUT_PIN = "mutmut==3.8.1"   # keep in step with setup.py's `mutation` extra
COPIED = ("verl", "search_r1", "scripts", "tests")


@dataclass(frozen=True)
class Module:
    mutate: tuple[str, ...]   # glob patterns (mutmut's only_mutate)
    tests: tuple[str, ...]    # the test files that cover it


# Smallest first: a partial run still reports the cheap modules.
MODULES: dict[str, Module] = {
    "reward_score": Module(("verl/utils/reward_score/*.py",),
                           ("tests/utils/reward_score", "tests/trainer/test_reward.py",
                            "tests/trainer/test_reward_search_r1_like.py")),
    "core_algos": Module(("verl/trainer/ppo/core_algos.py",),
                         ("tests/trainer/test_core_algos.py", "tests/trainer/test_core_algos_edges.py",
                          "tests/trainer/test_training_behaviours.py",
                          "tests/trainer/test_critic_loss_agg_mode.py",
                          "tests/trainer/test_advantage_estimators.py")),
    "advantage_estimators": Module(("verl/trainer/ppo/advantage_estimators.py",),
                                   ("tests/trainer/test_advantage_estimators.py",
                                    "tests/trainer/test_advantage_estimators_config.py")),
    "reward": Module(("verl/trainer/ppo/reward.py",),
                     ("tests/trainer/test_reward.py", "tests/trainer/test_reward_edges.py",
                      "tests/trainer/test_reward_search_r1_like.py", "tests/trainer/test_training_behaviours.py")),
    "dp_critic": Module(("verl/workers/critic/dp_critic.py",),
                        ("tests/workers/test_dp_critic.py", "tests/workers/test_dp_critic_edges.py",
                         "tests/trainer/test_critic_loss_agg_mode.py")),
    "dp_actor": Module(("verl/workers/actor/dp_actor.py",),
                       ("tests/workers/test_dp_actor.py", "tests/workers/test_dp_actor_edges.py",
                        "tests/trainer/test_training_behaviours.py")),
    "llm_agent": Module(("search_r1/llm_agent/*.py",),
                        ("tests/llm_agent/test_generation.py", "tests/llm_agent/test_rollout_behaviours.py",
                         "tests/llm_agent/test_actions.py", "tests/llm_agent/test_tensor_helper.py",
                         "tests/llm_agent/test_tool_protocol.py", "tests/llm_agent/test_tool_engines.py",
                         "tests/llm_agent/test_run_async.py", "tests/llm_agent/test_tools_edges.py",
                         "tests/llm_agent/test_generation_edges.py",
                         "tests/llm_agent/test_generation_limits.py", "tests/llm_agent/test_tool_turn_limits.py")),
}


def ensure_mutmut(python: str) -> None:
    """Install the pinned mutmut into `python`'s environment (constrained by the lock) if absent."""
    probe = subprocess.run([python, "-c", "import mutmut, sys; sys.stdout.write(mutmut.__version__)"],
                           capture_output=True, text=True)
    if probe.returncode == 0 and probe.stdout.strip() == MUTMUT_PIN.split("==")[1]:
        return
    print(f"[mutation] installing {MUTMUT_PIN} (constraints: requirements-lock.txt)", flush=True)
    subprocess.run([python, "-m", "pip", "install", "-q", MUTMUT_PIN, "-c", str(REPO / "requirements-lock.txt")],
                   check=True)


def _toml_list(values: list[str] | tuple[str, ...]) -> str:
    return "[" + ", ".join(json.dumps(v) for v in values) + "]"


def scratch_pyproject(module: Module) -> str:
    """The repo's pyproject.toml with its [tool.mutmut] section completed for `module`."""
    try:
        from tomllib import loads
    except ImportError:   # Python 3.10: mutmut depends on toml there
        from toml import loads
    text = (REPO / "pyproject.toml").read_text()
    base = loads(text).get("tool", {}).get("mutmut", {})
    head, sep, rest = text.partition("[tool.mutmut]")
    if not sep:
        raise SystemExit("pyproject.toml has no [tool.mutmut] section (the settings scripts/mutation.py starts from)")
    # Drop the section's own body (up to the next table) and write it back, completed.
    lines = rest.splitlines()
    end = next((i for i, line in enumerate(lines[1:], start=1) if line.startswith("[")), len(lines))
    tail = "\n".join(lines[end:])
    settings = dict(base)
    settings["only_mutate"] = list(module.mutate)
    settings["pytest_add_cli_args_test_selection"] = list(module.tests)
    body = []
    for key, value in settings.items():
        if isinstance(value, list):
            body.append(f"{key} = {_toml_list(value)}")
        else:
            body.append(f"{key} = {json.dumps(value)}")
    return head + "[tool.mutmut]\n" + "\n".join(body) + "\n\n" + tail + "\n"


def prepare(name: str, module: Module, workdir: Path) -> Path:
    """A fresh copy of the working tree's code and tests for one module's run."""
    root = workdir / name
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for entry in COPIED:
        shutil.copytree(REPO / entry, root / entry, ignore=ignore, symlinks=True)
    (root / "pyproject.toml").write_text(scratch_pyproject(module))
    return root


def summarise(root: Path, python: str) -> dict:
    mutmut = [python, "-m", "mutmut"]
    subprocess.run(mutmut + ["export-cicd-stats"], cwd=root, check=True, capture_output=True)
    stats = json.loads((root / "mutants" / "mutmut-cicd-stats.json").read_text())
    results = subprocess.run(mutmut + ["results"], cwd=root, capture_output=True, text=True).stdout
    stats["not_killed"] = [line.strip() for line in results.splitlines() if ":" in line]
    return stats


def run_module(name: str, module: Module, workdir: Path, python: str, max_children: int, fast: bool = True) -> dict:
    root = prepare(name, module, workdir)
    start = time.monotonic()
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    log = root / "mutmut-run.log"
    with open(log, "w") as out:
        if fast:   # mutmut generates the mutants and its stats, the fast runner tests them
            rc = subprocess.run([python, "-c", GENERATE, str(max_children)], cwd=root, env=env, stdout=out,
                                stderr=subprocess.STDOUT).returncode
            if rc == 0:
                run_fast(root, python, max_children, log=log)
        else:
            rc = subprocess.run([python, "-m", "mutmut", "run", "--max-children", str(max_children)],
                                cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    stats = summarise(root, python) if (root / "mutants").exists() else {}
    stats.update(module=name, seconds=round(time.monotonic() - start), mutmut_exit=rc, dir=str(root),
                 runner="fast" if fast else "mutmut")
    return stats


def survivors(root: Path, python: str) -> list[str]:
    results = subprocess.run([python, "-m", "mutmut", "results"], cwd=root, capture_output=True, text=True).stdout
    # "no tests": no selected test reached the mutated function; a new test may, so recheck those too.
    # "suspicious": pytest could not run the tests (e.g. a test module failed to import): not a kill.
    return [line.split(":")[0].strip() for line in results.splitlines()
            if line.strip().endswith((": survived", ": no tests", ": suspicious"))]


# Runs in the module's mutants/ directory: one pytest.main per survivor in ONE process (mutmut's
# trampolines read MUTANT_UNDER_TEST at every call), so imports and torch start-up are paid once.
_RECHECK_RUNNER = """
import json, os, sys
import pytest
names, args = json.loads(sys.argv[1]), json.loads(sys.argv[2])
os.environ.pop("MUTANT_UNDER_TEST", None)
if pytest.main(args) != 0:
    print("BASELINE-FAILED", flush=True)
    sys.exit(1)
for name in names:
    os.environ["MUTANT_UNDER_TEST"] = name
    rc = pytest.main(args)
    print("RESULT", name, "killed" if rc != 0 else "survived", flush=True)
"""


def recheck(name: str, workdir: Path, python: str, tests: list[str]) -> dict:
    """Run `tests` (copied from the checkout into the module's mutants/ tree) against each survivor
    of the module's last run. For tests written after the run: mutmut itself would re-collect and
    re-run the whole module."""
    root = workdir / name
    mutants = root / "mutants"
    if not mutants.exists():
        raise SystemExit(f"no mutmut run for {name} in {root}; run `scripts/mutation.py {name}` first")
    for test in tests:
        shutil.copy2(REPO / test, mutants / test)
    args = ["-x", "-q", "-p", "no:cacheprovider", "-m", "not slow and not gpu", "--rootdir=.", *tests]
    names = survivors(root, python)
    proc = subprocess.run([python, "-c", _RECHECK_RUNNER, json.dumps(names), json.dumps(args)], cwd=mutants,
                          capture_output=True, text=True)
    if "BASELINE-FAILED" in proc.stdout:
        raise SystemExit(f"{tests} fail without any mutant in {mutants}: fix them first")
    verdicts = dict(line.split()[1:3] for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    if len(verdicts) != len(names):
        raise SystemExit(f"recheck of {name} stopped early:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return {"module": name, "killed_now": [n for n in names if verdicts[n] == "killed"],
            "still_surviving": [n for n in names if verdicts[n] == "survived"]}


def report(stats: dict) -> str:
    total = stats.get("total", 0)
    killed = stats.get("killed", 0) + stats.get("timeout", 0)   # a timeout is a detected mutant too
    score = f"{100.0 * killed / total:.1f}%" if total else "n/a"
    lines = [f"[mutation] {stats['module']}: killed {killed} / {total} ({score}); survived {stats.get('survived', 0)}, "
             f"no tests {stats.get('no_tests', 0)}, timeout {stats.get('timeout', 0)}, "
             f"suspicious {stats.get('suspicious', 0)}, skipped {stats.get('skipped', 0)}; "
             f"{stats['seconds']} s ({stats.get('runner', 'mutmut')} runner); {stats['dir']}"]
    lines += [f"    {entry}" for entry in stats.get("not_killed", [])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("modules", nargs="*", help=f"modules to run (default: all): {', '.join(MODULES)}")
    parser.add_argument("--workdir", type=Path,
                        default=Path(os.environ.get("TMPDIR", tempfile.gettempdir())) / "search_r1_mutation")
    parser.add_argument("--max-children", type=int, default=1, help="mutants tested in parallel (default 1)")
    parser.add_argument("--fast", action=argparse.BooleanOptionalAction, default=True,
                        help="test the mutants in long-lived pytest workers (the default); "
                             "--no-fast: mutmut's own runner, one process per mutant")
    parser.add_argument("--list", action="store_true", help="print the modules and their tests, run nothing")
    parser.add_argument("--recheck", nargs="+", metavar="TEST_FILE",
                        help="re-run only the survivors of each module's last run against these (new) test files")
    args = parser.parse_args(argv)
    unknown = [m for m in args.modules if m not in MODULES]
    if unknown:
        parser.error(f"unknown module(s) {unknown}; choose from {list(MODULES)}")
    names = args.modules or list(MODULES)
    if args.list:
        for name in names:
            print(f"{name}: mutates {' '.join(MODULES[name].mutate)}; tests {' '.join(MODULES[name].tests)}")
        return 0
    python = sys.executable
    ensure_mutmut(python)
    if args.recheck:
        for name in names:
            result = recheck(name, args.workdir, python, args.recheck)
            print(f"[mutation] {name}: {len(result['killed_now'])} survivors killed by {args.recheck}, "
                  f"{len(result['still_surviving'])} still surviving:", flush=True)
            for mutant in result["still_surviving"]:
                print(f"    {mutant}")
        return 0
    summary = []
    for name in names:
        print(f"[mutation] {name}: running (log in {args.workdir / name / 'mutmut-run.log'})", flush=True)
        stats = run_module(name, MODULES[name], args.workdir, python, args.max_children, args.fast)
        print(report(stats), flush=True)
        summary.append(stats)
        (args.workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    print("[mutation] scores (killed / total):")
    for stats in summary:
        total = stats.get("total", 0)
        killed = stats.get("killed", 0) + stats.get("timeout", 0)
        print(f"    {stats['module']:<13} {killed:>4} / {total:<4}" + (f" {100.0 * killed / total:5.1f}%" if total else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
