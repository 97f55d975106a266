"""`retriever.serve=ray` on two real Ray nodes: the driver starts the retrieval server as a Ray Serve
application with one replica per node, the async rollout's workers call the replica on their own
node, and a replica killed while it holds searches is replaced by Serve while the step finishes with
every search answered.

Each replica counts the calls it answered per caller node; the driver writes every replica's /health to
<log dir>/retrieval_replicas.json before it deletes the application.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multinode._local_ray import REPO, LocalRayCluster, ray_env
from tests.multinode.test_two_ray_nodes import _driver, _overrides, _step
from tests.trainer.test_search_e2e import ROLLOUTS, SearchWorld

pytestmark = [pytest.mark.multinode, pytest.mark.slow]

APP = "search_r1_retrieval"

# Waits until a replica of the application holds a request, kills that replica's actor (as a crash
# would: no graceful shutdown) and prints what it killed. Runs beside the driver, as another driver.
KILL_WHEN_BUSY = r"""
import json, sys, time, ray
import ray._private.state as state
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from search_r1.search.ray_serve import local_handle
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
app, deadline = sys.argv[2], time.monotonic() + float(sys.argv[3])

@ray.remote(num_cpus=0)
class Asker:                        # one per node: asks the replica of its node, through a handle kept open
    def __init__(self):
        self.handle = None
    def health(self):
        if self.handle is None:
            self.handle = local_handle(app)
        return self.handle.health.remote().result(timeout_s=20)

askers = {n["NodeID"]: Asker.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
                                     ).remote() for n in ray.nodes() if n["Alive"]}
# Each node's asker is polled on its own: a node whose answer is slow (its replica still starting, a loaded
# machine) does not hold back the other node's polls.
pending = {askers[node].health.remote(): node for node in askers}
while time.monotonic() < deadline:
    ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
    for ref in ready:
        node = pending.pop(ref)
        try:
            h = ray.get(ref)
        except Exception as err:    # the application is not deployed yet
            print(f"not yet: {type(err).__name__}"[:200], file=sys.stderr, flush=True)
            time.sleep(0.2)
            h = None
        if h is not None and h["node_id"] == node and h["requests_in_flight"] > 0:
            for actor in state.actors().values():
                if (actor["State"] == "ALIVE" and actor.get("ActorClassName", "").startswith(f"ServeReplica:{app}:")
                        and (actor.get("Address") or {}).get("NodeID") == node):
                    ray.kill(ray.get_actor(actor["Name"], namespace="serve"), no_restart=True)
                    print("KILLED " + json.dumps({"node": node, "replica_id": h["replica_id"],
                                                  "in_flight": h["requests_in_flight"]}), flush=True)
                    sys.exit(0)
        pending[askers[node].health.remote()] = node
print("NO_KILL", flush=True)
"""


def _serve_overrides(world: SearchWorld, out: Path, cluster: LocalRayCluster | None, *extra: str, nnodes: int = 2,
                     workers_per_node: int = 1, mode: str = "async") -> list[str]:
    """A GRPO step (async by default) on `nnodes` x `workers_per_node` with retriever.serve=ray, joining
    `cluster` (without one: a local Ray the driver starts)."""
    joined = [] if cluster is None else [f"trainer.ray_address={cluster.address}", "trainer.ray_wait_s=60"]
    return _overrides(world, out, nnodes=nnodes, workers_per_node=workers_per_node) + joined + [
        f"actor_rollout_ref.rollout.mode={mode}",
        # the url of the test's own server must not be used: point it nowhere
        "retriever.url=http://127.0.0.1:9/retrieve",
        "retriever.serve=ray", "retriever.health_wait_s=240",
        f"+retriever.server_args.index_path={world.index_path}",
        f"+retriever.server_args.corpus_path={world.corpus_path}",
        "+retriever.server_args.retriever_name=bm25", "+retriever.server_args.topk=3",
        *extra,
    ]


def _replicas(out: Path) -> dict[str, dict]:
    return json.loads((out / "ckpt" / "logs" / "retrieval_replicas.json").read_text())


def _answered(replica: dict) -> int:
    return int(replica["counters"]["cache_hits"] + replica["counters"]["cache_misses"])


def test_async_step_with_serve_has_a_replica_per_node_and_each_node_is_served_by_its_own(
        two_nodes: LocalRayCluster, search_world: SearchWorld, tmp_path: Path) -> None:
    step = _step(tmp_path, _driver(_serve_overrides(search_world, tmp_path, two_nodes)))
    replicas = _replicas(tmp_path)
    state = two_nodes.query()
    nodes = {n["id"] for n in state["nodes"] if n["alive"]}
    workers = [a for a in state["actors"] if a["class"].startswith("WorkerDict")]

    # one replica on each node; the rollout workers ran one per node too
    assert set(replicas) == nodes and len(nodes) == 2
    assert {a["node"] for a in workers} == nodes
    # every call a replica answered came from its own node (the worker there; the driver on the head)
    for node, replica in replicas.items():
        assert replica["node_id"] == node
        assert set(replica["calls_by_caller_node"]) == {node}, replica["calls_by_caller_node"]
        assert replica["counters"]["errors"] == 0 and replica["counters"]["overloaded"] == 0
    # both workers searched, and everything they searched was answered by the replicas
    assert all(_answered(r) > 0 for r in replicas.values())
    assert sum(_answered(r) for r in replicas.values()) == round(step["env/number_of_valid_search"] * ROLLOUTS) > 0
    assert step["env/search_failures"] == 0
    # the application is gone after the run: no replica actor left alive
    assert not [a for a in state["actors"] if a["class"].startswith(f"ServeReplica:{APP}") and a["state"] == "ALIVE"]


def test_a_replica_killed_mid_rollout_is_replaced_and_every_search_is_answered(
        two_nodes: LocalRayCluster, search_world: SearchWorld, tmp_path: Path) -> None:
    # every answer takes 60 s, so the probe finds a replica holding requests and kills it then. The rollout's
    # searches come in about one round per row, so a replica holds requests for about one answer's time: at 4 s,
    # 10 s and 30 s, a loaded machine (CI's three test workers on 2 cores; here, 4 busy loops beside the test)
    # took tens of seconds a poll and the probe never saw a replica busy. The clients' timeout (30 s by default)
    # is given room above the answers' 60 s.
    overrides = _serve_overrides(search_world, tmp_path, two_nodes, "+retriever.server_args.simulate_latency_ms=60000",
                                 "retriever.timeout=180")
    probe = subprocess.Popen([sys.executable, "-c", KILL_WHEN_BUSY, two_nodes.address, APP, "400"], cwd=REPO,
                             env=ray_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        proc = _driver(overrides)
    finally:
        if probe.poll() is None:
            probe.kill()
        out, err = probe.communicate(timeout=60)
    killed = [json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if line.startswith("KILLED ")]
    assert killed, f"the probe killed nothing: {out[-2000:]} {err[-3000:]} DRIVER: {proc.stderr[-5000:]}"
    assert killed[0]["in_flight"] > 0
    step = _step(tmp_path, proc)

    # the searches the dead replica held were resent and answered: none failed
    assert step["env/number_of_valid_search"] > 0
    assert step["env/search_failures"] == 0
    # Serve replaced the dead replica: one live replica per node again, the killed one not among them
    replicas = _replicas(tmp_path)
    nodes = {n["id"] for n in two_nodes.query()["nodes"] if n["alive"]}
    assert set(replicas) == nodes
    assert killed[0]["replica_id"] not in {r["replica_id"] for r in replicas.values()}
