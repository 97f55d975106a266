"""Retrieval on Ray Serve, 1 vs 2 replicas, on a two-node Ray cluster started on this machine.

Starts a head and a second node (`ray start`, 2 CPUs each, as tests/multinode does), then runs
``scripts/bench/retrieval_load.py --serve ray --via handle`` against it with ``--replicas 1`` and
with the default (one replica per node): the clients split over one actor per node, each calling its
node's replica through handles, as rollout workers do. Prints one JSON object with both runs and the
ratio of their answered-per-second. Both nodes share this machine's cores: the ratio measures what
Serve's placement and routing add, not what a second machine's cores would.

    python scripts/bench/two_node_serve.py --clients 400 --queries 4
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.conftest import free_port  # noqa: E402
from tests.multinode._local_ray import LocalRayCluster, ray_env  # noqa: E402


def run_load(address: str, replicas: int | None, clients: int, queries: int) -> dict:
    cmd = [sys.executable, str(ROOT / "scripts" / "bench" / "retrieval_load.py"), "--serve", "ray", "--via", "handle",
           "--ray_address", address, "--clients", str(clients), "--queries", str(queries)]
    if replicas is not None:
        cmd += ["--replicas", str(replicas)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=ray_env(), cwd=ROOT, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"retrieval_load.py failed: {out.stderr[-3000:]}")
    return json.loads(out.stdout[out.stdout.rindex('{\n  "server"'):])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=400)
    p.add_argument("--queries", type=int, default=4)
    args = p.parse_args(argv)
    cluster = LocalRayCluster(Path(tempfile.mkdtemp(prefix="two_node_serve")), port=free_port(), client_port=free_port())
    try:
        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes(1)
        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes(2)
        runs = {"1_replica": run_load(cluster.address, 1, args.clients, args.queries),
                "2_replicas": run_load(cluster.address, None, args.clients, args.queries)}
    finally:
        cluster.stop()
    keys = ("answered", "failed", "latency_s", "wall_s", "answered_per_s", "per_replica", "server_rss_mib")
    result = {name: {k: run[k] for k in keys} for name, run in runs.items()}
    result["throughput_2_over_1"] = round(runs["2_replicas"]["answered_per_s"] / runs["1_replica"]["answered_per_s"], 2)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
