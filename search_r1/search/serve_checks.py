"""Can the Ray Serve retrieval replicas (`retriever.serve=ray`) do their job where they are placed?

Two settings that start fine and then fail a run:

- **A GPU the trainer needs.** The driver deploys the replicas before it builds the workers. A
  replica with `retriever.replica_resources.num_gpus > 0` on a node whose GPUs the workers take
  (`trainer.n_gpus_per_node` of them) holds one of those GPUs, and the workers' placement group then
  waits for a GPU that never frees. `replica_gpu_error` refuses it from the nodes' GPU counts (the
  local machine's before a local Ray starts, `ray.nodes()` once a cluster is joined).
- **Too few CPUs for an exact search.** A dense retriever over a FAISS Flat index searches on CPU
  as a blocked fp32 matmul (`retrievers.TorchFlatIP`): every query scans every vector, 2 x vectors x
  dim FLOPs (32 GFLOP for wiki-18's 21,015,324 x 768 e5 index). `replica_cpu_error` reads the index
  file's header (type, dim, vectors; FAISS's own layout, no FAISS import), prices the largest batch
  of queries a turn sends one replica with the search throughput this project measured, and refuses
  a replica whose `num_cpus` cannot answer that batch within `retriever.timeout`: every such search
  would time out, be retried, and count as failed (and the run stop at retriever.max_failure_fraction).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Flat search throughput per core, measured: one 128-query batch over a 5,000 x 384 Flat index took
# 20.4 ms on one core (docs/retriever.md "Throughput: where a batch's time goes", the profile table),
# 2 x 5,000 x 384 x 128 FLOPs in 20.4 ms = 24 GFLOP/s. A scan of a 60 GiB wiki-scale matrix also
# streams it from memory each batch, and the queries must be encoded first: a replica is slower
# than this, never faster, so the CPUs it implies are a lower bound.
FLAT_FLOPS_PER_CORE = 2 * 5_000 * 384 * 128 / 20.4e-3

# FAISS index file fourccs of the exhaustive (Flat) indexes (faiss/impl/index_write.cpp).
FLAT_FOURCCS = {b"IxFI": "IndexFlatIP", b"IxF2": "IndexFlatL2", b"IxFl": "IndexFlat"}
# fourcc, then the index header: d (int32), ntotal (int64), two int64 placeholders, is_trained (uint8)
_HEADER = struct.Struct("<4siqqq?")

# The most queries one replica searches as one batch: the clients send at most 512 a request
# (RetrievalClient.max_batch_queries) and the server coalesces at most --coalesce_max_queries (512).
MAX_BATCH_QUERIES = 512


@dataclass(frozen=True)
class FaissIndexHeader:
    """What an index file says about itself: its type (fourcc), vector dimension and count."""

    fourcc: str
    dim: int
    vectors: int

    @property
    def flat(self) -> bool:
        return self.fourcc.encode() in FLAT_FOURCCS

    @property
    def kind(self) -> str:
        return FLAT_FOURCCS.get(self.fourcc.encode(), f"FAISS index {self.fourcc!r}")


def read_faiss_header(path: str | Path) -> FaissIndexHeader | None:
    """The header of the FAISS index file at `path` (a few dozen bytes read), or None when it is not
    a readable FAISS index file (a BM25 folder, a missing file: other checks name those)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_HEADER.size)
    except OSError:
        return None
    if len(raw) < _HEADER.size:
        return None
    fourcc, dim, vectors, _, _, _ = _HEADER.unpack(raw)
    if not fourcc.isalnum() or dim < 1 or vectors < 0:
        return None
    return FaissIndexHeader(fourcc.decode("ascii"), dim, vectors)


def flat_search_seconds(vectors: int, dim: int, queries: int, cpus: float,
                        flops_per_core: float = FLAT_FLOPS_PER_CORE) -> float:
    """At least how long `cpus` cores take to search `queries` queries over a Flat index."""
    return 2.0 * vectors * dim * queries / (flops_per_core * max(cpus, 1e-9))


def flat_search_cpus(vectors: int, dim: int, queries: int, seconds: float,
                     flops_per_core: float = FLAT_FLOPS_PER_CORE) -> int:
    """The fewest cores that can search `queries` queries over a Flat index within `seconds`."""
    return max(1, math.ceil(2.0 * vectors * dim * queries / (flops_per_core * seconds)))


