"""One request path for every search server: the same 4xx, limits enforced on bytes read."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence

import pytest
import requests
from fastapi import FastAPI

from search_r1.search.client import RetrievalClient
from search_r1.search.online_search_server import (
    OnlineSearchConfig,
    OnlineSearchService,
    create_online_search_app,
    load_engine,
)
from search_r1.search.rerank_server import Reranker, create_rerank_app
from search_r1.search.retrieval_server import ServerConfig, create_app
from search_r1.search.retrieve_rerank_server import create_retrieve_rerank_app
from search_r1.search.schema import ServerLimits
from search_r1.search.serving import serve_in_background
from tests.conftest import free_port

LIMIT = 4096
LIMITS = ServerLimits(max_body_bytes=LIMIT)
APPS = ["retrieval", "rerank", "retrieve_rerank", "online"]


class ConstantScorer:
    def score_pairs(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        return [0.0] * len(pairs)


@pytest.fixture(params=APPS)
def endpoint(request: pytest.FixtureRequest) -> Iterator[str]:
    """The URL of one search app's POST endpoint, served with a 4096-byte body limit.

    No upstream is reachable: every request these tests send must be refused before one is needed.
    """
    dead = f"http://127.0.0.1:{free_port()}"
    closers: list[Callable[[], None]] = []
    path = "/retrieve"
    app: FastAPI
    if request.param == "retrieval":
        app = create_app(request.getfixturevalue("bm25_retriever"), ServerConfig(limits=LIMITS))
    elif request.param == "rerank":
        app, path = create_rerank_app(Reranker(ConstantScorer()), limits=LIMITS), "/rerank"
    elif request.param == "retrieve_rerank":
        upstream = RetrievalClient(dead + "/retrieve", max_retries=0, timeout=2.0)
        app = create_retrieve_rerank_app(upstream, Reranker(ConstantScorer()), limits=LIMITS)
    else:
        config = OnlineSearchConfig(engine="brave", base_url=dead, max_body_bytes=LIMIT)
        service = OnlineSearchService(load_engine(config, environ={"BRAVE_API_KEY": "unused"}), config)
        closers.append(service.close)
        app = create_online_search_app(service)
    try:
        with serve_in_background(app) as base:
            yield base + path
    finally:
        for close in closers:
            close()


def chunked(payload: bytes, chunk_size: int = 1024) -> Iterator[bytes]:
    """A generator body: requests sends it with Transfer-Encoding: chunked and no Content-Length."""
    for start in range(0, len(payload), chunk_size):
        yield payload[start : start + chunk_size]


def test_chunked_oversized_body_is_refused_with_413(endpoint: str) -> None:
    payload = json.dumps({"queries": ["q"], "documents": [[]], "pad": "x" * (2 * LIMIT)}).encode()
    resp = requests.post(endpoint, data=chunked(payload), headers={"Content-Type": "application/json"}, timeout=30)
    assert resp.request.headers.get("Transfer-Encoding") == "chunked"
    assert "Content-Length" not in resp.request.headers
    assert resp.status_code == 413, resp.text
    assert resp.json() == {"detail": f"request body exceeds this server's limit of {LIMIT} bytes"}


def test_chunked_body_within_the_limit_is_read_and_validated(endpoint: str) -> None:
    payload = json.dumps({"queries": [], "documents": [], "pad": "x" * (LIMIT // 2)}).encode()
    resp = requests.post(endpoint, data=chunked(payload, 256), timeout=30)
    assert resp.status_code == 422, resp.text
    assert resp.json() == {"detail": "field 'queries' must be a non-empty list of strings"}


def test_declared_oversized_body_is_refused_with_the_same_message(endpoint: str) -> None:
    resp = requests.post(endpoint, json={"queries": ["q"], "documents": [[]], "pad": "x" * LIMIT}, timeout=30)
    assert resp.status_code == 413, resp.text
    assert resp.json() == {"detail": f"request body exceeds this server's limit of {LIMIT} bytes"}


def test_malformed_json_answers_400_and_a_wrong_shape_422(endpoint: str) -> None:
    broken = requests.post(endpoint, data=b'{"queries": [', timeout=30)
    not_object = requests.post(endpoint, json=["not", "an", "object"], timeout=30)
    missing = requests.post(endpoint, json={"topk": 2, "documents": []}, timeout=30)
    assert broken.status_code == 400
    assert broken.json()["detail"].startswith("request body is not valid JSON: ")
    assert not_object.status_code == 422
    assert not_object.json()["detail"].startswith("invalid request: field 'body': Input should be a valid dictionary")
    assert missing.status_code == 422
    assert missing.json() == {"detail": "invalid request: field 'queries': Field required"}


def test_background_server_stops_listening_when_the_block_ends() -> None:
    app = FastAPI()

    @app.get("/ping")
    def ping() -> dict[str, str]:
        return {"pong": "yes"}

    port = free_port()
    with serve_in_background(app, port=port) as base:
        assert base == f"http://127.0.0.1:{port}"
        assert requests.get(base + "/ping", timeout=10).json() == {"pong": "yes"}
    with pytest.raises(requests.ConnectionError):
        requests.get(base + "/ping", timeout=5)
