"""Download the wiki-18 e5 index and corpus that Search-R1 retrieves from.

    python scripts/download.py --save_path /path/to/data

Fetches, from the Hugging Face hub (as the original Search-R1 does):
  PeterJinGo/wiki-18-e5-index   part_aa, part_ab   -> concatenated into e5_Flat.index
  PeterJinGo/wiki-18-corpus     wiki-18.jsonl.gz   -> gunzipped into wiki-18.jsonl
Unlike the original, you do not run `cat` and `gzip -d` yourself, and:

- before downloading it prints the disk space the run needs, from the files' sizes on the
  hub: the peak (the parts and the index they make while concatenating; then the index,
  the .gz and the unzipped corpus) and what is left at the end, and stops if the
  folder's file system has less free space than the peak;
- the parts are deleted once the concatenation is verified (its size is the parts' total
  and each part's first and last MiB are found at their offsets), the .gz once gzip has
  checked its CRC and length, as `gzip -d` does (`--keep_downloads` keeps both);
- a finished step leaves a `<file>.complete` record (its size), so a rerun skips it
  without the deleted inputs and without the network;
- the hub's cache, partial downloads included, stays beside the data, under
  `<save_path>/.cache/huggingface` (hub metadata and partial files; `xet`: the Xet
  transfer cache, removed at the end), never in ~/.cache;
- each output is written to a temporary name first, so an interrupted run never leaves a
  truncated index or corpus behind, and downloads resume.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

INDEX_REPO = "PeterJinGo/wiki-18-e5-index"
INDEX_PARTS = ("part_aa", "part_ab")
INDEX_NAME = "e5_Flat.index"
CORPUS_REPO = "PeterJinGo/wiki-18-corpus"
CORPUS_GZ = "wiki-18.jsonl.gz"
CORPUS_NAME = "wiki-18.jsonl"
CHUNK = 16 * 1024 * 1024
PROBE = 1024 * 1024  # bytes compared at each end of a part when verifying the concatenation
# The unzipped corpus's size is not known before it is unzipped (gzip records it modulo 4 GiB);
# English text in JSON lines compresses about 3:1, so the plan counts 3.2x the .gz, rounded up.
CORPUS_GZ_RATIO = 3.2
COMPLETE_SUFFIX = ".complete"
GB = 1e9


def hf_cache_dir(save_path: str | Path) -> Path:
    """The hub's cache for this download: beside the data, not in ~/.cache."""
    return Path(save_path) / ".cache" / "huggingface"


def complete_record(out: str | Path) -> Path:
    out = Path(out)
    return out.with_name(out.name + COMPLETE_SUFFIX)


def is_complete(out: str | Path) -> bool:
    """`out` was assembled and verified by this script and still has the size recorded then."""
    record = complete_record(out)
    if not (record.is_file() and Path(out).is_file()):
        return False
    return json.loads(record.read_text()).get("size") == Path(out).stat().st_size


def _mark_complete(out: Path, **info: object) -> None:
    complete_record(out).write_text(json.dumps({"size": out.stat().st_size, **info}))


def _copy_into(dst, parts: Sequence[Path]) -> None:
    for p in parts:
        with p.open("rb") as src:
            shutil.copyfileobj(src, dst, CHUNK)


def _verify_concatenation(parts: Sequence[Path], out: Path) -> None:
    """Size = the parts' total, and each part's first and last MiB sit at their offsets in `out`."""
    total = sum(p.stat().st_size for p in parts)
    if out.stat().st_size != total:
        raise OSError(f"{out} has {out.stat().st_size} bytes, the parts {total}; parts kept, rerun to retry")
    offset = 0
    with out.open("rb") as assembled:
        for p in parts:
            size = p.stat().st_size
            with p.open("rb") as part:
                for start in {0, max(0, size - PROBE)}:
                    part.seek(start)
                    assembled.seek(offset + start)
                    if part.read(PROBE) != assembled.read(min(PROBE, size - start)):
                        raise OSError(f"{out} does not hold {p} at offset {offset + start}; parts kept, rerun to retry")
            offset += size


