"""Load test of the standalone retrieval server: many concurrent single-query clients.

Starts `bash retrieval_launch.sh` (the example BM25 index, offline) on a free port, then
``--clients`` coroutines, each its own ``AsyncRetrievalClient`` (its own connection, as separate
rollout workers would have), each sending ``--queries`` distinct single-query requests one
after the other, all clients at once. Prints one JSON object: requests answered and failed,
503s the server sent (``overloaded``: each one a retry by a client), latency percentiles per
request (retries included), the server's resident memory before and after, and whether it
still answers /health.

    python scripts/bench/retrieval_load.py --clients 1000 --queries 4
    python scripts/bench/retrieval_load.py --clients 1000 --queries 4 --max_pending_queries 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from search_r1.search.async_client import AsyncRetrievalClient  # noqa: E402
from search_r1.search.client import RetrievalError  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--queries", type=int, default=4, help="distinct single-query requests per client")
    p.add_argument("--max_pending_queries", type=int, default=None, help="the server's bound (default: its own)")
    p.add_argument("--max_retries", type=int, default=8, help="each client's retry budget")
    p.add_argument("--timeout", type=float, default=60.0, help="each client's request timeout (s)")
    p.add_argument("--start_timeout", type=float, default=300.0, help="seconds to wait for the server")
    return p.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def start_server(port: int, max_pending: int | None, start_timeout: float) -> subprocess.Popen:
    cmd = ["bash", str(ROOT / "retrieval_launch.sh"), "--port", str(port)]
    if max_pending is not None:
        cmd += ["--max_pending_queries", str(max_pending)]
    # the script runs `python`: this interpreter's, so the server sees the same packages
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    log = tempfile.TemporaryFile(mode="w+")       # not a pipe: a full pipe would stall the server
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + start_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"retrieval_launch.sh exited {proc.returncode}: {log.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the retrieval server did not answer /health within {start_timeout} s")


async def one_client(url: str, queries: list[str], args: argparse.Namespace,
                     latencies: list[float], failures: list[str]) -> None:
    async with AsyncRetrievalClient(url, topk=3, timeout=args.timeout, max_retries=args.max_retries,
                                    backoff_factor=0.1, pool_size=1) as client:
        for query in queries:
            started = time.perf_counter()
            try:
                hits = await client.retrieve([query])
            except RetrievalError as err:
                failures.append(f"{type(err).__name__}: {err}")
                continue
            latencies.append(time.perf_counter() - started)
            if len(hits) != 1 or not hits[0]:
                failures.append(f"no hits for {query!r}")


async def fire(url: str, args: argparse.Namespace) -> tuple[list[float], list[str], float]:
    latencies: list[float] = []
    failures: list[str] = []
    # Client i asks queries i*q .. i*q+q-1 of a distinct set: every request is a real search.
    words = ["river", "mountain", "kiln", "glass", "empire", "violin", "comet", "harbor", "forest", "engine"]
    jobs = []
    for i in range(args.clients):
        queries = [f"{words[(i + j) % len(words)]} history {i * args.queries + j}" for j in range(args.queries)]
        jobs.append(one_client(url, queries, args, latencies, failures))
    started = time.perf_counter()
    await asyncio.gather(*jobs)
    return latencies, failures, time.perf_counter() - started


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = args.clients + 256
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    port = free_port()
    proc = start_server(port, args.max_pending_queries, args.start_timeout)
    base = f"http://127.0.0.1:{port}"
    try:
        rss_before = rss_mib(proc.pid)
        latencies, failures, wall = asyncio.run(fire(base + "/retrieve", args))
        rss_after = rss_mib(proc.pid)
        health = httpx.get(base + "/health", timeout=10).json()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    counters = health["counters"]
    result = {
        "clients": args.clients, "queries_per_client": args.queries,
        "requests": args.clients * args.queries, "answered": len(latencies), "failed": len(failures),
        "failure_examples": sorted(set(failures))[:5],
        "overloaded_503": counters["overloaded"], "max_pending_queries": health["max_pending_queries"],
        "server_requests": counters["requests"], "server_errors": counters["errors"],
        "latency_s": {"p50": percentile(latencies, 0.50), "p99": percentile(latencies, 0.99),
                      "max": max(latencies) if latencies else None},
        "wall_s": wall, "answered_per_s": len(latencies) / wall if wall else None,
        "server_rss_mib": {"before": rss_before, "after": rss_after, "growth": rss_after - rss_before},
        "server_alive_after": health["status"] == "ok", "pending_after": health["pending_queries"],
        "cpu_count": os.cpu_count(),
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
