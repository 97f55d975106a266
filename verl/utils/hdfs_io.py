"""veRL's file helpers that also take `hdfs://` paths (`from verl.utils.hdfs_io import copy, makedirs`,
as the original Search-R1's data scripts write): local paths work as os / shutil do; HDFS is not
supported here, and an `hdfs://` path fails at once saying so instead of calling a missing `hdfs`
binary."""

from __future__ import annotations

import os
import shutil
from typing import Any

__all__ = ["copy", "exists", "makedirs"]

HDFS_PREFIX = "hdfs://"


def is_hdfs(path: str) -> bool:
    return str(path).startswith(HDFS_PREFIX)


def reject_hdfs(*paths: str, what: str) -> None:
    """Raise a ValueError naming the first `hdfs://` path among `paths`."""
    for path in paths:
        if is_hdfs(path):
            raise ValueError(
                f"{what}: {path!r} is an HDFS path; HDFS is not supported here. Copy it to local disk first "
                f"(hdfs dfs -get {path} <local dir>) and pass the local path, or leave the HDFS option "
                "(e.g. --hdfs_dir) unset.")


def exists(path: str) -> bool:
    """os.path.exists for a local path."""
    reject_hdfs(path, what="exists")
    return os.path.exists(path)


def makedirs(name: str, mode: int = 0o777, exist_ok: bool = False) -> None:
    """os.makedirs for a local path."""
    reject_hdfs(name, what="makedirs")
    os.makedirs(name, mode=mode, exist_ok=exist_ok)


def copy(src: str, dst: str, **kwargs: Any) -> str:
    """shutil.copytree for a folder, shutil.copy for a file; returns the destination."""
    reject_hdfs(src, dst, what="copy")
    if os.path.isdir(src):
        return shutil.copytree(src, dst, **kwargs)
    return shutil.copy(src, dst, **kwargs)
