"""The retrieval server's id map for POST /open (``corpus.IdIndex``) on a synthetic id column.

Writes an Arrow corpus store of ``--rows`` passages (ids "0" .. "N-1", as wiki-18's; empty
contents, so only the id column weighs; generated here, nothing downloaded) in a child process,
then in this process opens it as the server does and measures:

- ``build_s``: hashing and sorting every id (``IdIndex.build``);
- ``rss_delta_mib`` / ``anon_delta_mib``: resident memory the built index keeps (VmRSS / RssAnon,
  after minus before; the id column's mapped pages are file-backed, shared with the page cache),
  and ``peak_delta_mib``, the build's peak (VmHWM reset before it);
- ``lookup_us``: per-lookup latency (p50, p99) of known ids, unknown ids and a 1 MB unknown id;
- ``loop_max_stall_ms``: the longest an asyncio loop ticking every millisecond waited while the
  index was built in the background (``IdIndex.build_in_background``, as the server does).

With ``--compare_dict`` it also times the map the server used before (a dict of every id,
built on the first /open inside the event loop) on the same column.

    python -m scripts.bench.open_idmap --rows 21000000
    python -m scripts.bench.open_idmap --rows 2000000 --compare_dict
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from search_r1.search.corpus import ARROW_SCHEMA, Corpus, IdIndex

_CHUNK_ROWS = 8192  # the record batches convert_jsonl_to_arrow writes


def write_id_corpus(path: str, rows: int) -> None:
    """An Arrow store of ``rows`` passages with ids "0" .. str(rows - 1) and empty contents."""
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, ARROW_SCHEMA) as writer:
        step = 1 << 20
        for start in range(0, rows, step):
            ids = pc.cast(pa.array(np.arange(start, min(rows, start + step), dtype=np.int64)), pa.string())
            contents = pa.array([""] * len(ids), pa.string())
            writer.write_table(pa.table([ids, contents], schema=ARROW_SCHEMA), max_chunksize=_CHUNK_ROWS)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


def _percentiles_us(seconds: list[float]) -> dict[str, float]:
    us = np.asarray(seconds) * 1e6
    return {"p50": round(float(np.percentile(us, 50)), 1), "p99": round(float(np.percentile(us, 99)), 1)}


def time_lookups(index: IdIndex, rows: int, n: int = 10_000, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    known = [str(rng.randrange(rows)) for _ in range(n)]
    unknown = [f"missing-{rng.randrange(10**12)}" for _ in range(n)]
    out: dict[str, Any] = {}
    # distinct objects: a str caches its hash, and a request's id is a new string each time
    huge = ["x" * ((1 << 20) - 2) + f"{i:02d}" for i in range(20)]
    for name, ids in (("known", known), ("unknown", unknown), ("unknown_1mb", huge)):
        seconds = []
        for doc_id in ids:
            t = time.perf_counter()
            row = index.row(doc_id)
            seconds.append(time.perf_counter() - t)
            assert (row is not None) == (name == "known"), (name, doc_id[:40], row)
        out[name] = _percentiles_us(seconds)
    return out


async def _max_stall_while(future: Any, tick_s: float = 0.001) -> float:
    """The longest gap, beyond ``tick_s``, between ticks of this event loop until ``future`` is done."""
    worst = 0.0
    last = time.perf_counter()
    while not future.done():
        await asyncio.sleep(tick_s)
        now = time.perf_counter()
        worst = max(worst, now - last - tick_s)
        last = now
    return worst


def measure(path: str, rows: int, compare_dict: bool) -> dict[str, Any]:
    corpus = Corpus.open(path)
    assert len(corpus) == rows
    before_rss, before_anon = _status_kib("VmRSS"), _status_kib("RssAnon")
    _reset_peak()
    t = time.perf_counter()
    index = IdIndex.build(corpus)
    build_s = time.perf_counter() - t
    result: dict[str, Any] = {
        "rows": rows,
        "build_s": round(build_s, 2),
        "rss_delta_mib": round((_status_kib("VmRSS") - before_rss) / 1024, 1),
        "anon_delta_mib": round((_status_kib("RssAnon") - before_anon) / 1024, 1),
        "peak_delta_mib": round((_status_kib("VmHWM") - before_rss) / 1024, 1),
        "bytes_per_id": round(int(index._hashes.nbytes + index._rows.nbytes) / rows, 1),
        "duplicate_ids": index.num_duplicates,
        "lookup_us": time_lookups(index, rows),
    }
    del index
    t = time.perf_counter()
    result["loop_max_stall_ms"] = round(asyncio.run(_max_stall_while(IdIndex.build_in_background(corpus))) * 1e3, 1)
    result["background_build_s"] = round(time.perf_counter() - t, 2)
    if compare_dict:
        before_anon = _status_kib("RssAnon")
        t = time.perf_counter()
        old: dict[str, int] = {}
        for row, doc_id in enumerate(i for ids, _ in corpus.iter_batches() for i in ids):
            old.setdefault(str(doc_id), row)
        result["dict_build_s"] = round(time.perf_counter() - t, 2)
        result["dict_anon_delta_mib"] = round((_status_kib("RssAnon") - before_anon) / 1024, 1)
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=21_015_324, help="ids in the synthetic column (wiki-18: 21,015,324)")
    p.add_argument("--compare_dict", action="store_true", help="also build the old dict map (~120 B an id)")
    p.add_argument("--work_dir", default=None, help="where the synthetic store is written (default: a temp dir)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        path = str(Path(tmp) / "ids.arrow")
        t = time.perf_counter()
        # written by a child, so its allocations do not blur this process's memory figures
        child = multiprocessing.get_context("spawn").Process(target=write_id_corpus, args=(path, args.rows))
        child.start()
        child.join()
        if child.exitcode != 0:
            raise SystemExit(f"writing the synthetic store failed (exit code {child.exitcode})")
        write_s = time.perf_counter() - t
        result = {"write_s": round(write_s, 1), **measure(path, args.rows, args.compare_dict)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
