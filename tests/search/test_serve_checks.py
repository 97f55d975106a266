"""Serve replicas that could not do their job are refused before anything starts
(search_r1/search/serve_checks.py): a GPU the trainer's workers need, and too few CPUs for an exact
(Flat) dense search. Index files are real FAISS files written by faiss; the wiki-18 case is priced
from its published shape (21,015,324 x 768) with the same arithmetic."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from search_r1.search.serve_checks import (
    FLAT_FLOPS_PER_CORE,
    NodeGpus,
    flat_search_cpus,
    flat_search_seconds,
    read_faiss_header,
    replica_gpu_error,
)
from verl.trainer.config_check import ConfigError, validate_config
from verl.trainer.main_ppo import compose_config

# 8 prompts x 1 sample on 2 CPU workers (tests/trainer/test_config.py's small baseline)
SMALL = ["trainer.n_gpus_per_node=2", "trainer.device=cpu", "data.train_batch_size=8",
         "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size=2",
         "critic.ppo_micro_batch_size=2", "actor_rollout_ref.rollout.log_prob_micro_batch_size=2",
         "actor_rollout_ref.ref.log_prob_micro_batch_size=2"]
VECTORS, DIM = 5_000, 384


def _write_index(path: Path, kind: str, vectors: int = VECTORS, dim: int = DIM) -> str:
    import faiss

    index = {"flat_ip": lambda: faiss.IndexFlatIP(dim), "flat_l2": lambda: faiss.IndexFlatL2(dim),
             "hnsw": lambda: faiss.IndexHNSWFlat(dim, 8, faiss.METRIC_INNER_PRODUCT)}[kind]()
    index.add(np.random.default_rng(0).standard_normal((vectors, dim), dtype=np.float32))
    faiss.write_index(index, str(path))
    return str(path)


@pytest.fixture(scope="module")
def indexes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("indexes")
    return {kind: _write_index(folder / f"{kind}.index", kind) for kind in ("flat_ip", "hnsw")}


def test_the_index_header_says_type_dimension_and_vector_count(indexes: dict[str, str], tmp_path: Path) -> None:
    flat = read_faiss_header(indexes["flat_ip"])
    assert (flat.kind, flat.flat, flat.dim, flat.vectors) == ("IndexFlatIP", True, DIM, VECTORS)
    l2 = read_faiss_header(_write_index(tmp_path / "l2.index", "flat_l2", vectors=7, dim=16))
    assert (l2.kind, l2.flat, l2.dim, l2.vectors) == ("IndexFlatL2", True, 16, 7)
    hnsw = read_faiss_header(indexes["hnsw"])
    assert (hnsw.fourcc, hnsw.flat, hnsw.dim, hnsw.vectors) == ("IHNf", False, DIM, VECTORS)
    (tmp_path / "corpus.jsonl").write_text('{"id": "0", "contents": "\\"T\\"\\nbody"}\n' * 3)
    for not_faiss in (tmp_path, tmp_path / "missing.index", tmp_path / "corpus.jsonl"):
        assert read_faiss_header(not_faiss) is None


def test_a_wiki_scale_flat_index_needs_23_cpus_to_search_a_512_query_turn_within_30_s() -> None:
    # the measured throughput: 128 queries over 5,000 x 384 vectors in 20.4 ms on one core
    assert FLAT_FLOPS_PER_CORE == pytest.approx(24.09e9, rel=1e-3)
    # wiki-18 e5: 2 x 21,015,324 x 768 = 32.3 GFLOP a query; 512 of them on one core: 686 s
    assert flat_search_seconds(21_015_324, 768, 512, cpus=1) == pytest.approx(686, abs=1)
    assert flat_search_cpus(21_015_324, 768, 512, seconds=30) == 23
    assert flat_search_cpus(21_015_324, 768, 8, seconds=30) == 1   # a demo-sized turn fits one core
    assert flat_search_cpus(VECTORS, DIM, 8, seconds=0.0005) == 3


def _serve(index: str, *extra: str, retriever: str = "e5") -> list[str]:
    return [*SMALL, "retriever.serve=ray", f"+retriever.server_args.index_path={index}",
            "+retriever.server_args.corpus_path=corpus.jsonl", f"+retriever.server_args.retriever_name={retriever}",
            *extra]


def test_a_dense_flat_replica_with_too_few_cpus_for_a_turn_within_the_timeout_is_refused(
        indexes: dict[str, str]) -> None:
    # 8 queries a turn (sync: all to the driver's replica), 3.84 MFLOP each: 1.3 ms on one core, so a
    # retriever.timeout of 0.5 ms needs 3 CPUs. (The wiki-scale case is the same arithmetic at 30 s.)
    tight = ["retriever.timeout=0.0005"]
    with pytest.raises(ConfigError) as info:
        validate_config(compose_config(_serve(indexes["flat_ip"], *tight)))
    message = str(info.value)
    assert "retriever.replica_resources.num_cpus=1 is too few for a dense retriever over a Flat index" in message
    assert f"{indexes['flat_ip']} is a FAISS IndexFlatIP of 5,000 x 384 vectors" in message
    assert "up to 8 queries at once (rollout.mode=sync" in message and "retriever.timeout=0.0005 s" in message
    assert "at least 3 CPUs (retriever.replica_resources.num_cpus=3)" in message
    assert "faiss_gpu=true" in message and "HNSW or IVF" in message
    validate_config(compose_config(_serve(indexes["flat_ip"], *tight, "retriever.replica_resources.num_cpus=3")))
    validate_config(compose_config(_serve(indexes["flat_ip"])))                   # the default 30 s: plenty
    validate_config(compose_config(_serve(indexes["hnsw"], *tight)))              # no full scan
    validate_config(compose_config(_serve(indexes["flat_ip"], *tight, retriever="bm25")))   # not a dense search


def test_the_async_rollout_spreads_a_turn_over_the_replicas(indexes: dict[str, str]) -> None:
    # async with 2 replicas: 4 queries a replica, which 2 CPUs search within 0.5 ms; 1 CPU does not
    spread = ["retriever.timeout=0.0005", "actor_rollout_ref.rollout.mode=async", "retriever.replicas=2"]
    validate_config(compose_config(_serve(indexes["flat_ip"], *spread, "retriever.replica_resources.num_cpus=2")))
    with pytest.raises(ConfigError, match=r"up to 4 queries at once \(rollout.mode=async: 8 rollouts searching "
                                          r"at once over 2 replica\(s\)\).*num_cpus=2\)"):
        validate_config(compose_config(_serve(indexes["flat_ip"], *spread)))


def _nodes(*gpus: float, custom: dict[str, float] | None = None) -> list[NodeGpus]:
    return [NodeGpus(f"node{i}", g, custom or {}) for i, g in enumerate(gpus)]


def test_a_replica_gpu_on_nodes_whose_gpus_all_train_is_refused_naming_what_the_nodes_have() -> None:
    message = replica_gpu_error(1, {}, 8, _nodes(8, 8))
    assert message.startswith("retriever.replica_resources.num_gpus=1 asks each Ray Serve retrieval replica for a GPU")
    assert "trainer.n_gpus_per_node=8" in message and "(node0 has 8; node1 has 8)" in message
    assert "wait for it forever" in message and "retriever.replica_resources.num_gpus=0" in message
    assert "node1 has 8" in replica_gpu_error(0.25, {}, 8, _nodes(9, 8))   # a fraction takes a GPU too
    assert replica_gpu_error(1, {}, 7, _nodes(8, 8)) is None        # one GPU a node left for the replica
    assert replica_gpu_error(0, {}, 8, _nodes(8, 8)) is None        # replicas on CPU
    assert replica_gpu_error(1, {}, 0, _nodes(8)) is None           # CPU workers (trainer.device=cpu)
    # the replicas kept to a node of their own by a custom resource
    own = [*_nodes(8, 8), NodeGpus("retrieval", 2, {"retrieval_node": 1})]
    assert replica_gpu_error(1, {"retrieval_node": 1}, 8, own) is None
    assert "no node that can hold a retrieval replica has a GPU" in replica_gpu_error(1, {}, 0, _nodes(0, 0))


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this case is a machine without a GPU")
def test_a_local_run_asking_a_gpu_for_its_replica_on_a_machine_without_one_is_refused(indexes) -> None:
    with pytest.raises(ConfigError, match=r"num_gpus=1: no node that can hold a retrieval replica has a GPU for it "
                                          r"\(this machine \(a local Ray\) has 0 GPU\(s\)\)"):
        validate_config(compose_config(_serve(indexes["flat_ip"], "retriever.replica_resources.num_gpus=1")))


def test_a_joined_cluster_is_checked_against_its_nodes_before_the_deploy(ray_cluster, indexes) -> None:
    from verl.trainer.main_ppo import deploy_retriever

    # the session's Ray has no GPU: the replica could never be placed; nothing is deployed
    config = compose_config(_serve(indexes["flat_ip"], "retriever.replica_resources.num_gpus=1"))
    with pytest.raises(ConfigError, match=r"has 0 GPU\(s\).*No retrieval replica and no worker was started"):
        deploy_retriever(config)