def replica_cpu_error(server_args: Mapping[str, Any], num_cpus: float, turn_queries: int, timeout_s: float,
                      turn_why: str) -> str | None:
    """Why a replica with `num_cpus` CPUs cannot answer a turn's searches over its dense Flat index
    within `timeout_s`, or None (BM25, FAISS on GPU, a non-Flat or unreadable index, or enough CPUs).

    `turn_queries`: the searches one turn sends one replica (`turn_why` says how that was counted);
    a batch is at most MAX_BATCH_QUERIES of them (or the server's --coalesce_max_queries)."""
    from search_r1.search.ray_serve import server_argv
    from search_r1.search.retrieval_server import parse_args

    args = parse_args(server_argv(server_args))
    if args.retriever_name == "bm25" or args.faiss_gpu:
        return None
    header = read_faiss_header(args.index_path)
    if header is None or not header.flat:
        return None
    batch = max(1, min(turn_queries, MAX_BATCH_QUERIES, int(args.coalesce_max_queries)))
    need = flat_search_cpus(header.vectors, header.dim, batch, timeout_s)
    if num_cpus >= need:
        return None
    seconds = flat_search_seconds(header.vectors, header.dim, batch, num_cpus)
    return (
        f"retriever.replica_resources.num_cpus={num_cpus:g} is too few for a dense retriever over a Flat index: "
        f"{args.index_path} is a FAISS {header.kind} of {header.vectors:,} x {header.dim} vectors, an exact search "
        f"that scans every vector for every query ({2 * header.vectors * header.dim / 1e9:.3g} GFLOP a query). A turn "
        f"sends a replica up to {batch} queries at once ({turn_why}); at the {FLAT_FLOPS_PER_CORE / 1e9:.0f} GFLOP/s "
        f"per core this project measured for Flat search on CPU (docs/retriever.md \"Throughput\") that batch takes "
        f"at least {seconds:,.0f} s on {num_cpus:g} CPU(s), beyond retriever.timeout={timeout_s:g} s: its searches "
        f"would time out and count as failed. Give each replica at least {need} CPUs "
        f"(retriever.replica_resources.num_cpus={need}), or search on GPU (+retriever.server_args.faiss_gpu=true with "
        "retriever.replica_resources.num_gpus, where a node has a GPU to spare), or serve an HNSW or IVF index "
        "(example/retriever/retrieval_launch_ann.sh), which does not scan every vector")


@dataclass(frozen=True)
class NodeGpus:
    """A node as the GPU rule sees it: a name for messages, its GPUs, and its custom resources."""

    name: str
    gpus: float
    resources: Mapping[str, float]


def nodes_from_ray(nodes: Sequence[Mapping[str, Any]]) -> list[NodeGpus]:
    """`ray.nodes()` as NodeGpus (alive nodes only)."""
    return [NodeGpus(f"{n.get('NodeManagerAddress', '?')} [node {str(n['NodeID'])[:8]}]",
                     float(n.get("Resources", {}).get("GPU", 0.0)), dict(n.get("Resources", {})))
            for n in nodes if n.get("Alive", True)]


def replica_gpu_error(replica_gpus: float, custom: Mapping[str, float], worker_gpus_per_node: float,
                      nodes: Sequence[NodeGpus]) -> str | None:
    """Why replicas asking for `replica_gpus` GPUs each cannot be placed without taking a GPU the
    trainer's workers (`worker_gpus_per_node` on each node they use) need, or None.

    A replica may land on any node with its `custom` resources; a node that can hold a set of workers
    (at least `worker_gpus_per_node` GPUs) must have `replica_gpus` more for it."""
    if replica_gpus <= 0:
        return None
    hosts = [n for n in nodes if all(n.resources.get(k, 0.0) >= v for k, v in custom.items())]
    fix = ("Set retriever.replica_resources.num_gpus=0 (the replicas search on CPU: give them "
           "retriever.replica_resources.num_cpus), leave GPUs free on each node with a lower trainer.n_gpus_per_node, "
           "or keep the replicas to nodes of their own with a custom Ray resource only those nodes offer "
           "(retriever.replica_resources.resources)")
    if not any(n.gpus >= replica_gpus for n in hosts):
        seen = "; ".join(f"{n.name} has {n.gpus:g} GPU(s)" for n in nodes) or "no node"
        return (f"retriever.replica_resources.num_gpus={replica_gpus:g}: no node that can hold a retrieval replica "
                f"has a GPU for it ({seen}), so the replicas would never start. {fix}.")
    if worker_gpus_per_node <= 0:
        return None
    full = [n for n in hosts if n.gpus >= worker_gpus_per_node and n.gpus - worker_gpus_per_node < replica_gpus]
    if not full:
        return None
    listed = "; ".join(f"{n.name} has {n.gpus:g}" for n in full)
    return (f"retriever.replica_resources.num_gpus={replica_gpus:g} asks each Ray Serve retrieval replica for a GPU, "
            f"but the trainer's workers take trainer.n_gpus_per_node={worker_gpus_per_node:g} GPU(s) of every node they "
            f"run on, and a node a replica may land on has no GPU beyond those ({listed}). The replicas are deployed "
            "before the workers: a replica there would hold a GPU a worker needs, and the workers would wait for it "
            f"forever. {fix}.")
