"""The retrieval server as a Ray Serve application (search_r1/search/ray_serve.py) on the session's
local Ray: the handle clients (sync and async) and Serve's HTTP proxy answer what the standalone
server answers, refuse what it refuses, and an overloaded replica's 503 is waited out and retried."""

from __future__ import annotations

import asyncio
import pickle
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from search_r1.search.client import RetrievalBadRequest
from search_r1.search.ray_serve import (
    PROXY_CHECK_TIMEOUTS_S,
    ServeSettings,
    check_server_args,
    controller_env,
    deploy,
    local_handle,
    proxy_routes,
    replica_env,
    replica_health,
    serve_url,
    server_argv,
    start_serve,
    undeploy,
)
from search_r1.search.serve_client import (
    AsyncServeRetrievalClient,
    ServeRetrievalClient,
    open_async_retrieval_client,
    open_retrieval_client,
)
from tests.conftest import free_port

QUERIES = ["how do glaciers form", "honeybee colony", "lighthouse keeper", "telescope lenses"]


def _settings(app: str, index: str, corpus: str, http_port: int | None = None, **server: Any) -> ServeSettings:
    args = {"index_path": index, "corpus_path": corpus, "retriever_name": "bm25", **server}
    return ServeSettings(app_name=app, argv=check_server_args(args), replicas=1,
                         replica_resources={"num_cpus": 1.0}, max_ongoing_requests=4096, http_port=http_port,
                         wait_s=180)


@pytest.fixture(scope="module")
def served(ray_cluster, bm25_index_dir: str, tiny_corpus_path: str) -> Iterator[tuple[str, str]]:
    """(ray-serve:// url, HTTP base) of a one-replica application with an HTTP proxy."""
    port = free_port()
    settings = _settings("test_retrieval", bm25_index_dir, tiny_corpus_path, http_port=port)
    url = deploy(settings)
    try:
        yield url, f"http://127.0.0.1:{port}"
    finally:
        undeploy(settings.app_name)


def _ids(hits: list[list[Any]]) -> list[list[str]]:
    return [[h.doc_id for h in per_query] for per_query in hits]


def test_server_args_become_the_servers_command_line_and_bad_ones_name_the_key() -> None:
    assert server_argv({"index_path": "i", "no_coalesce": True, "faiss_gpu": False, "topk": 5, "x": None}) == [
        "--index_path", "i", "--no_coalesce", "--topk", "5"]
    # a flag with a negative form: false is said, not left to the default (fp16 on a GPU)
    assert server_argv({"use_fp16": False}) == ["--no-use_fp16"] and server_argv({"use_fp16": True}) == ["--use_fp16"]
    assert check_server_args({"index_path": "i", "use_fp16": False})[-1] == "--no-use_fp16"
    with pytest.raises(ValueError, match=r"retriever.server_args: retrieval_server.py refuses"):
        check_server_args({"index_path": "i", "no_such_flag": 1})
    with pytest.raises(ValueError, match=r"retriever.server_args: .*max_pending_queries must be >= 0"):
        check_server_args({"index_path": "i", "max_pending_queries": -1})


def test_a_replica_gets_threads_for_its_cpus_and_no_gpu_it_does_not_hold() -> None:
    cpu_only = ServeSettings(app_name="a", argv=[], replicas=None, replica_resources={"num_cpus": 8.0},
                             max_ongoing_requests=1, http_port=None, wait_s=1)
    assert replica_env(cpu_only) == {"OMP_NUM_THREADS": "8", "MKL_NUM_THREADS": "8", "CUDA_VISIBLE_DEVICES": ""}
    with_gpu = ServeSettings(app_name="a", argv=[], replicas=1, replica_resources={"num_cpus": 2.0, "num_gpus": 1.0},
                             max_ongoing_requests=1, http_port=None, wait_s=1)
    assert replica_env(with_gpu) == {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}


@pytest.mark.slow   # a Serve deploy: in CI's slow suite (the default suite's 15-minute goal)
def test_no_node_with_the_replica_resources_fails_at_once(ray_cluster, bm25_index_dir: str,
                                                         tiny_corpus_path: str) -> None:
    settings = _settings("test_nowhere", bm25_index_dir, tiny_corpus_path)
    settings = ServeSettings(**{**settings.__dict__, "replicas": None,
                                "replica_resources": {"num_cpus": 1.0, "retrieval_node": 1.0}})
    with pytest.raises(RuntimeError, match=r"no alive node has retriever.replica_resources=.*retrieval_node"):
        deploy(settings)


