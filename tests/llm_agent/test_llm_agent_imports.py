"""The llm_agent modules depend on each other one way: no cycle, not even through type hints.

tests/test_import_cycles.py checks every package for cycles that can run (TYPE_CHECKING imports
left out). Here the bar is higher: a cycle that exists only for the type checker still ties two
modules together (the tool protocol's turn rules once took the generation manager and reached
into its private encode/decode, while the manager built them), so within search_r1/llm_agent every
import counts. And each module imports on its own, whichever is imported first.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.test_import_cycles import REPO_ROOT, find_cycle

PACKAGE = "search_r1.llm_agent"
PACKAGE_DIR = REPO_ROOT / "search_r1" / "llm_agent"


def _modules() -> dict[str, Path]:
    return {f"{PACKAGE}.{path.stem}": path for path in sorted(PACKAGE_DIR.glob("*.py")) if path.stem != "__init__"}


def every_import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it names in any import statement: module level, in functions,
    and under `if TYPE_CHECKING:`."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                edges |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                base = node.module if not node.level else f"{PACKAGE}.{node.module}"
                edges |= {base, *(f"{base}.{alias.name}" for alias in node.names)}
        graph[name] = (edges & set(modules)) - {name}
    return graph


def test_llm_agent_imports_have_no_cycle_type_hints_included() -> None:
    graph = every_import_graph()
    # The graph sees real edges, type-only ones included.
    assert f"{PACKAGE}.tool_turns" in graph[f"{PACKAGE}.generation"]
    assert f"{PACKAGE}.generation_config" in graph[f"{PACKAGE}.tool_turns"]
    assert f"{PACKAGE}.generation" in graph[f"{PACKAGE}.async_generation"]
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle among {PACKAGE} modules: {' -> '.join(cycle)}"


def test_a_type_checking_import_counts_here(tmp_path: Path, monkeypatch) -> None:
    package = tmp_path / "search_r1" / "llm_agent"
    package.mkdir(parents=True)
    (package / "a.py").write_text("def f():\n    from search_r1.llm_agent.b import g\n")
    (package / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                  "    from search_r1.llm_agent.a import f\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE_DIR", package)
    graph = every_import_graph()
    assert graph == {f"{PACKAGE}.a": {f"{PACKAGE}.b"}, f"{PACKAGE}.b": {f"{PACKAGE}.a"}}
    assert find_cycle(graph) == [f"{PACKAGE}.a", f"{PACKAGE}.b", f"{PACKAGE}.a"]


def test_each_llm_agent_module_imports_on_its_own() -> None:
    """In a fresh interpreter, each module first (the package's other modules unloaded before each)."""
    names = sorted(_modules())
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n"
            f"    for loaded in [m for m in sys.modules if m.startswith({PACKAGE!r})]:\n"
            "        del sys.modules[loaded]\n"
            "    importlib.import_module(name)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
