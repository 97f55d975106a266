"""veRL's file-system helpers (`from verl.utils.fs import copy_local_path_from_hdfs`, as the original
Search-R1's main_ppo.py writes). A local path passes through unchanged; an `hdfs://` path is an
error naming it, since HDFS is not supported here (verl/utils/hdfs_io.py)."""

from __future__ import annotations

from verl.utils.hdfs_io import copy, exists, makedirs, reject_hdfs

__all__ = ["copy", "copy_local_path_from_hdfs", "exists", "makedirs"]


def copy_local_path_from_hdfs(src: str, cache_dir: str | None = None, filelock: str = ".file.lock",
                              verbose: bool = False) -> str:
    """The local path to read `src` from: `src` itself for a local path. `cache_dir`, `filelock` and
    `verbose` are veRL's settings for the HDFS download, accepted so that its callers run unchanged."""
    reject_hdfs(src, what="copy_local_path_from_hdfs")
    return src
