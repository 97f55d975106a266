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

With ``--serve ray`` the same index is served as a Ray Serve application (``retriever.serve=ray``'s
deployment, search_r1/search/ray_serve.py) on a local Ray this script starts (or the cluster at
``--ray_address``), ``--replicas`` replicas (default: one per node), and the clients post to Serve's
HTTP proxy; memory is the replicas' resident memory, summed.

    python scripts/bench/retrieval_load.py --serve ray --replicas 2

``--via handle`` puts the clients where rollout workers are instead: one Ray actor per node, each
running its share of the clients through handles that prefer its node's replica (no proxy). On a
cluster of several nodes (``--ray_address``; ``scripts/bench/two_node_serve.py`` starts two local
Ray nodes and runs this with 1 and 2 replicas):

    python scripts/bench/retrieval_load.py --serve ray --via handle --ray_address HOST:PORT --replicas 2
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

from scripts.demo.server import stop_process  # noqa: E402
from search_r1.search.client import RetrievalError  # noqa: E402
from search_r1.search.serve_client import open_async_retrieval_client  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--queries", type=int, default=4, help="distinct single-query requests per client")
    p.add_argument("--max_pending_queries", type=int, default=None, help="the server's bound (default: its own)")
    p.add_argument("--max_retries", type=int, default=8, help="each client's retry budget")
    p.add_argument("--timeout", type=float, default=60.0, help="each client's request timeout (s)")
    p.add_argument("--start_timeout", type=float, default=300.0, help="seconds to wait for the server")
    p.add_argument("--serve", choices=["none", "ray"], default="none",
                   help="ray: serve the index as a Ray Serve application instead of retrieval_launch.sh")
    p.add_argument("--replicas", type=int, default=None, help="--serve ray: replicas (default: one per node)")
    p.add_argument("--ray_address", default=None, help="--serve ray: join this cluster (default: start a local Ray)")
    p.add_argument("--via", choices=["http", "handle"], default="http",
                   help="--serve ray: clients post to Serve's HTTP proxy, or run in one Ray actor per node and call "
                        "the replica of their node through handles (as rollout workers do)")
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
    async with open_async_retrieval_client(url, topk=3, timeout=args.timeout, max_retries=args.max_retries,
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


async def fire(url: str, args: argparse.Namespace, clients: range | None = None
               ) -> tuple[list[float], list[str], float]:
    latencies: list[float] = []
    failures: list[str] = []
    # Client i asks queries i*q .. i*q+q-1 of a distinct set: every request is a real search.
    words = ["river", "mountain", "kiln", "glass", "empire", "violin", "comet", "harbor", "forest", "engine"]
    jobs = []
    for i in clients if clients is not None else range(args.clients):
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


def run_standalone(args: argparse.Namespace) -> tuple[list[float], list[str], float, dict, float, float, dict]:
    """Fire at `bash retrieval_launch.sh`: (latencies, failures, wall, /health, RSS before, after, extra)."""
    port = free_port()
    proc = start_server(port, args.max_pending_queries, args.start_timeout)
    base = f"http://127.0.0.1:{port}"
    try:
        rss_before = rss_mib(proc.pid)
        latencies, failures, wall = asyncio.run(fire(base + "/retrieve", args))
        rss_after = rss_mib(proc.pid)
        health = httpx.get(base + "/health", timeout=10).json()
    finally:
        stop_process(proc, grace_s=30)
    return latencies, failures, wall, health, rss_before, rss_after, {"server": "retrieval_launch.sh"}


def example_bm25_index() -> tuple[str, str]:
    """(index folder, corpus) of the example corpus's BM25 index, built once as retrieval_launch.sh does."""
    from search_r1.search.index_builder import build_index
    from search_r1.search.retrievers import BM25_META_FILE

    corpus = ROOT / "example" / "corpus.jsonl"
    folder = Path(os.environ.get("SEARCH_R1_CACHE", Path.home() / ".cache" / "search_r1")) / "example_index"
    index = folder / "bm25"
    if not (index / BM25_META_FILE).exists():
        index = Path(build_index("bm25", str(corpus), str(folder)))
    return str(index), str(corpus)


def run_serve(args: argparse.Namespace) -> tuple[list[float], list[str], float, dict, float, float, dict]:
    """Fire at the Ray Serve application's HTTP proxy; memory summed over the replicas."""
    import ray

    from search_r1.search.ray_serve import ServeSettings, check_server_args, deploy, undeploy

    index, corpus = example_bm25_index()
    server_args: dict[str, Any] = {"index_path": index, "corpus_path": corpus, "retriever_name": "bm25", "topk": 3}
    if args.max_pending_queries is not None:
        server_args["max_pending_queries"] = args.max_pending_queries
    replicas = args.replicas or 1
    if args.ray_address:
        ray.init(address=args.ray_address, logging_level="ERROR", log_to_driver=False)
    else:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(num_cpus=replicas + 1, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    port = free_port()
    settings = ServeSettings(app_name="retrieval_load", argv=check_server_args(server_args), replicas=args.replicas,
                             replica_resources={"num_cpus": 1.0}, max_ongoing_requests=4096, http_port=port,
                             wait_s=args.start_timeout)
    try:
        deploy(settings)
        n_nodes = sum(1 for node in ray.nodes() if node["Alive"])
        expected = args.replicas or n_nodes
        before = _all_replicas(settings.app_name, expected)
        rss_before = sum(rss_mib(h["pid"]) for h in before)
        if args.via == "handle":
            latencies, failures, wall = fire_from_every_node(settings.app_name, args)
        else:
            latencies, failures, wall = asyncio.run(fire(f"http://127.0.0.1:{port}/retrieve", args))
        after = _all_replicas(settings.app_name, expected)
        rss_after = sum(rss_mib(h["pid"]) for h in after)
    finally:
        undeploy(settings.app_name)
        ray.shutdown()
    health = dict(after[0])
    health["counters"] = {key: sum(h["counters"][key] for h in after) for key in ("overloaded", "requests", "errors")}
    health["pending_queries"] = sum(h["pending_queries"] for h in after)
    health["status"] = "ok" if all(h["status"] == "ok" for h in after) else "degraded"
    per_replica = [{"requests": h["counters"]["requests"], "queries": h["counters"]["queries"]} for h in after]
    return latencies, failures, wall, health, rss_before, rss_after, {
        "server": "ray_serve", "via": args.via, "replicas": len(after), "per_replica": per_replica,
        "nodes": n_nodes}


def fire_from_every_node(app_name: str, args: argparse.Namespace) -> tuple[list[float], list[str], float]:
    """The clients split over one actor per alive node, each calling through a handle that prefers its
    node's replica (the rollout workers' path); all start together; wall = until the last is done."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from search_r1.search.ray_serve import serve_url

    @ray.remote(num_cpus=0)
    class Clients:
        def fire(self, clients: range) -> tuple[list[float], list[str]]:
            latencies, failures, _ = asyncio.run(fire(serve_url(app_name), args, clients))
            return latencies, failures

        def ready(self) -> bool:
            return True

    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    actors = [Clients.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
              for node in nodes]
    ray.get([a.ready.remote() for a in actors])
    shares = [range(i, args.clients, len(actors)) for i in range(len(actors))]
    started = time.perf_counter()
    results = ray.get([a.fire.remote(share) for a, share in zip(actors, shares, strict=True)])
    wall = time.perf_counter() - started
    return [x for lat, _ in results for x in lat], [f for _, fails in results for f in fails], wall


def _all_replicas(app_name: str, expected: int) -> list[dict]:
    """Every replica's /health (several on one node included), until each replica id was seen."""
    from search_r1.search.ray_serve import local_handle, replica_health

    # one per node from a task on that node; several on one node: sampled through this node's handle
    seen = {h["replica_id"]: h for h in replica_health(app_name).values()}
    handle = local_handle(app_name)
    for _ in range(50 * expected):
        if len(seen) == expected:
            break
        health = handle.health.remote().result(timeout_s=30)
        seen[health["replica_id"]] = health
    return list(seen.values())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = args.clients + 256
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    run = run_serve if args.serve == "ray" else run_standalone
    latencies, failures, wall, health, rss_before, rss_after, extra = run(args)
    counters = health["counters"]
    result = {**extra,
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
