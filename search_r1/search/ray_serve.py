"""The retrieval server as a Ray Serve application on the training cluster (`retriever.serve=ray`).

The same FastAPI app as ``retrieval_server.py`` (same retrievers, coalescer, cache, limits and
queue bound) runs in each replica of one Serve deployment; Ray Serve places the replicas, health-
checks them and restarts a dead one. By default there is one replica per node
(``max_replicas_per_node=1``), each loading the index from the path ``retriever.server_args``
names (on every node: a shared file system or a copy per node).

Two ways in:

- Rollout workers and the driver call a replica through a ``DeploymentHandle`` that prefers the
  replica on the caller's own node (Serve's locality routing: the same node first, then any healthy
  replica), the url being ``ray-serve://<app name>`` (``search_r1.search.serve_client``). A call
  returns what the HTTP route would answer (status, body, headers), so a refused or overloaded
  request means the same thing, and is retried the same way, on both paths.
- HTTP (``retriever.serve_http_port``): Serve's proxy on the head node answers ``POST /retrieve``
  and ``GET /health`` at that port, for tools outside Ray (``infer.py``, curl, the load bench).

Each replica counts the handle calls it answered per caller node (``/health`` -> ``node_id``,
``calls_by_caller_node``), which is how a test sees that each node's workers were served by their
own node's replica. ``ray[serve]`` is the extra ``serve`` (``pip install -e .[serve]``).
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from search_r1.search.schema import RequestError, RetrieveRequest

logger = logging.getLogger(__name__)

SERVE_SCHEME = "ray-serve://"
DEPLOYMENT_NAME = "RetrievalReplica"
HTTP_CALLER = "http"


def serve_url(app_name: str) -> str:
    """The retriever url of a Serve application: what the rollout's clients are given."""
    return SERVE_SCHEME + app_name


def is_serve_url(url: str | None) -> bool:
    return bool(url) and str(url).startswith(SERVE_SCHEME)


def import_serve() -> Any:
    try:
        from ray import serve
    except ImportError as err:
        raise ImportError(
            "retriever.serve=ray needs Ray Serve: pip install -e .[serve] (ray[serve]); or run the "
            "retrieval server yourself (bash retrieval_launch.sh) and leave retriever.serve=null") from err
    return serve


def server_argv(server_args: Mapping[str, Any]) -> list[str]:
    """``retriever.server_args`` as ``retrieval_server.py``'s command line: ``{index_path: x}`` ->
    ``--index_path x``; ``true`` -> the bare flag; ``false`` -> left out, or ``--no-<flag>`` for a
    flag with a negative form (``use_fp16: false`` -> ``--no-use_fp16``); ``null`` -> left out."""
    import argparse

    from search_r1.search.retrieval_server import build_parser

    negatable = {action.dest for action in build_parser()._actions
                 if isinstance(action, argparse.BooleanOptionalAction)}
    argv: list[str] = []
    for key, value in server_args.items():
        if value is None or (value is False and key not in negatable):
            continue
        if value is False:
            argv.append(f"--no-{key}")
            continue
        argv.append(f"--{key}")
        if value is not True:
            argv.append(str(value))
    return argv


def check_server_args(server_args: Mapping[str, Any]) -> list[str]:
    """Parse ``retriever.server_args`` as the replicas will; the argv, or ValueError naming the key."""
    from search_r1.search.retrieval_server import config_from_args, parse_args

    argv = server_argv(server_args)
    try:
        args = parse_args(argv)
    except SystemExit as err:   # argparse already printed which flag it refused
        raise ValueError(f"retriever.server_args: retrieval_server.py refuses {argv} (see the message above); "
                         "keys are its flags without '--' (docs/retriever.md)") from err
    bad = sorted(set(server_args) - set(vars(args)))
    if bad:
        raise ValueError(f"retriever.server_args.{bad[0]}: not a flag of retrieval_server.py")
    try:
        config_from_args(args)
    except ValueError as err:
        raise ValueError(f"retriever.server_args: {err}") from err
    return argv


