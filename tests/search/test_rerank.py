"""Reranking: per-query ranking, the /rerank server, and retrieve-then-rerank over a real BM25 server."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
import requests
import torch
from fastapi import FastAPI

from search_r1.search.client import RetrievalClient
from search_r1.search.rerank_server import (
    BiEncoderScorer,
    CrossEncoderScorer,
    Reranker,
    create_rerank_app,
    load_scorer,
)
from search_r1.search.retrieve_rerank_server import create_retrieve_rerank_app
from search_r1.search.schema import Hit, ServerLimits
from tests.conftest import free_port

torch.set_num_threads(1)

Serve = Callable[[FastAPI], AbstractContextManager[str]]


class WordOverlapScorer:
    """Deterministic scorer: number of distinct query words found in the passage."""

    def score_pairs(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        return [
            float(len(set(q.lower().split()) & set(p.lower().replace(".", " ").split()))) for q, p in pairs
        ]


def hit(doc_id: str, title: str, text: str, score: float = 0.0) -> Hit:
    return Hit.from_contents(doc_id, f'"{title}"\n{text}', score)


FRANCE_Q = "paris france capital"
JAPAN_Q = "tokyo japan capital"
FRANCE_HITS = [
    hit("lyon", "Lyon", "a city in france"),
    hit("paris", "Paris", "paris is the capital of france"),
]
# "decoy" matches the France query perfectly but was retrieved for the Japan query.
JAPAN_HITS = [
    hit("kyoto", "Kyoto", "old capital of japan"),
    hit("decoy", "Paris", "paris france capital"),
    hit("tokyo", "Tokyo", "tokyo is the capital of japan"),
]


def test_each_query_is_ranked_only_against_its_own_candidates() -> None:
    reranked = Reranker(WordOverlapScorer()).rerank([FRANCE_Q, JAPAN_Q], [FRANCE_HITS, JAPAN_HITS], topk=2)
    assert [h.doc_id for h in reranked[0]] == ["paris", "lyon"]
    assert [h.doc_id for h in reranked[1]] == ["tokyo", "kyoto"]
    assert [h.score for h in reranked[1]] == [3.0, 2.0]
    assert reranked[0][0].title == "Paris" and reranked[0][0].text == "paris is the capital of france"


def test_rerank_endpoint_answers_per_query_in_both_wire_shapes(serve: Serve) -> None:
    app = create_rerank_app(Reranker(WordOverlapScorer()), default_topk=1)
    documents = [[h.to_wire(True) for h in FRANCE_HITS], [h.to_wire(False) for h in JAPAN_HITS]]
    with serve(app) as base:
        scored = requests.post(
            base + "/rerank",
            json={"queries": [FRANCE_Q, JAPAN_Q], "documents": documents, "return_scores": True},
        )
        bare = requests.post(
            base + "/rerank", json={"queries": [FRANCE_Q, JAPAN_Q], "documents": documents, "rerank_topk": 3}
        )
    assert scored.status_code == 200, scored.text
    assert scored.json()["result"] == [
        [{"document": {"id": "paris", "contents": '"Paris"\nparis is the capital of france'}, "score": 3.0}],
        [{"document": {"id": "tokyo", "contents": '"Tokyo"\ntokyo is the capital of japan'}, "score": 3.0}],
    ]
    assert [[d["id"] for d in row] for row in bare.json()["result"]] == [
        ["paris", "lyon"],
        ["tokyo", "kyoto", "decoy"],
    ]


def test_rerank_endpoint_refuses_bad_input_with_a_message(serve: Serve) -> None:
    app = create_rerank_app(
        Reranker(WordOverlapScorer()), limits=ServerLimits(max_topk=5, max_body_bytes=4096)
    )
    docs = [[h.to_wire(True) for h in FRANCE_HITS]]
    with serve(app) as base:
        mismatched = requests.post(base + "/rerank", json={"queries": ["a", "b"], "documents": docs})
        bad_hit = requests.post(
            base + "/rerank", json={"queries": ["a"], "documents": [[docs[0][0], {"id": "x"}]]}
        )
        big_topk = requests.post(
            base + "/rerank", json={"queries": ["a"], "documents": docs, "rerank_topk": 6}
        )
        not_str = requests.post(base + "/rerank", json={"queries": [7], "documents": docs})
        too_big = requests.post(base + "/rerank", json={"queries": ["a" * 5000], "documents": docs})
        alive = requests.get(base + "/health")
    assert mismatched.status_code == 422 and "'documents' has 1 candidate lists for 2" in mismatched.text
    assert bad_hit.status_code == 422 and "documents[0][1]" in bad_hit.text
    assert big_topk.status_code == 422 and "topk" in big_topk.text
    assert not_str.status_code == 422 and "queries[0]" in not_str.text
    assert too_big.status_code == 413
    assert alive.status_code == 200


@pytest.fixture(scope="module")
def minilm_scorer(minilm_path: str) -> BiEncoderScorer:
    return BiEncoderScorer(minilm_path, batch_size=16, device="cpu")


def test_minilm_reranks_each_query_by_meaning(minilm_scorer: BiEncoderScorer) -> None:
    q_bio = "How do plants turn sunlight into energy?"
    q_space = "Who was the first person to walk on the moon?"
    bio = [
        hit("b1", "Volcano", "Lava flows from an erupting volcano."),
        hit("b2", "Photosynthesis", "Plants use light to make sugar from carbon dioxide and water."),
    ]
    space = [
        hit("s1", "Cooking", "Bake the bread for forty minutes."),
        hit(
            "s2", "Chlorophyll", "Leaves capture sunlight to produce energy for the plant."
        ),  # relevant to q_bio
        hit("s3", "Apollo 11", "Neil Armstrong stepped onto the lunar surface in 1969."),
    ]
    reranked = Reranker(minilm_scorer).rerank([q_bio, q_space], [bio, space], topk=2)
    assert [h.doc_id for h in reranked[0]] == ["b2", "b1"]
    assert reranked[1][0].doc_id == "s3"
    assert {h.doc_id for h in reranked[1]} <= {"s1", "s2", "s3"}
    assert reranked[0][0].score > reranked[0][1].score


def test_cross_encoder_scores_a_pair_the_same_alone_or_in_a_padded_batch(
    tmp_path: Path, minilm_path: str
) -> None:
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        num_labels=1,
    )
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)

    pairs = [
        ("short query", "tiny"),
        ("a much longer query about many things", "a passage " * 20),
        ("q", "p"),
    ]
    batched = load_scorer("cross_encoder", str(tmp_path), batch_size=8, max_length=64, device="cpu")
    single = CrossEncoderScorer(str(tmp_path), batch_size=1, max_length=64, device="cpu")
    assert isinstance(batched, CrossEncoderScorer)
    together, alone = batched.score_pairs(pairs), single.score_pairs(pairs)
    assert len(together) == 3 and len(set(together)) == 3
    # Scores (|s| < 1 for this random 2-layer encoder) batched with padding vs alone differ only by
    # fp32 GEMM blocking, ~1e-6 on any CPU; 1e-4 is loose, yet far below a pad token leaking in.
    assert together == pytest.approx(alone, abs=1e-4)
    reranked = Reranker(batched).rerank(["q1", "q2"], [FRANCE_HITS, JAPAN_HITS], topk=5)
    assert {h.doc_id for h in reranked[0]} == {"lyon", "paris"}
    assert {h.doc_id for h in reranked[1]} == {"kyoto", "decoy", "tokyo"}


def test_unknown_scorer_type_is_refused() -> None:
    with pytest.raises(ValueError, match="--reranker_type"):
        load_scorer("colbert", "unused")


CORPUS = [
    ("0", "Capital gains tax", "In France the capital gains tax applies to capital gains from France."),
    ("1", "Paris", "Paris is the largest city of France and the seat of its government."),
    ("2", "Lyon", "Lyon is a city in France known for its food."),
    ("3", "Tokyo", "Tokyo is the seat of the Japanese government and the largest city of Japan."),
    ("4", "Osaka", "Osaka is a port city in Japan."),
    ("5", "Bread", "Bread is baked from flour, water and yeast."),
]


@pytest.fixture
def bm25_upstream(tmp_path_factory: pytest.TempPathFactory, serve: Serve) -> Iterator[str]:
    """The real retrieval server (BM25) over a six-passage corpus, served on a free port."""
    from search_r1.search.corpus import Corpus
    from search_r1.search.index_builder import build_bm25_index
    from search_r1.search.retrieval_server import ServerConfig, create_app
    from search_r1.search.retrievers import BM25Retriever

    root = tmp_path_factory.mktemp("bm25")
    corpus_path = root / "corpus.jsonl"
    corpus_path.write_text(
        "".join(json.dumps({"id": i, "contents": f'"{t}"\n{body}'}) + "\n" for i, t, body in CORPUS)
    )
    corpus = Corpus.open(corpus_path, cache_dir=root)
    retriever = BM25Retriever(str(build_bm25_index(corpus, root)), corpus)
    with serve(create_app(retriever, ServerConfig(default_topk=2))) as base:
        yield base + "/retrieve"


def test_retrieve_then_rerank_reorders_bm25_candidates_end_to_end(
    bm25_upstream: str, minilm_scorer: BiEncoderScorer, serve: Serve
) -> None:
    queries = ["What is the capital of France?", "What is the capital city of Japan?"]
    candidates = RetrievalClient(bm25_upstream).retrieve(queries, topk=4)
    # BM25 puts the lexical decoy first for the France query; the reranker must fix that.
    assert candidates[0][0].doc_id == "0"
    assert "1" in {h.doc_id for h in candidates[0]} and "3" in {h.doc_id for h in candidates[1]}

    app = create_retrieve_rerank_app(
        RetrievalClient(bm25_upstream), Reranker(minilm_scorer), retrieval_topk=4, default_topk=2
    )
    with serve(app) as base:
        client = RetrievalClient(base + "/retrieve", topk=2)
        reranked = client.retrieve(queries)
        bare = requests.post(base + "/retrieve", json={"queries": queries[:1], "topk": 1}).json()
        refused = requests.post(base + "/retrieve", json={"queries": []})
        health = requests.get(base + "/health")

    assert [len(row) for row in reranked] == [2, 2]
    assert reranked[0][0].doc_id == "1" and reranked[1][0].doc_id == "3"
    for row, cands in zip(reranked, candidates, strict=True):
        assert {h.doc_id for h in row} <= {h.doc_id for h in cands}
        assert row[0].score >= row[1].score
    assert bare == {"result": [[{"id": "1", "contents": '"Paris"\n' + CORPUS[1][2]}]]}
    assert refused.status_code == 422 and "queries" in refused.text
    assert health.status_code == 200 and health.json()["upstream"] == bm25_upstream


def test_retrieve_then_rerank_answers_502_when_upstream_is_down(serve: Serve) -> None:
    dead = RetrievalClient(f"http://127.0.0.1:{free_port()}/retrieve", max_retries=0, timeout=2.0)
    app = create_retrieve_rerank_app(dead, Reranker(WordOverlapScorer()), retrieval_topk=3)
    with serve(app) as base:
        answer = requests.post(base + "/retrieve", json={"queries": ["q"]})
        health = requests.get(base + "/health")
    assert answer.status_code == 502 and "upstream retrieval" in answer.json()["detail"]
    assert health.status_code == 503


def test_original_search_r1_reranker_flags_are_accepted() -> None:
    from search_r1.search.retrieve_rerank_server import parse_args

    args = parse_args(
        [
            "--retrieval_topk",
            "20",
            "--reranking_topk",
            "3",
            "--reranker_model",
            "/models/ce",
            "--reranker_batch_size",
            "64",
            "--reranker_type",
            "sentence_transformer",
            "--host",
            "0.0.0.0",
            "--port",
            "2223",
            "--upstream_url",
            "http://10.0.0.5:8001/retrieve",
        ]
    )
    assert (args.retrieval_topk, args.reranking_topk, args.reranker_batch_size, args.port) == (
        20,
        3,
        64,
        2223,
    )
    assert args.reranker_model == "/models/ce" and args.host == "0.0.0.0"
    assert parse_args([]).host == "127.0.0.1"