def concat_parts(parts: Sequence[str | Path], out: str | Path) -> Path:
    """Concatenate `parts` (in order) into `out`, verify it, record it as complete.

    Skipped when `out` is already complete, or already has the parts' total size (an earlier
    run or a manual `cat`; then verified and recorded)."""
    out = Path(out)
    if is_complete(out):
        return out
    parts = [Path(p) for p in parts]
    for p in parts:
        if not p.is_file():
            raise FileNotFoundError(f"index part missing: {p}")
    total = sum(p.stat().st_size for p in parts)
    if not (out.is_file() and out.stat().st_size == total):
        tmp = out.with_name(out.name + ".tmp")
        with tmp.open("wb") as dst:
            _copy_into(dst, parts)
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, out)
    _verify_concatenation(parts, out)
    _mark_complete(out, parts={p.name: p.stat().st_size for p in parts})
    return out


def gunzip(src: str | Path, out: str | Path) -> Path:
    """Decompress `src` into `out` via a temporary file (gzip checks the CRC and length at the
    end, so a truncated or corrupt download raises) and record it as complete."""
    src, out = Path(src), Path(out)
    if is_complete(out):
        return out
    if not src.is_file():
        raise FileNotFoundError(f"compressed corpus missing: {src}")
    tmp = out.with_name(out.name + ".tmp")
    with gzip.open(src, "rb") as f_in, tmp.open("wb") as f_out:
        shutil.copyfileobj(f_in, f_out, CHUNK)
        f_out.flush()
        os.fsync(f_out.fileno())
    os.replace(tmp, out)
    _mark_complete(out, source_size=src.stat().st_size)
    return out


@dataclass(frozen=True)
class DiskPlan:
    """Bytes this run writes, in the order it writes them (0 for a step already done)."""

    parts: int         # index parts, deleted after the verified concatenation unless kept
    index: int         # e5_Flat.index (= the parts' total)
    corpus_gz: int     # wiki-18.jsonl.gz, deleted after the verified gunzip unless kept
    corpus: int        # wiki-18.jsonl, estimated (CORPUS_GZ_RATIO x the .gz)
    keep_downloads: bool

    @property
    def peak(self) -> int:
        """Most bytes on disk at once: parts + index while concatenating; then the index (and the
        parts, if kept) + .gz + corpus while unzipping."""
        after_index = self.index + (self.parts if self.keep_downloads else 0)
        return max(self.parts + self.index, after_index + self.corpus_gz + self.corpus)

    @property
    def final(self) -> int:
        kept = self.parts + self.corpus_gz if self.keep_downloads else 0
        return self.index + self.corpus + kept

    def describe(self, save_path: Path, free: int) -> str:
        fate = "kept" if self.keep_downloads else "deleted once verified"
        rows = [
            (f"index parts ({', '.join(INDEX_PARTS)})", self.parts, fate),
            (INDEX_NAME, self.index, "the parts concatenated"),
            (CORPUS_GZ, self.corpus_gz, fate),
            (CORPUS_NAME, self.corpus, f"estimated: {CORPUS_GZ_RATIO} x the .gz"),
        ]
        lines = [f"disk space this download needs in {save_path} (from the hub's file sizes):"]
        lines += [f"  {name:<34} {size / GB:8.1f} GB  {note}" for name, size, note in rows if size]
        lines += [f"  {'peak':<34} {self.peak / GB:8.1f} GB  (parts + index while concatenating; then "
                  f"index + .gz + corpus while unzipping)",
                  f"  {'left at the end':<34} {self.final / GB:8.1f} GB",
                  f"  {'free now':<34} {free / GB:8.1f} GB"]
        return "\n".join(lines)


def disk_plan(part_sizes: Sequence[int], gz_size: int, keep_downloads: bool = False) -> DiskPlan:
    """The plan for downloading parts of `part_sizes` and a corpus .gz of `gz_size` bytes
    (empty / 0 for a step already complete)."""
    return DiskPlan(parts=sum(part_sizes), index=sum(part_sizes), corpus_gz=gz_size,
                    corpus=int(gz_size * CORPUS_GZ_RATIO), keep_downloads=keep_downloads)


