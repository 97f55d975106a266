"""Two real Ray nodes on this machine (a head and a second `ray start --address=...`, each with
its own raylet and 2 CPUs): the driver joins with trainer.ray_address and places one worker
per node; one GRPO step with search against a real BM25 server gives the same numbers as the
same step with both workers on one (local) node searching the same index on Ray Serve
(conftest.py's one_node_step).

The driver runs as `python -m verl.trainer.main_ppo` in a subprocess: the test process may
already hold the session's local Ray (tests/conftest.py), and a process is in one Ray at a time.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scripts.bench.toy_task import toy_overrides
from tests.multinode._local_ray import REPO, LocalRayCluster, ray_env
from tests.trainer._search_model import TOPK
from tests.trainer.test_search_e2e import BATCH_SIZE, N_AGENT, ROLLOUTS, SearchWorld, _queries_answered

pytestmark = [pytest.mark.multinode, pytest.mark.slow]

# Metrics that measure the machine, not the math: wall-clock times, throughput, memory.
MACHINE_METRICS = ("timing_s/", "timing_per_token_ms/", "perf/")


def _overrides(world: SearchWorld, out: Path, nnodes: int, workers_per_node: int, n_agent: int = N_AGENT
               ) -> list[str]:
    """One GRPO step with search (the settings of tests/trainer/test_search_e2e.py) on nnodes x workers."""
    base = toy_overrides(world.model_dir, world.data, str(out / "ckpt"), adv_estimator="grpo",
                         n_workers=workers_per_node, batch_size=BATCH_SIZE, n_agent=n_agent, response_length=40)
    return [o for o in base if not o.startswith("trainer.nnodes=")] + [
        f"trainer.nnodes={nnodes}",
        "do_search=true", "max_turns=2", "actor_rollout_ref.actor.state_masking=true",
        "data.max_start_length=160", "data.max_prompt_length=512", "data.max_obs_length=160",
        f"retriever.url={world.server_url}/retrieve", f"retriever.topk={TOPK}",
        # hotter than test_search_e2e's 0.7, so that some samples go wrong (seeded: the same ones in
        # every run): rewards differ within a group, and the GRPO advantages, policy loss and gradient
        # being compared are not zero
        "actor_rollout_ref.rollout.temperature=1.0",
        # Hydra's own output folder goes to the test's tmp, not ./outputs
        f"hydra.run.dir={out / 'hydra'}",
    ]


def _driver(overrides: list[str], timeout_s: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", *overrides], cwd=REPO,
                          env=ray_env(HYDRA_FULL_ERROR="1"), capture_output=True, text=True, timeout=timeout_s)


def _step(out: Path, proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-6000:]
    records = [json.loads(line) for line in (out / "ckpt" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1]
    return records[0]


def test_grpo_step_with_search_on_two_ray_nodes_matches_one_node(
        two_nodes: LocalRayCluster, search_world: SearchWorld, one_node_step: dict, tmp_path: Path) -> None:
    # The reference (one_node_step): both workers on one node, a local Ray the driver starts itself, the
    # retriever on Serve there (the same FastAPI app and index as the HTTP server this run searches).
    one_step = one_node_step
    two = tmp_path / "two_nodes"
    before = _queries_answered(search_world.server_url)
    two_proc = _driver(_overrides(search_world, two, nnodes=2, workers_per_node=1)
                       + [f"trainer.ray_address={two_nodes.address}", "trainer.ray_wait_s=60"])
    two_step = _step(two, two_proc)
    served = _queries_answered(search_world.server_url) - before

    # From Ray's GCS: the run's two worker actors (dead now) ran on the two different nodes.
    state = two_nodes.query()
    node_ids = {n["id"] for n in state["nodes"] if n["alive"]}
    workers = [a for a in state["actors"] if a["class"].startswith("WorkerDict")]
    assert len(workers) == 2, workers
    assert {a["node"] for a in workers} == node_ids and len(node_ids) == 2

    # The two-node step really searched against the server, and learned something finite.
    assert two_step["env/number_of_valid_search"] > 0
    assert served == round(two_step["env/number_of_valid_search"] * ROLLOUTS) > 0
    assert two_step["critic/score/mean"] > 0 and math.isfinite(two_step["actor/pg_loss"])

    # Same math: rank r gets the same rows, seed and weights whichever node it runs on, and the
    # gradient all-reduce over 2 gloo ranks adds the same two tensors in the same order over TCP
    # either way (loopback in both runs). So every number is expected bit-identical; the 1e-6
    # relative slack is only there so that a reduction-order change inside a future torch (not
    # node placement) would not break the test, and is far below any real difference (a wrong
    # shard or seed moves these metrics by 1e-2 or more).
    keys = sorted(k for k in one_step if not k.startswith(MACHINE_METRICS))
    assert keys == sorted(k for k in two_step if not k.startswith(MACHINE_METRICS))
    assert "actor/pg_loss" in keys and "actor/grad_norm" in keys and "critic/score/mean" in keys
    assert one_step["critic/advantages/max"] > 0 and one_step["actor/grad_norm"] > 1e-3   # not a trivial step
    different = {k: (one_step[k], two_step[k]) for k in keys
                 if not (one_step[k] == two_step[k] or math.isclose(one_step[k], two_step[k],
                                                                    rel_tol=1e-6, abs_tol=1e-9))}
    assert different == {}


@pytest.mark.parametrize(("nnodes", "workers", "expected"), [
    # a node is missing: 2 live nodes fit, 3 asked for
    (3, 1, ["2 of the 3 node(s) with {'CPU': 1.0}", "missing 1", "trainer.nnodes=3 x trainer.n_gpus_per_node=1"]),
    # the nodes are too small: 3 CPU workers each, the nodes have 2 CPUs
    (2, 3, ["0 of the 2 node(s) with {'CPU': 3.0}", "missing 2", "CPU=2 GPU=0 (too small)"]),
])
def test_driver_waits_a_bounded_time_then_names_what_the_cluster_lacks(
        two_nodes: LocalRayCluster, search_world: SearchWorld, tmp_path: Path,
        nnodes: int, workers: int, expected: list[str]) -> None:
    start = time.monotonic()
    # 2 prompts x 6 samples: batch sizes that divide over 3 and 6 workers, so the config check passes
    # and the run reaches the cluster wait.
    proc = _driver(_overrides(search_world, tmp_path, nnodes=nnodes, workers_per_node=workers, n_agent=6)
                   + [f"trainer.ray_address={two_nodes.address}", "trainer.ray_wait_s=3"], timeout_s=300)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    for text in expected:
        assert text in proc.stderr, proc.stderr[-4000:]
    assert "waiting 3s" in proc.stderr
    assert elapsed < 120      # start-up and imports take ~20 s here; the wait itself is 3 s
    assert len([n for n in two_nodes.query()["nodes"] if n["alive"]]) == 2   # the cluster is untouched


def test_one_step_off_puts_the_rollout_pool_on_one_node_and_the_train_pool_on_the_other(
        two_nodes: LocalRayCluster, search_world: SearchWorld, tmp_path: Path) -> None:
    # 2 workers a node, the rollout pool one node's worth: each pool's bundle is a whole 2-CPU node,
    # so the weights cross from one node to the other over the weight-sync group (gloo, TCP).
    before = {a["name"] for a in two_nodes.query()["actors"]}
    out = tmp_path / "pipelined"
    proc = _driver(_overrides(search_world, out, nnodes=2, workers_per_node=2)
                   + [f"trainer.ray_address={two_nodes.address}", "trainer.ray_wait_s=60",
                      "trainer.pipeline=one_step_off", "trainer.rollout_pool=2", "trainer.total_training_steps=3"])
    assert proc.returncode == 0, proc.stderr[-6000:]
    records = [json.loads(line) for line in (out / "ckpt" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]

    state = two_nodes.query()
    run = [a for a in state["actors"] if a["name"] not in before]
    rollout_nodes = {a["node"] for a in run if a["class"] == "ActorRolloutRefWorker"}
    train_nodes = {a["node"] for a in run if a["class"].startswith("WorkerDict")}
    assert len([a for a in run if a["class"] == "ActorRolloutRefWorker"]) == 2, run
    assert len(rollout_nodes) == 1 and len(train_nodes) == 1 and rollout_nodes != train_nodes, run

    staleness = [r["pipeline/staleness"] for r in records]
    assert staleness[:2] == [0.0, 1.0] and max(staleness) <= 1.0, staleness
    assert records[-1]["pipeline/weight_syncs"] >= 1        # weights crossed the nodes before batch 3
    for r in records:
        assert r["env/number_of_valid_search"] > 0 and r["env/search_failures"] == 0
        assert math.isfinite(r["actor/pg_loss"])
