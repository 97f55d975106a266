"""Online search server against a local fake of each search API: mapping, concurrency, 502s, key hygiene."""

from __future__ import annotations

import contextlib
import logging
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import pytest
import requests
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from search_r1.search.online_search_server import (
    OnlineSearchConfig,
    OnlineSearchService,
    Secret,
    create_online_search_app,
    load_engine,
    read_secret,
)
from tests.conftest import free_port

KEYS = {
    "SERP_API_KEY": "serp-SECRET-key/+=9",  # characters that URL-encoding changes
    "GOOGLE_API_KEY": "google-SECRET-key-42",
    "GOOGLE_CSE_ID": "cse-id-7",
    "BRAVE_API_KEY": "brave-SECRET-key-13",
}
Serve = Callable[[FastAPI], AbstractContextManager[str]]
SECRET_VALUES = [KEYS["SERP_API_KEY"], KEYS["GOOGLE_API_KEY"], KEYS["BRAVE_API_KEY"]]


@dataclass
class FakeApi:
    """Scripted upstream shared by the three engines' routes."""

    status: int = 200
    delay_s: float = 0.0
    seen: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def results_for(q: str, n: int) -> list[tuple[str, str, str]]:
    return [
        (f"https://example.org/{q.replace(' ', '_')}/{i}", f"{q} title {i}", f"{q} snippet {i}")
        for i in range(n)
    ]


def make_fake_api(api: FakeApi) -> FastAPI:
    app = FastAPI()

    def answer(request: Request, body_of: Any) -> Any:
        with api.lock:
            api.seen.append({"params": dict(request.query_params), "headers": dict(request.headers)})
            api.in_flight += 1
            api.max_in_flight = max(api.max_in_flight, api.in_flight)
        try:
            if api.delay_s:
                time.sleep(api.delay_s)
            if api.status != 200:
                # A hostile upstream that echoes the credential back in its error body.
                echoed = request.query_params.get("api_key") or request.headers.get("x-goog-api-key", "")
                return JSONResponse({"error": f"quota exceeded for key {echoed}"}, status_code=api.status)
            q = request.query_params["q"]
            return body_of(results_for(q, 4))
        finally:
            with api.lock:
                api.in_flight -= 1

    @app.get("/serpapi/search")
    def serpapi(request: Request):
        return answer(
            request,
            lambda rs: {
                "organic_results": [
                    {"position": i + 1, "link": u, "title": t, "snippet": s} for i, (u, t, s) in enumerate(rs)
                ]
            },
        )

    @app.get("/google/customsearch/v1")
    def google(request: Request):
        return answer(
            request, lambda rs: {"items": [{"link": u, "title": t, "snippet": s} for u, t, s in rs]}
        )

    @app.get("/brave/res/v1/web/search")
    def brave(request: Request):
        return answer(
            request,
            lambda rs: {
                "web": {
                    "results": [
                        {"url": u, "title": t, "description": f"<strong>{s}</strong> &amp; more"}
                        for u, t, s in rs
                    ]
                }
            },
        )

    return app


@pytest.fixture
def fake_api(serve: Serve) -> Iterator[tuple[FakeApi, str]]:
    api = FakeApi()
    with serve(make_fake_api(api)) as base:
        yield api, base


@pytest.fixture
def api(fake_api: tuple[FakeApi, str], monkeypatch: pytest.MonkeyPatch) -> FakeApi:
    for name, value in KEYS.items():
        monkeypatch.setenv(name, value)
    return fake_api[0]


@contextlib.contextmanager
def online_server(serve: Serve, engine: str, api_base: str, **overrides: Any) -> Iterator[str]:
    paths = {
        "serpapi": "/serpapi/search",
        "google": "/google/customsearch/v1",
        "brave": "/brave/res/v1/web/search",
    }
    config = OnlineSearchConfig(
        engine=engine, base_url=api_base + paths[engine], backoff_factor=0.01, **overrides
    )
    service = OnlineSearchService(load_engine(config), config)
    try:
        with serve(create_online_search_app(service)) as base:
            yield base
    finally:
        service.close()


def assert_no_secret(*texts: str) -> None:
    for text in texts:
        for secret in SECRET_VALUES:
            assert secret not in text
            assert requests.utils.quote(secret, safe="") not in text


