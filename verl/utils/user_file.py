"""Import a Python file a user names by a config key (custom_algorithms.path,
custom_reward_function.path) once per process, with errors that name the key and the file."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def import_user_file(path: str | Path, key: str, prefix: str) -> ModuleType:
    """The module of the file at `path`, imported under `prefix` + a hash of its absolute path (so a
    second call returns the same module); `key` (e.g. "custom_algorithms.path") leads every error."""
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise FileNotFoundError(f"{key}: no file {str(file)!r}")
    module_name = prefix + hashlib.sha1(str(file).encode()).hexdigest()[:12]
    module = sys.modules.get(module_name)
    if module is not None:
        return module
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"{key}: cannot import {str(file)!r} as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise ImportError(f"{key}: importing {str(file)!r} failed: {type(exc).__name__}: {exc}") from exc
    return module
