"""RetrievalClient against real local HTTP servers: retries, budgets, chunking, timeouts, pickling."""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from search_r1.search.client import (
    RetrievalBadRequest,
    RetrievalClient,
    RetrievalError,
    RetrievalTimeout,
    RetrievalUnavailable,
)
from search_r1.search.schema import Hit, RetrieveRequest
from tests.conftest import free_port


@dataclass
class ScriptedServer:
    """What the scripted server does next; each test sets the fields it needs."""

    fail_first: int = 0
    fail_status: int = 503
    delay_s: float = 0.0
    retry_after: str | None = None          # the failures' Retry-After header
    calls: int = 0
    batch_sizes: list[int] = field(default_factory=list)
    call_times: list[float] = field(default_factory=list)   # time.monotonic() of each request


def make_scripted_app(script: ScriptedServer) -> FastAPI:
    app = FastAPI()

    @app.post("/retrieve")
    def retrieve(request: RetrieveRequest):
        script.calls += 1
        script.call_times.append(time.monotonic())
        script.batch_sizes.append(len(request.queries))
        if script.delay_s:
            time.sleep(script.delay_s)
        if script.calls <= script.fail_first:
            return JSONResponse(
                {"detail": f"scripted failure {script.calls}"}, status_code=script.fail_status,
                headers={"Retry-After": script.retry_after} if script.retry_after is not None else None,
            )
        topk = request.topk or 1
        # Each hit echoes its query, so order and pairing can be checked on the client side.
        result = [
            [
                Hit.from_contents(f"{q}#{r}", f'"{q}"\nbody {r}', 1.0 / (r + 1)).to_wire(
                    request.return_scores
                )
                for r in range(topk)
            ]
            for q in request.queries
        ]
        return {"result": result}

    @app.get("/health")
    def health():
        return {"status": "ok"}

    return app


@pytest.fixture
def scripted(serve: Callable[[FastAPI], AbstractContextManager[str]]) -> Iterator[tuple[ScriptedServer, str]]:
    """A fresh scripted server per test (``serve`` comes from tests/search/conftest.py)."""
    script = ScriptedServer()
    with serve(make_scripted_app(script)) as base:
        yield script, base + "/retrieve"


@pytest.fixture
def script(scripted: tuple[ScriptedServer, str]) -> ScriptedServer:
    return scripted[0]


@pytest.fixture
def url(scripted: tuple[ScriptedServer, str]) -> str:
    return scripted[1]


def test_retries_5xx_until_the_server_recovers(script: ScriptedServer, url: str) -> None:
    script.fail_first = 2
    client = RetrievalClient(url, topk=2, max_retries=3, backoff_factor=0.01)
    hits = client.retrieve(["alpha", "beta"])
    assert script.calls == 3
    assert [[h.doc_id for h in per_q] for per_q in hits] == [["alpha#0", "alpha#1"], ["beta#0", "beta#1"]]
    assert hits[0][0].title == "alpha" and hits[0][0].text == "body 0" and hits[0][0].score == 1.0


def test_gives_up_with_unavailable_after_retry_budget(script: ScriptedServer, url: str) -> None:
    script.fail_first = 100
    client = RetrievalClient(url, max_retries=2, backoff_factor=0.01)
    with pytest.raises(RetrievalUnavailable) as info:
        client.retrieve(["q"])
    assert script.calls == 3  # the first try and two retries
    assert info.value.status == 503 and info.value.url == url
    assert "scripted failure 3" in info.value.message


def test_does_not_retry_a_bad_request(script: ScriptedServer, url: str) -> None:
    script.fail_first, script.fail_status = 100, 400
    client = RetrievalClient(url, max_retries=3, backoff_factor=0.01)
    with pytest.raises(RetrievalBadRequest) as info:
        client.retrieve(["q"])
    assert script.calls == 1
    assert info.value.status == 400 and "scripted failure 1" in str(info.value)


def test_splits_a_large_batch_and_keeps_query_order(script: ScriptedServer, url: str) -> None:
    queries = [f"q{i}" for i in range(10)]
    client = RetrievalClient(url, topk=1, max_batch_queries=4)
    hits = client.retrieve(queries)
    assert script.batch_sizes == [4, 4, 2]
    assert client.retrieve([]) == [] and script.calls == 3  # nothing to ask, no request sent
    assert [per_q[0].doc_id for per_q in hits] == [f"q{i}#0" for i in range(10)]


def test_bare_documents_parse_with_zero_score(script: ScriptedServer, url: str) -> None:
    hits = RetrievalClient(url, topk=1).retrieve(["x"], return_scores=False)
    assert hits[0][0].score == 0.0 and hits[0][0].contents == '"x"\nbody 0'


def test_slow_server_raises_timeout_without_retrying(script: ScriptedServer, url: str) -> None:
    script.delay_s = 1.5
    client = RetrievalClient(url, timeout=0.3, max_retries=3, backoff_factor=0.01)
    start = time.monotonic()
    with pytest.raises(RetrievalTimeout) as info:
        client.retrieve(["q"])
    assert time.monotonic() - start < 1.4
    assert info.value.status is None
    assert script.calls == 1


def test_unreachable_server_raises_unavailable() -> None:
    url = f"http://127.0.0.1:{free_port()}/retrieve"
    client = RetrievalClient(url, max_retries=1, backoff_factor=0.01, timeout=2.0)
    with pytest.raises(RetrievalUnavailable) as info:
        client.retrieve(["q"])
    assert info.value.status is None
    assert not client.health()


def test_client_survives_pickle_round_trip(script: ScriptedServer, url: str) -> None:
    client = RetrievalClient(url, topk=2, max_batch_queries=3)
    clone = pickle.loads(pickle.dumps(client))
    assert clone._session is not client._session
    assert (clone.url, clone.topk, clone.max_batch_queries) == (url, 2, 3)
    assert clone.health()
    assert [h.doc_id for h in clone.retrieve(["z"])[0]] == ["z#0", "z#1"]


def test_retrieval_error_keeps_its_type_and_fields_through_pickle() -> None:
    err = pickle.loads(pickle.dumps(RetrievalTimeout("slow", None, "http://h/retrieve")))
    assert isinstance(err, RetrievalTimeout) and isinstance(err, RetrievalError)
    assert (err.message, err.status, err.url) == ("slow", None, "http://h/retrieve")


def test_rejects_a_bare_string_and_bad_settings() -> None:
    with pytest.raises(ValueError, match="max_batch_queries"):
        RetrievalClient("http://127.0.0.1:1/retrieve", max_batch_queries=0)
    with pytest.raises(ValueError, match="http"):
        RetrievalClient("127.0.0.1:8000/retrieve")
    with pytest.raises(TypeError):
        RetrievalClient("http://127.0.0.1:1/retrieve").retrieve("one query")
