"""Interactions by name from an interaction config file (veRL's layout):

    interaction:
      - name: retry                     # optional: else the class name, lower-cased, without "Interaction"
        class_name: retry_interaction.py:RetryInteraction   # or my_module.RetryInteraction
        config: {}

A file path is read relative to the config file's folder (as a tool config's class_name).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_LOADED: dict[str, dict[str, Any]] = {}


def get_interaction_class(cls_name: str, where: str = "class_name") -> type:
    from verl.tools.utils.tool_registry import get_tool_class

    return get_tool_class(cls_name, where)


def initialize_interactions_from_config(interaction_config_file: str | Path) -> dict[str, Any]:
    """{name: interaction} for every entry of the file; errors name the file and the entry."""
    import yaml

    from verl.interactions.base import BaseInteraction
    from verl.tools.utils.tool_registry import resolve_class_name

    file = Path(interaction_config_file).expanduser()
    where = f"actor_rollout_ref.rollout.multi_turn.interaction_config_path ({file})"
    if not file.is_file():
        raise FileNotFoundError(f"{where}: no such file")
    try:
        data = yaml.safe_load(file.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"{where}: not valid YAML: {err}") from err
    entries = data.get("interaction") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{where}: expected a top-level 'interaction:' list of {{name, class_name, config}}")
    found: dict[str, Any] = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
            raise ValueError(f"{where}: interaction[{i}]: expected {{name, class_name, config}}, got {entry!r}")
        cls = get_interaction_class(resolve_class_name(entry["class_name"], file.resolve().parent),
                                    f"{where}: interaction[{i}].class_name")
        if not issubclass(cls, BaseInteraction):
            raise ValueError(f"{where}: interaction[{i}].class_name: {entry['class_name']!r} is not a "
                             "verl.interactions.base.BaseInteraction subclass")
        name = entry.get("name")
        if name is None:
            simple = entry["class_name"].rsplit(".", 1)[-1].rsplit(":", 1)[-1]
            name = (simple[: -len("Interaction")] if simple.endswith("Interaction") else simple).lower()
        if name in found:
            raise ValueError(f"{where}: interaction[{i}]: the name {name!r} is used twice")
        config = dict(entry.get("config") or {})
        config["name"] = name
        found[name] = cls(config=config)
    return found


def interactions_of(path: str | Path) -> dict[str, Any]:
    """`initialize_interactions_from_config(path)`, built once per process (the rollout's interactions)."""
    key = str(Path(path).expanduser().resolve())
    if key not in _LOADED:
        _LOADED[key] = initialize_interactions_from_config(key)
    return _LOADED[key]


__all__ = ["get_interaction_class", "initialize_interactions_from_config", "interactions_of"]
