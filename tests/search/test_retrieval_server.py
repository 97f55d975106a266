"""The retrieval server over real HTTP (uvicorn on a free 127.0.0.1 port)."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest
import requests

from search_r1.search.retrieval_server import ServerConfig, create_app, parse_args
from search_r1.search.schema import ServerLimits
from search_r1.search.serving import serve_in_background
from tests.search.conftest import DISTINCT_TITLES, read_rows

LIMITS = ServerLimits(max_queries_per_request=8, max_query_chars=200, max_topk=10, max_body_bytes=4096)


@pytest.fixture(scope="module", params=["bm25_retriever", "dense_retriever"])
def server_url(request):
    """One server per retriever kind for the module's tests."""
    retriever = request.getfixturevalue(request.param)
    with serve_in_background(create_app(retriever, ServerConfig(default_topk=3, limits=LIMITS))) as url:
        yield url


def post(url: str, payload) -> requests.Response:
    return requests.post(f"{url}/retrieve", json=payload, timeout=60)


def test_title_query_returns_that_passage_first_with_scores(server_url: str, tiny_corpus_path: str) -> None:
    rows = read_rows(tiny_corpus_path)
    titles = list(DISTINCT_TITLES)
    resp = post(server_url, {"queries": titles, "topk": 4, "return_scores": True})
    assert resp.status_code == 200
    result = resp.json()["result"]
    assert len(result) == len(titles)
    for title, hits in zip(titles, result, strict=True):
        assert len(hits) == 4
        best = hits[0]
        assert set(best) == {"document", "score"}
        assert best["document"] == {"id": DISTINCT_TITLES[title], "contents": rows[int(DISTINCT_TITLES[title])]["contents"]}
        assert best["document"]["contents"].startswith(f'"{title}"\n')
        scores = [h["score"] for h in hits]
        assert all(isinstance(s, float) for s in scores) and scores == sorted(scores, reverse=True)


def test_without_scores_a_hit_is_the_document_itself(server_url: str) -> None:
    result = post(server_url, {"queries": ["Glacier"], "topk": 2})
    assert result.status_code == 200
    hits = result.json()["result"][0]
    assert len(hits) == 2 and all(set(h) == {"id", "contents"} for h in hits)
    assert hits[0]["id"] == DISTINCT_TITLES["Glacier"]


def test_topk_defaults_to_server_setting_and_is_respected(server_url: str) -> None:
    assert [len(h) for h in post(server_url, {"queries": ["Telescope", "Honeybee"]}).json()["result"]] == [3, 3]
    for k in (1, 7, 10):
        assert len(post(server_url, {"queries": ["Telescope"], "topk": k}).json()["result"][0]) == k


@pytest.mark.parametrize(
    ("payload", "status", "message"),
    [
        ({"queries": []}, 422, "non-empty list"),
        ({"queries": ["ok", 3]}, 422, r"queries\[1\] must be a string"),
        ({"queries": "Glacier"}, 422, "queries"),
        ({"topk": 2}, 422, "queries"),
        ({"queries": ["Glacier"], "topk": 0}, 422, "topk"),
        ({"queries": ["Glacier"], "topk": 11}, 422, "cap is 10"),
        ({"queries": ["Glacier"], "topk": "many"}, 422, "topk"),
        ({"queries": ["q"] * 9}, 413, "at most 8"),
        ({"queries": ["q" * 150] * 8, "pad": "x" * 5000}, 413, "4096 bytes"),
        ([["not", "an", "object"]], 422, "body"),
    ],
)
def test_bad_input_answers_4xx_with_message_and_server_keeps_serving(
    server_url: str, payload, status: int, message: str
) -> None:
    resp = post(server_url, payload)
    assert resp.status_code == status, resp.text
    assert re.search(message, resp.json()["detail"]), resp.json()
    assert post(server_url, {"queries": ["Lighthouse"], "topk": 1}).json()["result"][0][0]["id"] == "8"


def test_an_over_long_query_is_truncated_and_the_rest_of_its_batch_answered(server_url: str) -> None:
    """One query over --max_query_chars (200 here) no longer makes the whole request a 413: it is
    cut to its first 200 characters and every query of the batch gets its hits."""
    long_query = "Lighthouse keeper on a rocky coast " * 30   # 1050 characters
    queries = ["Glacier", long_query, "Telescope"]
    resp = post(server_url, {"queries": queries, "topk": 3, "return_scores": True})
    assert resp.status_code == 200, resp.text
    result = resp.json()["result"]
    assert len(result) == 3 and all(len(hits) == 3 for hits in result)
    alone = [post(server_url, {"queries": [q], "topk": 3, "return_scores": True}).json()["result"][0]
             for q in ("Glacier", long_query[:200], "Telescope")]
    for got, expected in zip(result, alone, strict=True):
        assert [h["document"]["id"] for h in got] == [h["document"]["id"] for h in expected]
        assert [h["score"] for h in got] == pytest.approx([h["score"] for h in expected], abs=1e-5)
    assert result[1][0]["document"]["id"] == DISTINCT_TITLES["Lighthouse"]
    health = requests.get(f"{server_url}/health", timeout=30).json()
    assert health["counters"]["truncated_queries"] >= 1
    # The request as a whole is still bounded.
    assert post(server_url, {"queries": [long_query] * 4 + ["x" * 4096]}).status_code == 413


