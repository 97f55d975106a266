"""Is the checkpoint folder one folder for every rank? A marker-file probe before the first save.

A checkpoint is written by many processes: every rank writes its own model / optimizer shard and
RNG state into `<trainer.default_local_dir>/global_step_N.tmp/actor/` where *its* node resolves
that path, and the driver then writes the manifest and renames the folder on *its* node. On a
multi-node run whose path is node-local (a relative path, or /tmp, /scratch, a local disk) the
shards of the other nodes land on disks the driver never reads: the manifest lists only the
driver node's files, the rename publishes a checkpoint that cannot be resumed, and nothing says so
until the resume fails.

    verify_shared_dir(root, worker_group.write_checkpoint_probe)   # driver, before the first save

Each rank writes `<root>/.rank_probe-<id>/rank_<r>.json` (its rank, hostname, pid and the path it
wrote, `write_rank_marker`); the driver then reads every marker back and raises `SharedDirError`
naming `trainer.default_local_dir`, each rank whose marker it cannot see (with the host, pid and
path that rank wrote), and the fix. The probe folder is removed afterwards. A fresh `<id>` per
probe, and the pid inside the marker, keep a marker left by an earlier run from passing for one.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

PROBE_PREFIX = ".rank_probe-"
CONFIG_KEY = "trainer.default_local_dir"


class SharedDirError(RuntimeError):
    """Some rank writes its checkpoint files where the driver does not read them."""


@dataclass(frozen=True)
class RankMarker:
    """What one rank says it wrote: the driver compares it with the file it finds."""

    rank: int
    hostname: str
    pid: int
    path: str    # the marker file, absolute as the writing process resolved it


def probe_dir(root: str | Path, probe_id: str) -> Path:
    return Path(root) / f"{PROBE_PREFIX}{probe_id}"


def write_rank_marker(root: str, probe_id: str, rank: int) -> RankMarker:
    """Worker side: write this process's marker under `root` (created if missing), fsynced so a
    shared file system shows it to the driver once this call has returned."""
    folder = probe_dir(root, probe_id)
    folder.mkdir(parents=True, exist_ok=True)
    path = (folder / f"rank_{rank}.json").absolute()
    marker = RankMarker(rank=int(rank), hostname=socket.gethostname(), pid=os.getpid(), path=str(path))
    with open(path, "w", encoding="utf-8") as f:
        json.dump(asdict(marker), f)
        f.flush()
        os.fsync(f.fileno())
    return marker


def missing_markers(root: str | Path, probe_id: str, markers: Sequence[RankMarker]) -> list[RankMarker]:
    """Driver side: the ranks whose marker file the driver does not find under `root`."""
    folder = probe_dir(root, probe_id)
    return [m for m in markers if not (folder / f"rank_{m.rank}.json").is_file()]


def shared_dir_message(root: str | Path, missing: Sequence[RankMarker], total: int, key: str = CONFIG_KEY) -> str:
    """The error for ranks whose markers the driver cannot see: the key, who, where, and the fix."""
    ranks = ", ".join(f"rank {m.rank} (host {m.hostname}, pid {m.pid}, wrote {m.path})" for m in missing)
    hosts = sorted({m.hostname for m in missing})
    relative = "" if Path(root).is_absolute() else (
        f" {root!r} is a relative path: each process resolves it against its own working directory.")
    return (
        f"{key}={root} is not one folder for every rank: the driver (host {socket.gethostname()}, pid {os.getpid()}) "
        f"does not see the marker files of {len(missing)} of the {total} rank(s): {ranks}.{relative} Each rank "
        "writes its checkpoint shards where its own node resolves that path, while the driver writes the manifest "
        f"and renames the step folder on its node only, so a checkpoint saved there could not be resumed. Set {key} "
        "to an absolute path on a file system every node mounts at the same place (NFS, Lustre, a shared home; "
        f"docs/multinode.md), or check the mount on {', '.join(hosts)}. No checkpoint was written.")


def verify_shared_dir(root: str | Path, write_markers: Callable[[str, str], Sequence[RankMarker]],
                      key: str = CONFIG_KEY) -> list[RankMarker]:
    """Have every rank write a marker under `root` (`write_markers(root, probe_id)` returns one
    RankMarker per rank, e.g. a worker group's `write_checkpoint_probe`), check that this process
    finds each of them, remove the probe folder; SharedDirError naming `key` and the ranks otherwise.
    Returns the markers."""
    probe_id = uuid.uuid4().hex[:12]
    markers = list(write_markers(str(root), probe_id))
    try:
        missing = missing_markers(root, probe_id, markers)
        if missing:
            raise SharedDirError(shared_dir_message(root, missing, len(markers), key))
    finally:
        shutil.rmtree(probe_dir(root, probe_id), ignore_errors=True)
    return markers