class _ServeStartingSlowProxies:
    """Stands in for ``ray.serve`` where Serve's controller killed the first HTTP proxy(s) for not being
    ready within 5 s (a loaded node; CI's slow suite saw it): ``start`` raises the proxy's death."""

    def __init__(self, deaths: int) -> None:
        self.deaths = deaths
        self.calls: list[dict[str, Any]] = []

    def start(self, proxy_location: str, http_options: dict | None = None, controller_options: dict | None = None
              ) -> None:
        import ray

        given = {"proxy_location": proxy_location, "http_options": http_options, "controller_options": controller_options}
        self.calls.append({k: v for k, v in given.items() if v is not None})
        if len(self.calls) <= self.deaths:
            raise ray.exceptions.ActorDiedError()


class _ServeBefore260(_ServeStartingSlowProxies):
    """``ray.serve`` of a Ray the requirements allow (>= 2.40) whose ``start`` has no ``controller_options``."""

    def start(self, proxy_location: str, http_options: dict | None = None) -> None:   # type: ignore[override]
        super().start(proxy_location, http_options)


def test_serve_start_is_tried_again_once_when_its_first_http_proxy_dies_before_it_is_ready() -> None:
    import ray

    serve = _ServeStartingSlowProxies(deaths=1)
    start_serve(serve, 8123)
    controller = {"runtime_env": {"env_vars": controller_env()}}
    expected = {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": 8123},
                "controller_options": controller}
    assert serve.calls == [expected, expected]
    serve = _ServeStartingSlowProxies(deaths=0)
    start_serve(serve, None)
    assert serve.calls == [{"proxy_location": "Disabled", "controller_options": controller}]
    # an older Serve gets no controller_options (a TypeError there would stop every retriever.serve=ray run)
    older = _ServeBefore260(deaths=0)
    start_serve(older, 8123)
    assert older.calls == [{"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": 8123}}]
    # a second death is not Serve restarting a slow proxy: it is raised
    with pytest.raises(ray.exceptions.ActorDiedError):
        start_serve(_ServeStartingSlowProxies(deaths=2), 8123)


