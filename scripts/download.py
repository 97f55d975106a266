"""Download the wiki-18 e5 index and corpus that Search-R1 retrieves from.

    python scripts/download.py --save_path /path/to/data

Fetches, from the Hugging Face hub (as the original Search-R1 does):
  PeterJinGo/wiki-18-e5-index   part_aa, part_ab   -> concatenated into e5_Flat.index
  PeterJinGo/wiki-18-corpus     wiki-18.jsonl.gz   -> gunzipped into wiki-18.jsonl
Downloads resume (huggingface_hub keeps partial files); the concatenation and the
gunzip are skipped when their output is already complete, and each is written to a
temporary name first, so an interrupted run never leaves a truncated index behind.
Unlike the original, you do not need to run `cat` and `gzip -d` yourself.
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

INDEX_REPO = "PeterJinGo/wiki-18-e5-index"
INDEX_PARTS = ("part_aa", "part_ab")
INDEX_NAME = "e5_Flat.index"
CORPUS_REPO = "PeterJinGo/wiki-18-corpus"
CORPUS_GZ = "wiki-18.jsonl.gz"
CORPUS_NAME = "wiki-18.jsonl"
CHUNK = 16 * 1024 * 1024


def concat_parts(parts: Sequence[str | Path], out: str | Path) -> Path:
    """Concatenate `parts` (in order) into `out`; skipped when `out` already has their total size."""
    out = Path(out)
    parts = [Path(p) for p in parts]
    for p in parts:
        if not p.is_file():
            raise FileNotFoundError(f"index part missing: {p}")
    total = sum(p.stat().st_size for p in parts)
    if out.is_file() and out.stat().st_size == total:
        return out
    tmp = out.with_name(out.name + ".tmp")
    with tmp.open("wb") as dst:
        for p in parts:
            with p.open("rb") as src:
                shutil.copyfileobj(src, dst, CHUNK)
    os.replace(tmp, out)
    return out


def gunzip(src: str | Path, out: str | Path) -> Path:
    """Decompress `src` into `out`, via a temporary file; skipped when `out` exists and is newer."""
    src, out = Path(src), Path(out)
    if not src.is_file():
        raise FileNotFoundError(f"compressed corpus missing: {src}")
    if out.is_file() and out.stat().st_mtime >= src.stat().st_mtime and out.stat().st_size > 0:
        return out
    tmp = out.with_name(out.name + ".tmp")
    with gzip.open(src, "rb") as f_in, tmp.open("wb") as f_out:
        shutil.copyfileobj(f_in, f_out, CHUNK)
    os.replace(tmp, out)
    return out


def download_file(repo_id: str, filename: str, save_path: Path) -> Path:
    """One file of a hub data set repo into `save_path` (resumes a partial download)."""
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(repo_id=repo_id, filename=filename, repo_type="dataset", local_dir=save_path))


def download_all(save_path: str | Path, keep_parts: bool = True) -> tuple[Path, Path]:
    """Index parts + corpus from the hub, then assemble them; returns (index, corpus)."""
    save_path = Path(save_path)
    save_path.mkdir(parents=True, exist_ok=True)
    parts = [download_file(INDEX_REPO, name, save_path) for name in INDEX_PARTS]
    index = concat_parts(parts, save_path / INDEX_NAME)
    corpus_gz = download_file(CORPUS_REPO, CORPUS_GZ, save_path)
    corpus = gunzip(corpus_gz, save_path / CORPUS_NAME)
    if not keep_parts:
        for p in parts:
            p.unlink()
    return index, corpus


def main(argv: list[str] | None = None) -> tuple[Path, Path]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--save_path", required=True, help="folder for the index and corpus (~70 GB)")
    p.add_argument("--delete_parts", action="store_true", help="remove part_aa/part_ab after concatenating")
    args = p.parse_args(argv)
    index, corpus = download_all(args.save_path, keep_parts=not args.delete_parts)
    print(f"index:  {index}\ncorpus: {corpus}", file=sys.stdout)
    return index, corpus


if __name__ == "__main__":
    main()
