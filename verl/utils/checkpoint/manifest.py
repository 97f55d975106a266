"""Checkpoint manifests: every file's size and sha256, written at save time, checked before a resume.

A full disk or a node that crashed while saving can leave a shard short or garbled while the
folder still looks complete (the workers' writes returned, the folder was renamed). The driver
writes `manifest.json` into the step folder after every rank has finished writing and before
the folder is renamed into place, so a manifest only ever describes a finished save; a resume
compares each file with it and names the first file that differs.

    write_manifest(folder)            # {"version": 1, "algorithm": "sha256", "files": {...}}
    check = verify_manifest(folder)   # check.problems: [] when intact, else "<file>: <what differs>"

Hashing reads every byte once: about 1.4 GiB/s per core (hashlib's sha256 with the CPU's SHA
extensions, measured on the development machine); files are hashed on a thread pool (hashlib
releases the GIL), so a checkpoint of many shards costs about its size / (1.4 GiB/s x threads),
bounded by the disk's read speed. Sizes are compared before anything is hashed, so a truncated
file is found at once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
MANIFEST_VERSION = 1
ALGORITHM = "sha256"
_CHUNK_BYTES = 8 * 1024 * 1024


class CorruptCheckpointError(RuntimeError):
    """A checkpoint's files differ from its manifest (or no intact checkpoint is left to resume)."""


def _default_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_files(folder: str | Path) -> list[str]:
    """Every file under `folder` as a sorted relative POSIX path, the manifest itself left out."""
    folder = Path(folder)
    found = []
    for dirpath, _, filenames in os.walk(folder):
        for name in filenames:
            rel = (Path(dirpath) / name).relative_to(folder).as_posix()
            if rel != MANIFEST_FILE:
                found.append(rel)
    return sorted(found)


def _hash_all(folder: Path, rel_paths: list[str], threads: int | None) -> dict[str, str]:
    with ThreadPoolExecutor(max_workers=threads or _default_threads()) as pool:
        digests = pool.map(lambda rel: file_sha256(folder / rel), rel_paths)
        return dict(zip(rel_paths, digests, strict=True))


def write_manifest(folder: str | Path, threads: int | None = None) -> dict:
    """Record size and sha256 of every file under `folder` in `folder/manifest.json` (fsynced).

    Call it once every part of the checkpoint is on disk and before the folder is published."""
    folder = Path(folder)
    start = time.monotonic()
    rel_paths = checkpoint_files(folder)
    digests = _hash_all(folder, rel_paths, threads)
    manifest = {
        "version": MANIFEST_VERSION,
        "algorithm": ALGORITHM,
        "files": {rel: {"size": (folder / rel).stat().st_size, ALGORITHM: digests[rel]} for rel in rel_paths},
    }
    with open(folder / MANIFEST_FILE, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    total = sum(entry["size"] for entry in manifest["files"].values())
    logger.info("checkpoint manifest of %s: %d files, %.2f GiB hashed in %.1f s", folder, len(rel_paths),
                total / 1024**3, time.monotonic() - start)
    return manifest


@dataclass
class ManifestCheck:
    """The outcome of `verify_manifest`: `problems` names each bad file (full path: what is wrong)."""

    folder: Path
    has_manifest: bool
    problems: list[str] = field(default_factory=list)

    @property
    def intact(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        more = f" (and {len(self.problems) - 1} more file(s))" if len(self.problems) > 1 else ""
        return f"{self.problems[0]}{more}" if self.problems else "intact"


def verify_manifest(folder: str | Path, threads: int | None = None) -> ManifestCheck:
    """Compare the files under `folder` with its manifest: missing files and wrong sizes first (no
    reading), then sha256. A folder without a manifest (saved before manifests existed) is
    reported with has_manifest=False and no problems; a manifest that cannot be read is a problem."""
    folder = Path(folder)
    path = folder / MANIFEST_FILE
    if not path.is_file():
        return ManifestCheck(folder, has_manifest=False)
    try:
        with open(path, encoding="utf-8") as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return ManifestCheck(folder, True, [f"{path}: unreadable manifest ({exc})"])
    problems = []
    for rel, entry in files.items():
        actual = folder / rel
        if not actual.is_file():
            problems.append(f"{actual}: missing (the manifest lists {entry['size']} bytes)")
        elif actual.stat().st_size != entry["size"]:
            problems.append(f"{actual}: {actual.stat().st_size} bytes, the manifest says {entry['size']}")
    if problems:
        return ManifestCheck(folder, True, problems)
    digests = _hash_all(folder, list(files), threads)
    problems = [f"{folder / rel}: {ALGORITHM} differs from the manifest (same size, different bytes)"
                for rel, entry in files.items() if digests[rel] != entry[ALGORITHM]]
    return ManifestCheck(folder, True, problems)
