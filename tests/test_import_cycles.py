"""No import cycles inside a package: its modules' imports form a directed acyclic graph.

A cycle works until someone moves an import, then fails with "partially initialized module";
a function-level import that dodges a cycle still ties both modules to each other, so it
counts too, and so does an import under `if TYPE_CHECKING:` (it never runs, but the two modules
still need each other to be read, and the guard is one edit from a real circle: issue 43 found
verl.trainer.preflight <-> preflight_memory held together that way). `type_checking=False` leaves
those out.

`import_graph(package_dir)` and `find_cycle(graph)` are reusable for any package folder:

    assert find_cycle(import_graph(REPO_ROOT / "verl" / "workers" / "rollout")) is None
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, type_checking: bool = True) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement: module level, in functions, in classes, and (unless `type_checking` is
    False) under TYPE_CHECKING."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if not type_checking and isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of `known` that one import statement in `module` loads by name."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: `from . import x`, `from ..y import z`
            anchor = module.split(".")
            anchor = anchor if is_package else anchor[:-1]
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join([*anchor, base] if base else anchor)
        # `from pkg import name` loads pkg, and pkg.name too when that is a module.
        names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
    return {name for name in names if name in known}


def import_graph(package_dir: Path, root: Path = REPO_ROOT, type_checking: bool = True) -> dict[str, set[str]]:
    """module -> the modules of the same package (`package_dir`, subpackages included) it imports.

    Module names are dotted paths relative to `root`. Only the module an import names is an
    edge, not its parent packages' `__init__` (which Python also runs, but which would make
    every package whose `__init__` re-exports a submodule look cyclic)."""
    paths = sorted(Path(package_dir).resolve().rglob("*.py"))
    if not paths:
        raise FileNotFoundError(f"no Python modules under {package_dir}")
    modules = {_module_name(p, Path(root).resolve()): p for p in paths}
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges: set[str] = set()
        for node in _imports(tree, type_checking):
            edges |= _targets(node, name, path.name == "__init__.py", known)
        graph[name] = edges - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None when the graph is acyclic (depth-first search)."""
    state: dict[str, str] = {}   # "open" while on the current path, "done" once fully explored
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def test_demo_scripts_have_no_import_cycle() -> None:
    graph = import_graph(REPO_ROOT / "scripts" / "demo")
    assert {"scripts.demo.build", "scripts.demo.warmstart", "scripts.demo.run_demo"} <= set(graph)
    assert "scripts.demo.build" in graph["scripts.demo.warmstart"]   # the graph sees real edges
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle among scripts/demo modules: {' -> '.join(cycle)}"


@pytest.mark.parametrize("package", ["verl", "search_r1", "scripts"])
def test_no_package_has_an_import_cycle(package: str) -> None:
    """The whole tree, not only the circles found before (scripts/demo, and the rollout engines:
    verl.workers.rollout.async_engine <-> hf_rollout, main_ppo <-> preflight, and the type-only
    preflight <-> preflight_memory)."""
    graph = import_graph(REPO_ROOT / package)
    if package == "verl":
        # The graph sees the rollout engines' real edges.
        assert "verl.workers.rollout.async_engine" in graph["verl.workers.rollout.hf_step_engine"]
        assert "verl.workers.rollout.hf_step_engine" in graph["verl.workers.rollout.hf_rollout"]
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle in {package}: {' -> '.join(cycle)}"


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root / "pkg"


def test_a_function_level_import_that_closes_a_loop_is_a_cycle(tmp_path: Path) -> None:
    pkg = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.b import g\n",
        "pkg/b.py": "def g():\n    from pkg import a\n    return a\n",
    })
    assert find_cycle(import_graph(pkg, root=tmp_path)) == ["pkg.a", "pkg.b", "pkg.a"]


def test_relative_imports_resolve_and_type_checking_imports_can_be_left_out(tmp_path: Path) -> None:
    pkg = _write(tmp_path, {
        "pkg/__init__.py": "from .sub import c\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "from ..d import x\nfrom typing import TYPE_CHECKING\n"
                        "if TYPE_CHECKING:\n    from pkg import e\n",
        "pkg/d.py": "import os\nx = 1\n",
        "pkg/e.py": "from pkg.sub.c import x\n",
    })
    graph = import_graph(pkg, root=tmp_path, type_checking=False)
    assert graph["pkg"] == {"pkg.sub", "pkg.sub.c"}
    assert graph["pkg.sub.c"] == {"pkg.d"}
    assert graph["pkg.e"] == {"pkg.sub.c"}
    assert find_cycle(graph) is None


def test_a_type_checking_import_that_closes_a_loop_is_a_cycle(tmp_path: Path) -> None:
    """preflight <-> preflight_memory's shape: a module imports a checker, which names the first
    module's report type under TYPE_CHECKING only."""
    pkg = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/checks.py": "from pkg.memory import check\nclass Report: ...\n",
        "pkg/memory.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.checks import Report\n"
                         "def check(report: 'Report') -> None: ...\n",
    })
    assert find_cycle(import_graph(pkg, root=tmp_path)) == ["pkg.checks", "pkg.memory", "pkg.checks"]
    assert find_cycle(import_graph(pkg, root=tmp_path, type_checking=False)) is None


def test_preflight_and_its_memory_checks_do_not_import_each_other() -> None:
    graph = import_graph(REPO_ROOT / "verl" / "trainer")
    assert "verl.trainer.preflight_memory" in graph["verl.trainer.preflight"]
    assert "verl.trainer.preflight_report" in graph["verl.trainer.preflight_memory"]   # the report type's home
    assert "verl.trainer.preflight" not in graph["verl.trainer.preflight_memory"]


def test_an_empty_folder_is_an_error_not_an_empty_graph(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no Python modules"):
        import_graph(tmp_path)
