"""Retrieve-then-rerank behind the ordinary /retrieve API (a "hierarchical" retriever).

For each request it asks an upstream /retrieve server (BM25, dense, or anything that
speaks DESIGN §3.1) for ``max(retrieval_topk, topk)`` candidates per query, reranks
each query's own candidates with a cross-encoder, and answers the best ``topk``.
Trainers point ``retriever.url`` at this server exactly as at a plain retrieval server.

Run (after starting an upstream retrieval server on port 8001):

    python -m search_r1.search.retrieve_rerank_server \\
        --upstream_url http://127.0.0.1:8001/retrieve --retrieval_topk 20 \\
        --reranking_topk 3 --reranker_model cross-encoder/ms-marco-MiniLM-L12-v2 --port 8000

Departure from the original Search-R1: the original loaded the index in the same
process; here the first stage is an HTTP call, so one retrieval server (with its large
index in memory) can feed several rerankers, and either side restarts on its own.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from search_r1.search.client import RetrievalClient, RetrievalError
from search_r1.search.rerank_server import Reranker, add_reranker_args, reranker_from_args
from search_r1.search.schema import RetrieveRequest, ServerLimits, ValidRequest, validate_request
from search_r1.search.serving import configure_logging, install_request_errors, read_json_body


def create_retrieve_rerank_app(
    upstream: RetrievalClient,
    reranker: Reranker,
    retrieval_topk: int = 10,
    default_topk: int = 3,
    limits: ServerLimits | None = None,
) -> FastAPI:
    """FastAPI app answering POST /retrieve by upstream retrieval + reranking, and GET /health."""
    if retrieval_topk < 1:
        raise ValueError(f"retrieval_topk must be >= 1, got {retrieval_topk}")
    limits = limits or ServerLimits()
    app = FastAPI(title="Search-R1 retrieve-then-rerank")
    install_request_errors(app)

    def retrieve_and_rerank(valid: ValidRequest) -> Any:
        # Fewer candidates than asked-for hits would make reranking a no-op cut.
        n_candidates = max(retrieval_topk, valid.topk)
        try:
            candidates = upstream.retrieve(valid.queries, topk=n_candidates, return_scores=True)
        except RetrievalError as exc:
            return JSONResponse(
                {"detail": f"upstream retrieval at {exc.url} failed: {exc.message}"}, status_code=502
            )
        reranked = reranker.rerank(valid.queries, candidates, valid.topk)
        return {"result": [[h.to_wire(valid.return_scores) for h in row] for row in reranked]}

    @app.post("/retrieve")
    async def retrieve(request: Request) -> Any:
        body = await read_json_body(request, RetrieveRequest, limits.max_body_bytes)
        valid = validate_request(body, limits, default_topk)
        # The upstream call and the model both block; run them off the event loop.
        return await run_in_threadpool(retrieve_and_rerank, valid)

    @app.get("/health")
    def health() -> Any:
        if not upstream.health():
            return JSONResponse({"status": "upstream unavailable", "upstream": upstream.url}, status_code=503)
        return {"status": "ok", "upstream": upstream.url}

    return app


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--upstream_url", default="http://127.0.0.1:8001/retrieve", help="First-stage /retrieve URL."
    )
    parser.add_argument(
        "--retrieval_topk", type=int, default=10, help="Candidates fetched per query before reranking."
    )
    parser.add_argument(
        "--upstream_timeout", type=float, default=30.0, help="Seconds to wait for the upstream."
    )
    parser.add_argument(
        "--max_topk", type=int, default=ServerLimits.max_topk, help="Largest topk a request may ask."
    )
    add_reranker_args(parser)
    parser.add_argument("--port", type=int, default=8000)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    import uvicorn

    configure_logging()
    args = parse_args(argv)
    upstream = RetrievalClient(args.upstream_url, topk=args.retrieval_topk, timeout=args.upstream_timeout)
    app = create_retrieve_rerank_app(
        upstream,
        reranker_from_args(args),
        retrieval_topk=args.retrieval_topk,
        default_topk=args.reranking_topk,
        limits=ServerLimits(max_topk=args.max_topk),
    )
    uvicorn.run(app, host=args.host, port=args.port)


if __name__ == "__main__":
    main()