@pytest.mark.parametrize("engine", ["serpapi", "google", "brave"])
def test_engine_results_map_to_retrieve_hits_without_leaking_the_key(
    engine: str, api: FakeApi, fake_api: tuple[FakeApi, str], caplog: pytest.LogCaptureFixture, serve: Serve
) -> None:
    caplog.set_level(logging.DEBUG)
    with online_server(serve, engine, fake_api[1]) as base:
        answer = requests.post(
            base + "/retrieve", json={"queries": ["red fox", "blue whale"], "topk": 2, "return_scores": True}
        )
    assert answer.status_code == 200, answer.text
    result = answer.json()["result"]
    snippet_suffix = " & more" if engine == "brave" else ""
    for q, hits in zip(["red fox", "blue whale"], result, strict=True):
        expected = results_for(q, 2)
        assert [h["document"]["id"] for h in hits] == [u for u, _, _ in expected]
        assert [h["document"]["contents"] for h in hits] == [
            f'"{t}"\n{s}{snippet_suffix}' for _, t, s in expected
        ]
        assert [h["score"] for h in hits] == [1.0, 0.5]

    # The key really reached the API, in the place that API expects it.
    sent = api.seen[0]
    if engine == "serpapi":
        assert sent["params"]["api_key"] == KEYS["SERP_API_KEY"] and sent["params"]["num"] == "2"
    elif engine == "google":
        assert sent["headers"]["x-goog-api-key"] == KEYS["GOOGLE_API_KEY"]
        assert sent["params"]["cx"] == KEYS["GOOGLE_CSE_ID"] and sent["params"]["num"] == "2"
    else:
        assert (
            sent["headers"]["x-subscription-token"] == KEYS["BRAVE_API_KEY"]
            and sent["params"]["count"] == "2"
        )
    # urllib3 did log the upstream request line, only with the key blanked out.
    assert any(r.name.startswith("urllib3") and "GET /" in r.getMessage() for r in caplog.records)
    if engine == "serpapi":
        assert "api_key=***" in caplog.text
    assert_no_secret(caplog.text, answer.text)


@pytest.mark.parametrize("engine", ["serpapi", "google"])
def test_upstream_error_answers_502_without_echoing_the_key(
    engine: str, api: FakeApi, fake_api: tuple[FakeApi, str], caplog: pytest.LogCaptureFixture, serve: Serve
) -> None:
    caplog.set_level(logging.DEBUG)
    api.status = 500
    with online_server(serve, engine, fake_api[1], upstream_retries=1) as base:
        answer = requests.post(base + "/retrieve", json={"queries": ["q"]})
        still_up = requests.get(base + "/health")
    assert answer.status_code == 502
    assert "HTTP 500" in answer.json()["detail"] and "quota exceeded for key ***" in answer.json()["detail"]
    assert len(api.seen) == 2  # one retry on 5xx
    assert still_up.status_code == 200
    assert_no_secret(caplog.text, answer.text)


def test_unreachable_upstream_answers_502(
    api: FakeApi, caplog: pytest.LogCaptureFixture, serve: Serve
) -> None:
    caplog.set_level(logging.DEBUG)
    with online_server(serve, "serpapi", f"http://127.0.0.1:{free_port()}", upstream_retries=1) as base:
        answer = requests.post(base + "/retrieve", json={"queries": ["q"]})
    assert answer.status_code == 502 and "could not be reached" in answer.json()["detail"]
    assert_no_secret(caplog.text, answer.text)


def test_batch_queries_go_upstream_concurrently_within_the_bound(
    api: FakeApi, fake_api: tuple[FakeApi, str], serve: Serve
) -> None:
    api.delay_s = 0.3
    queries = [f"query {i}" for i in range(8)]
    with online_server(serve, "brave", fake_api[1], concurrency=4) as base:
        start = time.monotonic()
        answer = requests.post(base + "/retrieve", json={"queries": queries, "topk": 1})
        elapsed = time.monotonic() - start
    assert answer.status_code == 200
    assert [row[0]["id"] for row in answer.json()["result"]] == [results_for(q, 1)[0][0] for q in queries]
    assert 2 <= api.max_in_flight <= 4
    assert elapsed < 8 * 0.3


def test_bad_requests_are_refused_before_any_upstream_call(
    api: FakeApi, fake_api: tuple[FakeApi, str], serve: Serve
) -> None:
    with online_server(serve, "google", fake_api[1]) as base:
        too_many = requests.post(base + "/retrieve", json={"queries": ["q"], "topk": 11})
        empty = requests.post(base + "/retrieve", json={"queries": []})
    assert too_many.status_code == 422 and "cap is 10" in too_many.text
    assert empty.status_code == 422 and "queries" in empty.text
    assert api.seen == []


def test_base_url_comes_from_the_environment_when_no_flag(
    api: FakeApi, fake_api: tuple[FakeApi, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BRAVE_BASE_URL", fake_api[1] + "/brave/res/v1/web/search")
    engine = load_engine(OnlineSearchConfig(engine="brave"))
    assert engine.base_url == fake_api[1] + "/brave/res/v1/web/search"
    assert load_engine(OnlineSearchConfig(engine="serpapi")).base_url == "https://serpapi.com/search"


def test_credentials_never_show_in_reprs_errors_or_pickles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GOOGLE_API_KEY", KEYS["GOOGLE_API_KEY"])
    monkeypatch.delenv("GOOGLE_CSE_ID", raising=False)
    with pytest.raises(RuntimeError, match="GOOGLE_CSE_ID is not set"):
        load_engine(OnlineSearchConfig(engine="google"))
    secret = read_secret("GOOGLE_API_KEY")
    assert secret.reveal() == KEYS["GOOGLE_API_KEY"]
    monkeypatch.setenv("GOOGLE_CSE_ID", "cse")
    engine = load_engine(OnlineSearchConfig(engine="google"))
    call = engine.build_call("q", 3)
    assert_no_secret(repr(secret), str(secret), repr(engine), repr(call), repr(vars(engine)))
    with pytest.raises(TypeError, match="not picklable"):
        pickle.dumps(Secret("x"))