class RetrievalReplica:
    """One Serve replica: the retrieval server's app and service, plus handle methods.

    Serve wraps this class with ``serve.ingress()`` (``deployment``): the app returned by
    ``__serve_build_asgi_app__`` answers HTTP, its lifespan starts the coalescer."""

    def __init__(self, argv: list[str]) -> None:
        import ray

        from search_r1.search.retrieval_server import (
            config_from_args,
            create_app,
            parse_args,
            retriever_from_args,
        )

        args = parse_args(argv)
        # (not `self.app`: Serve's ingress wrapper owns that name)
        self._asgi_app = create_app(retriever_from_args(args), config_from_args(args))
        self.service = self._asgi_app.state.service
        self.node_id = ray.get_runtime_context().get_node_id()
        self.calls_by_caller_node: Counter[str] = Counter()
        self.started_at = time.time()

    def __serve_build_asgi_app__(self) -> Any:
        return self._asgi_app

    async def retrieve(self, payload: dict, caller_node: str | None = None) -> tuple[int, dict, dict]:
        """What ``POST /retrieve`` with body ``payload`` answers: (status, body, headers)."""
        from search_r1.search.retrieval_server import ServerOverloaded
        from search_r1.search.serving import parse_body

        self.calls_by_caller_node[caller_node or HTTP_CALLER] += 1
        try:
            body = parse_body(json.dumps(payload).encode(), RetrieveRequest)
            return 200, await self.service.answer(body), {}
        except RequestError as err:
            self.service.rejected += 1
            return err.status_code, {"detail": err.message}, {}
        except ServerOverloaded as err:
            return 503, {"detail": err.message}, {"Retry-After": str(err.retry_after_s)}
        except Exception as err:    # as the HTTP route's 500: the caller retries, the log keeps the trace
            logger.exception("search failed", exc_info=err)
            return 500, {"detail": f"search failed: {type(err).__name__}: {err}"}, {}

    def health(self) -> dict:
        """``/health`` of this replica, with where it runs and whom it served."""
        from ray import serve

        return {**self.service.health(), "node_id": self.node_id, "pid": os.getpid(),
                "replica_id": serve.get_replica_context().replica_id.unique_id,
                "started_at": self.started_at, "calls_by_caller_node": dict(self.calls_by_caller_node)}


@dataclass(frozen=True)
class ServeSettings:
    """`retriever.*` as the Serve application needs them (read once, in the driver)."""

    app_name: str
    argv: list[str]
    replicas: int | None            # None: one per alive node
    replica_resources: dict[str, float]
    max_ongoing_requests: int
    http_port: int | None
    wait_s: float

    @classmethod
    def from_config(cls, retriever: Any) -> ServeSettings:
        from omegaconf import OmegaConf

        args = OmegaConf.to_container(retriever.server_args, resolve=True) if retriever.server_args else {}
        resources = OmegaConf.to_container(retriever.replica_resources, resolve=True) or {}
        custom = resources.pop("resources", None) or {}
        return cls(app_name=str(retriever.serve_app_name), argv=check_server_args(args),
                   replicas=None if retriever.replicas is None else int(retriever.replicas),
                   replica_resources={str(k): float(v) for k, v in {**resources, **custom}.items()},
                   max_ongoing_requests=int(retriever.replica_max_ongoing_requests),
                   http_port=None if retriever.serve_http_port is None else int(retriever.serve_http_port),
                   wait_s=float(retriever.health_wait_s))


def replica_env(settings: ServeSettings) -> dict[str, str]:
    """A replica's environment: as many OpenMP / MKL threads as CPUs it holds (the job's runtime env says
    1, for the trainer's workers), and no GPU unless it holds one: Ray 2.60 leaves CUDA_VISIBLE_DEVICES
    as the node has it for an actor with num_gpus=0, and the encoder (or FAISS) would take a GPU the
    trainer's workers own."""
    threads = str(max(1, int(settings.replica_resources.get("num_cpus", 1.0))))
    env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    if settings.replica_resources.get("num_gpus", 0.0) <= 0:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def nodes_that_fit(settings: ServeSettings) -> int:
    """Alive nodes whose resources hold one replica (a head started with --num-cpus=0, or a node
    without the replica's custom resource, gets none)."""
    import ray

    from verl.single_controller.ray.base import node_fits

    need = {"CPU": settings.replica_resources.get("num_cpus", 1.0),
            "GPU": settings.replica_resources.get("num_gpus", 0.0),
            **{k: v for k, v in settings.replica_resources.items() if k not in ("num_cpus", "num_gpus")}}
    return sum(1 for node in ray.nodes() if node["Alive"] and node_fits(node, need))