def test_dense_server_truncates_a_long_query_at_the_encoders_token_limit(dense_retriever) -> None:
    """Dense: as the original encoder (max_length, truncation=True), only the first max_length
    tokens count; the tail of a query past them changes nothing. Default limits (2048 chars)."""
    tokenizer, max_length = dense_retriever.encoder.tokenizer, dense_retriever.encoder.max_length
    head = "telescope lens and mirror " * 40                # > max_length (128) tokens
    long_query = head + "honeybee colony and hive " * 200    # > 2048 characters: refused before
    kept_ids = tokenizer(long_query, max_length=max_length, truncation=True, add_special_tokens=True)["input_ids"]
    assert len(tokenizer(long_query, verbose=False)["input_ids"]) > max_length == len(kept_ids)
    token_prefix = tokenizer.decode(kept_ids, skip_special_tokens=True)   # uncased model: same ids
    with serve_in_background(create_app(dense_retriever, ServerConfig(cache_size=0))) as url:
        resp = post(url, {"queries": ["Glacier", long_query], "topk": 3, "return_scores": True})
        assert resp.status_code == 200, resp.text
        got = resp.json()["result"][1]
        expected = post(url, {"queries": [token_prefix], "topk": 3, "return_scores": True}).json()["result"][0]
    assert got[0]["document"]["id"] == DISTINCT_TITLES["Telescope"]
    assert [h["document"]["id"] for h in got] == [h["document"]["id"] for h in expected]
    assert [h["score"] for h in got] == pytest.approx([h["score"] for h in expected], abs=1e-4)


def test_malformed_json_body_answers_400(server_url: str) -> None:
    resp = requests.post(f"{server_url}/retrieve", data=b'{"queries": [', timeout=30)
    assert resp.status_code == 400 and "not valid JSON" in resp.json()["detail"]
    assert requests.get(f"{server_url}/health", timeout=30).status_code == 200


def test_health_reports_kind_size_and_counters(server_url: str) -> None:
    assert post(server_url, {"queries": []}).status_code == 422
    health = requests.get(f"{server_url}/health", timeout=30).json()
    assert health["status"] == "ok"
    assert health["retriever"] in {"bm25", "dense"}
    assert health["corpus_size"] == 60
    assert health["counters"]["rejected"] >= 1
    assert health["limits"]["max_topk"] == 10


async def _fire(url: str, payloads: list[dict]) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=len(payloads), max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        return await asyncio.gather(*(client.post(f"{url}/retrieve", json=p) for p in payloads))


def _concurrent_payloads(tiny_corpus_path: str, n: int) -> tuple[list[dict], list[list[str]]]:
    """Each request asks for 1-3 passages by their exact contents, with its own topk."""
    rows = read_rows(tiny_corpus_path)
    payloads, expected = [], []
    for i in range(n):
        picked = [rows[(i * 7 + j * 13) % len(rows)] for j in range(1 + i % 3)]
        payloads.append({"queries": [r["contents"] for r in picked], "topk": 1 + i % 4, "return_scores": i % 2 == 0})
        expected.append([r["id"] for r in picked])
    return payloads, expected


@pytest.mark.parametrize("coalesce", [True, False])
def test_200_concurrent_requests_each_get_their_own_results_in_order(
    bm25_retriever, tiny_corpus_path: str, coalesce: bool
) -> None:
    payloads, expected = _concurrent_payloads(tiny_corpus_path, 200)
    config = ServerConfig(coalesce=coalesce, cache_size=0, max_wait_ms=20.0)
    app = create_app(bm25_retriever, config)
    with serve_in_background(app) as url:
        responses = asyncio.run(_fire(url, payloads))
        health = requests.get(f"{url}/health", timeout=30).json()
    for payload, want, resp in zip(payloads, expected, responses, strict=True):
        assert resp.status_code == 200, resp.text
        result = resp.json()["result"]
        assert len(result) == len(want)
        for hits, want_id in zip(result, want, strict=True):
            assert len(hits) == payload["topk"]
            first = hits[0]["document"] if payload["return_scores"] else hits[0]
            assert first["id"] == want_id
    counters = health["counters"]
    assert counters["requests"] == 200
    if coalesce:
        # Batching happened: far fewer searches than requests.
        assert counters["searches"] < 100 and counters["largest_batch"] > 1
    else:
        assert counters["searches"] == 200