def remote_sizes(repo_id: str, filenames: Sequence[str]) -> dict[str, int]:
    """Sizes in bytes of files of a hub data set repo (one metadata call, no download)."""
    from huggingface_hub import HfApi

    infos = HfApi().get_paths_info(repo_id, list(filenames), repo_type="dataset")
    sizes = {info.path: int(info.size) for info in infos}
    missing = [name for name in filenames if name not in sizes]
    if missing:
        raise FileNotFoundError(f"{repo_id} (hub data set) has no {', '.join(missing)}")
    return sizes


def download_file(repo_id: str, filename: str, save_path: Path) -> Path:
    """One file of a hub data set repo into `save_path` (resumes a partial download); the hub's
    cache goes to `hf_cache_dir(save_path)`."""
    import huggingface_hub

    return Path(huggingface_hub.hf_hub_download(
        repo_id=repo_id, filename=filename, repo_type="dataset", local_dir=save_path,
        cache_dir=hf_cache_dir(save_path) / "hub",
    ))


def download_all(save_path: str | Path, keep_downloads: bool = False, check_space: bool = True,
                 sizes: Callable[[str, Sequence[str]], dict[str, int]] | None = None) -> tuple[Path, Path]:
    """Index parts + corpus from the hub, then assemble them; returns (index, corpus)."""
    save_path = Path(save_path)
    save_path.mkdir(parents=True, exist_ok=True)
    index, corpus = save_path / INDEX_NAME, save_path / CORPUS_NAME
    need_index, need_corpus = not is_complete(index), not is_complete(corpus)
    if not (need_index or need_corpus):
        print(f"{index} and {corpus} are complete; nothing to download")
        return index, corpus
    # The Xet transfer cache (hf_xet reads this variable when a download starts) goes beside
    # the data too; hf_hub_download's own cache is passed as cache_dir.
    os.environ["HF_XET_CACHE"] = str(hf_cache_dir(save_path) / "xet")
    sizes = sizes or remote_sizes
    part_sizes = list(sizes(INDEX_REPO, INDEX_PARTS).values()) if need_index else []
    gz_size = sizes(CORPUS_REPO, [CORPUS_GZ])[CORPUS_GZ] if need_corpus else 0
    plan = disk_plan(part_sizes, gz_size, keep_downloads)
    free = shutil.disk_usage(save_path).free
    print(plan.describe(save_path, free), flush=True)
    if check_space and free < plan.peak:
        raise SystemExit(f"not enough free space in {save_path}: the download peaks at {plan.peak / GB:.1f} GB, "
                         f"{free / GB:.1f} GB are free (free space, or pass --skip_space_check)")

    if need_index:
        parts = [download_file(INDEX_REPO, name, save_path) for name in INDEX_PARTS]
        concat_parts(parts, index)   # raises, keeping the parts, if the result does not verify
        if not keep_downloads:
            for p in parts:
                p.unlink()
    if need_corpus:
        corpus_gz = download_file(CORPUS_REPO, CORPUS_GZ, save_path)
        gunzip(corpus_gz, corpus)
        if not keep_downloads:
            corpus_gz.unlink()
    shutil.rmtree(hf_cache_dir(save_path) / "xet", ignore_errors=True)
    return index, corpus


def main(argv: list[str] | None = None) -> tuple[Path, Path]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--save_path", required=True, help="folder for the index and corpus (and the hub's cache)")
    p.add_argument("--keep_downloads", action="store_true",
                   help="keep part_aa/part_ab and wiki-18.jsonl.gz after they are assembled")
    p.add_argument("--delete_parts", action="store_true",
                   help="accepted for old command lines: deleting the parts is now the default")
    p.add_argument("--skip_space_check", action="store_true", help="download even if the free space looks short")
    args = p.parse_args(argv)
    index, corpus = download_all(args.save_path, keep_downloads=args.keep_downloads,
                                 check_space=not args.skip_space_check)
    print(f"index:  {index}\ncorpus: {corpus}", file=sys.stdout)
    return index, corpus


if __name__ == "__main__":
    main()