def deployment(settings: ServeSettings, n_nodes: int) -> Any:
    """The bound Serve application: ``settings.replicas`` replicas (default one per node that can hold
    one, at most one per node then), each a ``RetrievalReplica`` with the server's flags."""
    serve = import_serve()
    replicas = settings.replicas if settings.replicas is not None else n_nodes
    options: dict[str, Any] = {
        "num_replicas": replicas,
        # Serve's default (5) would queue callers' requests before our coalescer sees them; the
        # replica's own bound (--max_pending_queries) decides when to answer 503.
        "max_ongoing_requests": settings.max_ongoing_requests,
        "ray_actor_options": {
            "num_cpus": settings.replica_resources.get("num_cpus", 1.0),
            "num_gpus": settings.replica_resources.get("num_gpus", 0.0),
            "resources": {k: v for k, v in settings.replica_resources.items() if k not in ("num_cpus", "num_gpus")},
            "runtime_env": {"env_vars": replica_env(settings)},
        },
        "health_check_period_s": 2.0,
        "health_check_timeout_s": 30.0,
    }
    if settings.replicas is None:
        options["max_replicas_per_node"] = 1
    cls = serve.deployment(name=DEPLOYMENT_NAME, **options)(serve.ingress()(RetrievalReplica))
    return cls.bind(settings.argv)


def deploy(settings: ServeSettings) -> str:
    """Start Serve (if needed) and the retrieval application; wait until every replica answers,
    for at most ``settings.wait_s``. Returns the ``ray-serve://`` url. A RuntimeError names what
    failed (Serve's own message for a replica that could not start)."""

    serve = import_serve()
    from ray.serve.schema import ApplicationStatus

    n_nodes = nodes_that_fit(settings)
    if settings.replicas is None and n_nodes == 0:
        raise RuntimeError(f"retriever.serve=ray: no alive node has retriever.replica_resources="
                           f"{settings.replica_resources} for a replica; no trainer worker was started")
    global _STARTED_SERVE
    _STARTED_SERVE = _STARTED_SERVE or not serve_running()
    start_serve(serve, settings.http_port)
    start = time.monotonic()
    # serve.run waits for the application without a bound; a replica that cannot be placed (no node
    # has its resources) would hang the driver, so deploy without waiting and poll with a deadline.
    serve._run(deployment(settings, n_nodes), name=settings.app_name,
               route_prefix="/" if settings.http_port is not None else None, _blocking=False,
               # no access-log line per call (thousands a step); warnings and errors still reach the driver
               logging_config={"log_level": "WARNING", "enable_access_log": False})
    last = ""
    while time.monotonic() - start < settings.wait_s:
        app = serve.status().applications.get(settings.app_name)
        if app is not None:
            last = f"{app.status}: {app.message}".strip(": ")
            if app.status == ApplicationStatus.RUNNING:
                # the proxy is asked only once the application runs, not on every poll before
                if settings.http_port is None or settings.app_name in proxy_routes(settings.http_port).values():
                    logger.info("retrieval on Ray Serve: application %r running after %.1f s (%s)",
                                settings.app_name, time.monotonic() - start,
                                ", ".join(f"{d}: {s.replica_states}" for d, s in app.deployments.items()))
                    return serve_url(settings.app_name)
                last = f"RUNNING, but Serve's HTTP proxy on 127.0.0.1:{settings.http_port} does not route it yet"
            if app.status == ApplicationStatus.DEPLOY_FAILED:
                break
        time.sleep(1.0)
    details = ""
    app = serve.status().applications.get(settings.app_name)
    if app is not None:
        details = "; ".join(f"{name}: {d.status} {d.message}" for name, d in app.deployments.items())
    undeploy(settings.app_name)
    raise RuntimeError(
        f"retriever.serve=ray: the retrieval application did not start within retriever.health_wait_s="
        f"{settings.wait_s:g} s ({last}; {details}). Check retriever.server_args (index and corpus on every node) "
        f"and retriever.replica_resources={settings.replica_resources} against the nodes' free resources. "
        "No trainer worker was started.")


# Serve's controller waits 5 s for a new proxy to be ready and 10 s for a running one to answer its
# health check, and restarts a proxy that fails three checks in a row. A proxy serving a thousand
# clients on a saturated node answers neither in time: the controller killed it mid-load, and while
# the new one started, clients were refused (ConnectError). The controller gets these instead (an
# exported value of the same variable wins); the threshold of three is Ray's.
PROXY_CHECK_TIMEOUTS_S = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": 30.0,
                          "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": 30.0}


def controller_env() -> dict[str, str]:
    """The Serve controller's environment variables: ``PROXY_CHECK_TIMEOUTS_S`` unless exported."""
    return {name: os.environ.get(name, f"{value:g}") for name, value in PROXY_CHECK_TIMEOUTS_S.items()}


