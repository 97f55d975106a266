"""Tool classes by the name a tool config gives (veRL's `verl.tools.utils.tool_registry`).

`class_name` is either a dotted name of a class importable in every rollout process (a module on the
path: `my_tools.calculator.Calculator`), or a Python file and a class, `path/to/tools.py:Calculator`
(the file is imported once per process, as `custom_reward_function.path` is; a relative path is read
from the tool config's folder). `initialize_tools_from_config(path)` builds every tool of a config file
the way the rollout does, for an agent loop of your own (veRL's function of that name).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

FILE_SEPARATOR = ":"


class ToolClassError(ValueError):
    """A class_name that names no loadable class; `reason` says why (the message adds where)."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"{where}: {reason}")
        self.reason = reason


def resolve_class_name(class_name: str, base_dir: str | Path | None) -> str:
    """`class_name` with a file's relative path made absolute against `base_dir` (a dotted name as is)."""
    if FILE_SEPARATOR not in class_name:
        return class_name
    file, _, cls = class_name.rpartition(FILE_SEPARATOR)
    path = Path(file).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    return f"{path.resolve()}{FILE_SEPARATOR}{cls}"


def get_tool_class(class_name: str, where: str = "class_name") -> type:
    """The class `class_name` names; ValueError naming `where` when it cannot be imported or found."""
    if not isinstance(class_name, str) or not class_name.strip():
        raise ToolClassError(where, f"expected a class (my_module.MyTool or path/to/file.py:MyTool), got {class_name!r}")
    if FILE_SEPARATOR in class_name:
        from verl.utils.user_file import import_user_file

        file, _, attr = class_name.rpartition(FILE_SEPARATOR)
        try:
            module: Any = import_user_file(file, where, "search_r1_user_tool_")
        except (OSError, ImportError) as err:
            raise ToolClassError(where, str(err).removeprefix(f"{where}: ")) from err
        source = file
    else:
        module_name, _, attr = class_name.rpartition(".")
        if not module_name:
            raise ToolClassError(where, f"{class_name!r} names no module (write my_module.MyTool or "
                                        "path/to/file.py:MyTool)")
        try:
            module = importlib.import_module(module_name)
        except Exception as err:   # noqa: BLE001 - any import failure is the config's error, named
            raise ToolClassError(where, f"cannot import {class_name!r} ({type(err).__name__}: {err}); a module must "
                                        "be importable in every rollout process (on PYTHONPATH), or give the file "
                                        "as path/to/file.py:MyTool") from err
        source = module_name
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        raise ToolClassError(where, f"{source} defines no class {attr!r}")
    return cls


def initialize_tools_from_config(tools_config_file: str | Path) -> list[Any]:
    """Every tool of a tool config file, built (`cls(config, tool_schema)`), in the file's order (an MCP
    entry gives one tool per server tool)."""
    from search_r1.llm_agent.tool_backends import build_tool
    from search_r1.llm_agent.tools import load_tool_config

    config = load_tool_config(tools_config_file)
    schemas = {s["function"]["name"]: s for s in config.schemas}
    entries = {e["name"]: e for e in config.others}
    if config.search is not None:
        entries[config.search_name] = config.search_entry()
    return [build_tool(entries[name], schemas[name]) for name in config.tool_names]


__all__ = ["ToolClassError", "get_tool_class", "initialize_tools_from_config", "resolve_class_name"]