def test_serve_s_controller_gives_a_busy_proxy_the_longer_checks_and_an_exported_value_wins(
        served: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    # Ray's 5 s / 10 s got the proxy of the 1,000-client load test killed mid-load in CI (its clients
    # then refused for longer than their retries): the controller that runs must hold the longer ones.
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    pid = ray.get(ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE).get_pid.remote())
    environ = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
    env = dict(item.split("=", 1) for item in environ if "=" in item)
    assert {name: float(env[name]) for name in PROXY_CHECK_TIMEOUTS_S} == PROXY_CHECK_TIMEOUTS_S
    assert min(PROXY_CHECK_TIMEOUTS_S.values()) >= 30
    monkeypatch.setenv("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "90")
    assert controller_env() == {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30",
                                "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "90"}


def test_the_clients_pick_the_transport_by_url_and_travel_by_pickle() -> None:
    sync = open_retrieval_client(serve_url("app"), topk=2)
    assert isinstance(sync, ServeRetrievalClient) and sync.app_name == "app"
    assert isinstance(open_async_retrieval_client("ray-serve://app"), AsyncServeRetrievalClient)
    assert type(open_retrieval_client("http://h:1/retrieve")).__name__ == "RetrievalClient"
    again = pickle.loads(pickle.dumps(sync))
    assert (again.app_name, again.topk, again.timeout) == ("app", 2, sync.timeout)
    with pytest.raises(ValueError, match="names no Serve application"):
        ServeRetrievalClient("ray-serve://")


def test_handle_clients_and_http_answer_as_the_retriever_does(served: tuple[str, str], bm25_retriever: Any) -> None:
    url, base = served
    expected = _ids(bm25_retriever.search_batch(QUERIES, 2))
    assert _ids(ServeRetrievalClient(url, topk=2).retrieve(QUERIES)) == expected

    async def concurrently() -> list[list[list[Any]]]:
        client = AsyncServeRetrievalClient(url, topk=2)
        return await asyncio.gather(*(client.retrieve([q]) for q in QUERIES))

    assert [_ids(hits)[0] for hits in asyncio.run(concurrently())] == expected
    # HTTP through Serve's proxy: the original's API, the same answer
    body = requests.post(f"{base}/retrieve", json={"queries": QUERIES, "topk": 2, "return_scores": True},
                         timeout=30).json()
    assert [[hit["document"]["id"] for hit in per_query] for per_query in body["result"]] == expected
    health = requests.get(f"{base}/health", timeout=30).json()
    assert health["retriever"] == "bm25" and health["counters"]["errors"] == 0


def test_a_bad_request_is_refused_naming_the_field_on_both_paths(served: tuple[str, str]) -> None:
    url, base = served
    with pytest.raises(RetrievalBadRequest, match=r"queries\[1\] must be a string"):
        ServeRetrievalClient(url).retrieve(["fine", 3])  # type: ignore[list-item]
    answer = requests.post(f"{base}/retrieve", json={"queries": ["fine", 3]}, timeout=30)
    assert answer.status_code == 422 and "queries[1] must be a string" in answer.json()["detail"]


def test_each_call_is_counted_for_the_node_it_came_from(served: tuple[str, str]) -> None:
    import ray

    url, _ = served
    before = replica_health("test_retrieval")
    node = ray.get_runtime_context().get_node_id()
    ServeRetrievalClient(url).retrieve(["glacier"])
    after = replica_health("test_retrieval")
    assert list(after) == [node] and after[node]["node_id"] == node
    assert after[node]["calls_by_caller_node"][node] == before[node]["calls_by_caller_node"].get(node, 0) + 1


def test_an_overloaded_replica_answers_503_and_both_clients_still_get_every_answer(
        ray_cluster, bm25_index_dir: str, tiny_corpus_path: str, bm25_retriever: Any) -> None:
    # every search waits 0.3 s and at most 2 queries may wait: 12 at once must be turned away, then retried
    settings = _settings("test_overloaded", bm25_index_dir, tiny_corpus_path, max_pending_queries=2,
                         simulate_latency_ms=300, cache_size=0)
    url = deploy(settings)
    queries = [f"{word} {i}" for i, word in enumerate(["glacier", "honeybee", "lighthouse"] * 4)]
    try:
        async def concurrently() -> list[list[list[Any]]]:
            client = AsyncServeRetrievalClient(url, topk=1, max_retries=20, backoff_factor=0.05)
            return await asyncio.gather(*(client.retrieve([q]) for q in queries))

        started = time.monotonic()
        answers = asyncio.run(concurrently())
        assert time.monotonic() - started < 120
        assert [_ids(hits)[0] for hits in answers] == _ids(bm25_retriever.search_batch(queries, 1))
        sync = ServeRetrievalClient(url, topk=1, max_retries=20, backoff_factor=0.05)
        assert _ids(sync.retrieve(queries[:2])) == _ids(bm25_retriever.search_batch(queries[:2], 1))
        health = local_handle("test_overloaded").health.remote().result(timeout_s=30)
        assert health["counters"]["overloaded"] > 0 and health["pending_queries"] == 0
    finally:
        undeploy(settings.app_name)


@pytest.mark.slow   # a Serve deploy: in CI's slow suite (the default suite's 15-minute goal)
def test_a_replica_that_cannot_start_fails_the_deploy_naming_the_setting(ray_cluster, tiny_corpus_path: str,
                                                                         tmp_path: Any) -> None:
    settings = _settings("test_broken", str(tmp_path / "no_index"), tiny_corpus_path)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"retriever.serve=ray: the retrieval application did not start") as info:
        deploy(settings)
    assert "BM25 index folder not found" in str(info.value) and "retriever.server_args" in str(info.value)
    assert time.monotonic() - started < 170


def test_the_application_counts_as_running_once_every_replica_runs(served: tuple[str, str]) -> None:
    from search_r1.search.ray_serve import wait_until_running

    assert wait_until_running("test_retrieval", timeout_s=30)
    assert not wait_until_running("no_such_application", timeout_s=1)
    # deploy returned once the HTTP proxy routes the application too (what the clients post to)
    assert proxy_routes(int(served[1].rsplit(":", 1)[1])) == {"/": "test_retrieval"}
    assert proxy_routes(free_port()) == {}
