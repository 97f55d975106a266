"""A real multi-node Ray cluster on this machine: `ray start --head` plus `ray start --address=...`
nodes, each a separate raylet with its own resources, as on a cluster of machines.

Each node runs `ray start --block` in a session of its own, with its own --temp-dir, so that

* stopping it is SIGTERM to that one process (Ray's reaper then stops the node's raylet, GCS,
  agents and workers), then SIGKILL to anything left in that session -- never `ray stop`, which
  would take down every Ray instance on the machine, other people's test clusters included;
* a plain `ray.init()` elsewhere on the machine never finds and joins this cluster (it looks for
  /tmp/ray/ray_current_cluster, which these nodes do not write).

Ray maps 127.0.0.1 to the machine's own address, so the nodes report that IP; they are told
apart by node id. Token authentication is switched off explicitly (RAY_AUTH_MODE=disabled): with
Ray's default a head started by `ray start` turns it on when ~/.ray/auth_token exists, and the
second node and drivers would then need the same mode set.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))

QUERY = r"""
import json, sys, ray
import ray._private.state as state
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
nodes = [{"id": n["NodeID"], "alive": n["Alive"], "resources": n["Resources"]} for n in ray.nodes()]
actors = [{"class": a.get("ActorClassName", ""), "name": a.get("Name", ""), "state": a.get("State"),
           "node": (a.get("Address") or {}).get("NodeID")} for a in state.actors().values()]
print("QUERY_JSON " + json.dumps({"nodes": nodes, "actors": actors}))
"""


# What `ray start` prints once its node's raylet has registered with the GCS (ray/scripts/scripts.py, after
# ray._private.node.Node has waited for the node's info in the GCS).
STARTED = "Ray runtime started."


def ray_env(**extra: str) -> dict[str, str]:
    """The environment for Ray nodes and drivers of this cluster (no inherited RAY_ADDRESS)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1", **extra)
    return env


def _session_pids(sid: int) -> list[int]:
    """Processes whose session id is `sid` (what a `setsid`-started node spawned)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:       # fields after "comm)": state ppid pgrp session ...
            pids.append(int(entry.name))
    return pids


class LocalRayCluster:
    """`add_node` starts nodes (the first is the head); `stop` stops all of them."""

    def __init__(self, root: Path, port: int, client_port: int) -> None:
        self.root = Path(root)
        self.port = port
        self.client_port = client_port
        self.address = f"127.0.0.1:{port}"
        self.procs: list[subprocess.Popen] = []
        self.sessions: list[int] = []       # session id of each node (= pid of its `ray start`)
        # Ray's socket paths live under --temp-dir and must stay under 108 bytes: a short folder.
        self.temp_root = Path(tempfile.mkdtemp(prefix="rn", dir="/tmp"))

    def add_node(self, num_cpus: int, wrap: list[str] = (), resources: dict[str, float] | None = None) -> None:
        """Start a node; `wrap` runs `ray start` through another command (e.g. `unshare` for a node with
        file systems of its own), `resources` adds custom Ray resources to tell the node apart."""
        index = len(self.procs)
        temp_dir = self.temp_root / f"n{index}"
        common = ["--block", "--node-ip-address=127.0.0.1", f"--num-cpus={num_cpus}", "--num-gpus=0",
                  f"--temp-dir={temp_dir}", "--disable-usage-stats"]
        if resources:
            common.append(f"--resources={json.dumps(resources)}")
        if index == 0:
            args = ["--head", f"--port={self.port}", f"--ray-client-server-port={self.client_port}",
                    "--include-dashboard=false"]
        else:
            args = [f"--address={self.address}"]
        log = open(self.root / f"node{index}.log", "w")   # noqa: SIM115 -- the node outlives this call
        self.procs.append(subprocess.Popen([*wrap, RAY, "start", *args, *common], stdout=log, stderr=subprocess.STDOUT,
                                           env=ray_env(), cwd=REPO, start_new_session=True))
        self.sessions.append(self.procs[-1].pid)

    def start_node(self, num_cpus: int, attempts: int = 3, **kwargs: Any) -> None:
        """`add_node`, then wait until the cluster has it. A `ray start` that exits on its way up is started
        again (Ray waits a fixed 30 s for its raylet to register: on 2 cores busy with other tests it can
        miss that and exit), its session's processes killed first; a head started again gets new ports."""
        for attempt in range(attempts):
            self.add_node(num_cpus, **kwargs)
            try:
                self.wait_for_nodes(len(self.procs))
                return
            except RuntimeError:
                proc = self.procs[-1]
                if proc.poll() is None or attempt == attempts - 1:
                    raise
            for pid in _session_pids(self.sessions.pop()):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.procs.pop()
            shutil.rmtree(self.temp_root / f"n{len(self.procs)}", ignore_errors=True)
            if not self.procs:   # the head: its ports may still be held by what it left
                self.port, self.client_port = free_port(), free_port()
                self.address = f"127.0.0.1:{self.port}"

    def query(self, timeout_s: float = 120.0) -> dict:
        """Nodes and actors (dead ones too) as the cluster's GCS reports them, from a fresh driver."""
        try:
            out = subprocess.run([sys.executable, "-c", QUERY, self.address], capture_output=True, text=True,
                                 env=ray_env(), cwd=REPO, timeout=timeout_s)
        except subprocess.TimeoutExpired as err:
            raise RuntimeError(f"cluster query at {self.address} timed out after {timeout_s:g}s") from err
        for line in out.stdout.splitlines():
            if line.startswith("QUERY_JSON "):
                return json.loads(line[len("QUERY_JSON "):])
        raise RuntimeError(f"cluster query failed (rc {out.returncode}): {out.stderr[-3000:]}")

    def wait_for_nodes(self, count: int, timeout_s: float = 120.0) -> list[dict]:
        """The alive nodes, once `count` are. Each node's `ray start` prints STARTED once its raylet is in the
        GCS (Ray's own wait), so its log is read every half second and the GCS is asked (a fresh driver
        process, seconds of CPU on a busy machine) only when enough nodes say so."""
        deadline = time.monotonic() + timeout_s
        while True:
            for i, proc in enumerate(self.procs):
                if proc.poll() is not None:
                    raise RuntimeError(f"ray node {i} exited with {proc.returncode}: "
                                       + (self.root / f"node{i}.log").read_text()[-3000:])
            alive = []
            if self.started_nodes() >= count:
                try:
                    alive = [n for n in self.query(timeout_s=60)["nodes"] if n["alive"]]
                except RuntimeError:
                    pass            # the head's GCS is not answering yet
                if len(alive) >= count:
                    return alive
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(alive)} of {count} ray nodes up after {timeout_s:g}s; logs in {self.root}")
            time.sleep(0.5 if self.started_nodes() < count else 2)

    def started_nodes(self) -> int:
        """How many nodes' `ray start` logs say the node is up."""
        logs = (self.root / f"node{i}.log" for i in range(len(self.procs)))
        return sum(1 for log in logs if log.exists() and STARTED in log.read_text(errors="replace"))

    def stop(self) -> None:
        """Stop the worker nodes, then the head; whatever survives a SIGTERM gets SIGKILL."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
            for pid in _session_pids(proc.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.procs = []
        shutil.rmtree(self.temp_root, ignore_errors=True)

    def leftover_pids(self) -> list[int]:
        """Processes still alive in any node's session (empty after a clean stop)."""
        return [pid for sid in self.sessions for pid in _session_pids(sid)]