def start_serve(serve: Any, http_port: int | None) -> None:
    """``serve.start``: no HTTP proxy, or one on the head at 127.0.0.1:`http_port` (as the standalone
    server binds by default; the rollout reaches replicas through handles), its controller given
    ``controller_env()``. A controller with Ray's 5 s for a new proxy to come up kills a slower one (a
    loaded node: its imports alone can take longer) and starts another with a longer wait, while
    ``serve.start``, waiting on the first, raises its death. Then it is called once more: it connects to
    the controller now running, and ``deploy`` waits for the proxy to route the application."""
    import ray

    if http_port is None:
        kwargs: dict[str, Any] = {"proxy_location": "Disabled"}
    else:
        kwargs = {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": http_port}}
    # serve.start takes controller_options from Ray 2.60 on (requirements allow >= 2.40): an older Serve
    # keeps Ray's checks rather than failing on the keyword
    if "controller_options" in inspect.signature(serve.start).parameters:
        kwargs["controller_options"] = {"runtime_env": {"env_vars": controller_env()}}
    else:
        logger.info("this Ray's serve.start takes no controller_options: Serve's proxy keeps Ray's checks (5 s / 10 s)")
    try:
        serve.start(**kwargs)
    except (ray.exceptions.RayActorError, TimeoutError) as err:
        logger.warning("Serve's HTTP proxy did not come up at once (%s: %s); Serve starts another, waited "
                       "for with the application", type(err).__name__, str(err).splitlines()[0] if str(err) else "")
        serve.start(**kwargs)


def proxy_routes(http_port: int) -> dict[str, str]:
    """The head's Serve proxy's routes (route prefix -> application), {} while it does not answer."""
    import requests

    try:
        response = requests.get(f"http://127.0.0.1:{http_port}/-/routes", timeout=5)
        return response.json() if response.status_code == 200 else {}
    except (requests.RequestException, ValueError):
        return {}


# Whether this process started Serve on the cluster (then it shuts it down with its last application).
_STARTED_SERVE = False


def serve_running() -> bool:
    """Whether the cluster already runs Serve (its controller actor exists)."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        return False
    return True


def undeploy(app_name: str) -> None:
    """Delete the application; shut Serve down when this process started it and nothing else runs on
    it (Serve that was there before, e.g. another job's on a shared cluster, is left running)."""
    global _STARTED_SERVE
    serve = import_serve()
    try:
        serve.delete(app_name)
        if _STARTED_SERVE and not serve.status().applications:
            serve.shutdown()
            _STARTED_SERVE = False
    except Exception as err:   # the run is ending; a failed clean-up must not hide its outcome
        logger.warning("could not delete the Serve application %r: %s", app_name, err)


def wait_until_running(app_name: str, timeout_s: float) -> bool:
    """Wait (at most `timeout_s`) until every replica of the application runs (after a restart, say);
    whether they do."""
    serve = import_serve()
    deadline = time.monotonic() + timeout_s
    while True:
        app = serve.status().applications.get(app_name)
        states = [{getattr(state, "value", state) for state, n in d.replica_states.items() if n}
                  for d in app.deployments.values()] if app is not None else []
        if states and all(st == {"RUNNING"} for st in states):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)


def local_handle(app_name: str) -> Any:
    """A handle to the application that sends each call to the replica on this node when it has one
    that is alive and not full, else to any healthy replica (Serve's locality routing)."""
    serve = import_serve()
    handle = serve.get_app_handle(app_name)   # cached per process by Serve (until serve.shutdown): init once
    if not handle.is_initialized:
        # Serve's init options (options() would warn that this one is deprecated there); the router in
        # its own loop, so the handle serves every asyncio.run of the async rollout, whatever Serve's default
        handle._init(_prefer_local_routing=True, _run_router_in_separate_loop=True)
    return handle


def replica_health(app_name: str, timeout_s: float = 60.0) -> dict[str, dict]:
    """Node id -> ``health()`` of the replica on that node, for every alive node that has one: asked
    from a task pinned to the node, through a locality-routed handle (the answer names the node it
    came from, so a call served elsewhere is seen, not mistaken). For tests and operators."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    def ask(app: str) -> dict:
        return local_handle(app).health.remote().result(timeout_s=timeout_s)

    answers = {}
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        pinned = ask.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False))
        answer = ray.get(pinned.remote(app_name), timeout=timeout_s)
        if answer["node_id"] == node["NodeID"]:
            answers[node["NodeID"]] = answer
    return answers