class _FailsOnBoom:
    """Wraps a real retriever; raises for the query 'boom' (error injection)."""

    kind = "bm25"

    def __init__(self, inner) -> None:
        self.inner = inner
        self.corpus = inner.corpus

    def search_batch(self, queries: list[str], topk: int):
        if "boom" in queries:
            raise RuntimeError("injected failure")
        return self.inner.search_batch(queries, topk)


def test_failing_search_fails_only_its_own_request(bm25_retriever) -> None:
    payloads = [{"queries": ["Glacier"], "topk": 1}] * 20 + [{"queries": ["boom"]}] + [{"queries": ["Moon"], "topk": 1}] * 20
    app = create_app(_FailsOnBoom(bm25_retriever), ServerConfig(cache_size=0, max_wait_ms=50.0))
    with serve_in_background(app) as url:
        responses = asyncio.run(_fire(url, payloads))
        after = post(url, {"queries": ["Lighthouse"], "topk": 1})
        counters = requests.get(f"{url}/health", timeout=30).json()["counters"]
    statuses = [r.status_code for r in responses]
    assert statuses[20] == 500 and "injected failure" in responses[20].json()["detail"]
    assert statuses[:20] + statuses[21:] == [200] * 40
    assert [r.json()["result"][0][0]["id"] for r in responses[:20]] == [DISTINCT_TITLES["Glacier"]] * 20
    assert after.status_code == 200 and after.json()["result"][0][0]["id"] == DISTINCT_TITLES["Lighthouse"]
    assert counters["errors"] == 1


def test_repeated_queries_are_answered_from_the_cache(bm25_retriever) -> None:
    with serve_in_background(create_app(bm25_retriever, ServerConfig(cache_size=100))) as url:
        first = post(url, {"queries": ["Glacier", "Moon"], "topk": 2}).json()
        second = post(url, {"queries": ["Moon", "Glacier"], "topk": 2}).json()
        counters = requests.get(f"{url}/health", timeout=30).json()["counters"]
    assert second["result"] == first["result"][::-1]
    assert counters["cache_hits"] == 2 and counters["searches"] == 1


def test_cli_defaults_match_the_original_and_bind_localhost() -> None:
    args = parse_args([])
    assert (args.host, args.port, args.topk, args.retriever_name) == ("127.0.0.1", 8000, 3, "e5")
    args = parse_args(["--index_path", "i", "--corpus_path", "c", "--retriever_name", "bm25", "--faiss_gpu", "--no_coalesce"])
    assert args.faiss_gpu and args.no_coalesce and args.index_path == "i"


def test_coalesced_single_query_requests_get_the_hits_of_one_batch_request(dense_retriever) -> None:
    """Distinct queries sent one per request (coalesced into batches of other sizes and
    length groups) get the same passages, in the same order, as when sent in one request."""
    queries = [f"{word} number {i}" for i, word in enumerate(["glacier", "honeybee", "lighthouse on the coast",
               "the moon", "a telescope and the stars", "bread and yeast", "volcano ash", "chess"] * 3)]
    config = ServerConfig(cache_size=0, max_wait_ms=20.0, limits=ServerLimits(max_queries_per_request=64))
    with serve_in_background(create_app(dense_retriever, config)) as url:
        together = post(url, {"queries": queries, "topk": 4, "return_scores": True}).json()["result"]
        alone = asyncio.run(_fire(url, [{"queries": [q], "topk": 4, "return_scores": True} for q in queries]))
        counters = requests.get(f"{url}/health", timeout=30).json()["counters"]
    # Really coalesced (fewer searches than the 25 requests) and really searched (no cache).
    assert counters["searches"] < counters["requests"] == 25 and counters["cache_hits"] == 0
    for want, resp in zip(together, alone, strict=True):
        got = resp.json()["result"][0]
        assert [h["document"]["id"] for h in got] == [h["document"]["id"] for h in want]
        assert [h["score"] for h in got] == pytest.approx([h["score"] for h in want], abs=1e-5)


def test_server_process_makes_idle_openmp_threads_passive_unless_told_otherwise() -> None:
    import os
    import subprocess
    import sys

    probe = ("import os, search_r1.search.retrieval_server, torch; "
             "print(os.environ.get('OMP_WAIT_POLICY'))")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "PASSIVE"
    out = subprocess.run([sys.executable, "-c", probe], env={**env, "OMP_WAIT_POLICY": "ACTIVE"},
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ACTIVE"
