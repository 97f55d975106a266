"""Shared by the package's modules: one search world (the BM25 server, the model warmed up to search
it and the question parquets of tests/trainer/test_search_e2e.py, built with the same helpers once
instead of once a module: the warm-up is the slow part on a 2-core machine) and the two-node Ray
cluster fixture."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import free_port
from tests.multinode._local_ray import LocalRayCluster
from tests.trainer.test_search_e2e import ROLLOUTS, SearchWorld, serve_search_world


@pytest.fixture(scope="package")
def search_world(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SearchWorld]:
    with serve_search_world(tmp_path_factory.mktemp("search_world"), tiny_model_dir) as world:
        yield world


@pytest.fixture(scope="package")
def one_node_step(search_world: SearchWorld, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The reference step, run once for the package: one sync GRPO step with search, both workers on one
    local node the driver starts, the retriever on Ray Serve there (retriever.serve=ray: the driver's
    generation manager searches through a handle to the node's one replica). test_two_ray_nodes.py's
    two-node step against the standalone HTTP server must equal it on every metric: node placement and
    the retriever's transport both leave the math alone (a step with each alone cost ~50 s of CPU more)."""
    from tests.multinode.test_serve_retrieval import _answered, _replicas, _serve_overrides
    from tests.multinode.test_two_ray_nodes import _driver, _step

    out = tmp_path_factory.mktemp("one_node")
    step = _step(out, _driver(_serve_overrides(search_world, out, None, nnodes=1, workers_per_node=2, mode="sync")))
    replicas = _replicas(out)
    assert len(replicas) == 1
    assert sum(_answered(r) for r in replicas.values()) == round(step["env/number_of_valid_search"] * ROLLOUTS)
    return step


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRayCluster]:
    """A head and a second node, 2 CPUs each, one cluster per module (test_two_ray_nodes.py,
    test_serve_retrieval.py): the tests read the cluster's actor table, which keeps every earlier
    job's (dead) workers, so a module must not see another module's runs."""
    cluster = LocalRayCluster(tmp_path_factory.mktemp("ray_nodes"), port=free_port(), client_port=free_port())
    try:
        cluster.start_node(num_cpus=2)
        cluster.start_node(num_cpus=2)
        yield cluster
    finally:
        cluster.stop()
    assert cluster.leftover_pids() == [], "a Ray process of the test cluster outlived its node"
