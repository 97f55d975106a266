"""A checkpoint folder that is node-local on a two-node Ray cluster is refused before anything is saved.

Two real Ray nodes on this machine; the second runs in a mount namespace of its own (`unshare -m`)
with a tmpfs over one folder, so that the same absolute path is another file system there, as a
node-local disk (/tmp, /scratch) is on a real cluster. A driver joins the cluster with one
`ActorRolloutRefWorker` rank per node and runs the trainer's marker probe
(verl/utils/checkpoint/shared_dir.py): under a folder both nodes share it passes; under the
node-local folder it raises, naming exactly the rank that runs on the second node.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.multinode._local_ray import REPO, LocalRayCluster, ray_env

pytestmark = [pytest.mark.multinode, pytest.mark.slow]

OWN_DISK = "own_disk"   # the custom resource that tells the namespaced node apart

PROBE = r"""
import json, sys
import ray
import ray._private.state as state
from omegaconf import OmegaConf
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.trainer.main_ppo import compose_config
from verl.utils.checkpoint.shared_dir import SharedDirError, verify_shared_dir
from verl.workers.fsdp_workers import ActorRolloutRefWorker

address, shared, node_local = sys.argv[1:4]
ray.init(address=address, logging_level="ERROR", log_to_driver=False)
config = compose_config(["trainer.nnodes=2", "trainer.n_gpus_per_node=1", "trainer.device=cpu",
                         "actor_rollout_ref.model.path=unused", "critic.model.path=unused"])
OmegaConf.resolve(config)
pool = RayResourcePool([1, 1], use_gpu=False)     # one rank on each node (STRICT_SPREAD)
group = RayWorkerGroup(pool, RayClassWithInitArgs(ActorRolloutRefWorker, config=config.actor_rollout_ref,
                                                  role="actor"))
out = {"shared": [m.rank for m in verify_shared_dir(shared, group.write_checkpoint_probe)]}
try:
    verify_shared_dir(node_local, group.write_checkpoint_probe)
    out["node_local"] = "passed"
except SharedDirError as err:
    out["node_local"] = str(err)
markers = group.write_checkpoint_probe(shared, "where")
actors = state.actors().values()
own = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("own_disk")]
out["own_disk_node"] = own[0]
out["rank_node"] = {m.rank: next(a["Address"]["NodeID"] for a in actors if a["Pid"] == m.pid) for m in markers}
out["rank_pid"] = {m.rank: m.pid for m in markers}
print("PROBE_JSON " + json.dumps(out))
"""


def _unshare_prefix() -> list[str]:
    """`unshare` into a new mount namespace (root), or a user + mount namespace (unprivileged)."""
    return ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-Urm"]


def _can_mount_privately(tmp_path: Path) -> bool:
    target = tmp_path / "mount_check"
    target.mkdir()
    try:
        done = subprocess.run([*_unshare_prefix(), "mount", "-t", "tmpfs", "tmpfs", str(target)],
                              capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@pytest.fixture(scope="module")
def cluster_with_a_node_local_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalRayCluster, Path]]:
    """A head node and a second node that sees a tmpfs of its own at `<tmp>/node_local`."""
    root = tmp_path_factory.mktemp("ckpt_nodes")
    if not _can_mount_privately(root):
        pytest.skip("unshare cannot create a mount namespace here (needs root or unprivileged user namespaces)")
    node_local = root / "node_local"
    node_local.mkdir()
    mount_then_start = [*_unshare_prefix(), "sh", "-c", 'mount -t tmpfs tmpfs "$1" && shift && exec "$@"', "sh",
                        str(node_local)]
    cluster = LocalRayCluster(root, port=free_port(), client_port=free_port())
    try:
        # start_node: a `ray start` that misses Ray's fixed 30 s raylet wait under load is started again
        cluster.start_node(num_cpus=2)
        cluster.start_node(num_cpus=2, wrap=mount_then_start, resources={OWN_DISK: 1})
        yield cluster, root
    finally:
        cluster.stop()
    assert cluster.leftover_pids() == [], "a Ray process of the test cluster outlived its node"


def test_a_node_local_checkpoint_dir_is_refused_naming_the_rank_on_the_other_node(
        cluster_with_a_node_local_dir: tuple[LocalRayCluster, Path]) -> None:
    cluster, root = cluster_with_a_node_local_dir
    shared, node_local = root / "shared" / "ckpt", root / "node_local" / "ckpt"
    proc = subprocess.run([sys.executable, "-c", PROBE, cluster.address, str(shared), str(node_local)], cwd=REPO,
                          env=ray_env(), capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PROBE_JSON ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    out = json.loads(lines[0][len("PROBE_JSON "):])
    assert out["shared"] == [0, 1]                      # one folder for both nodes: the probe passes
    on_own_disk = [int(rank) for rank, node in out["rank_node"].items() if node == out["own_disk_node"]]
    assert len(on_own_disk) == 1 and len(set(out["rank_node"].values())) == 2   # one rank on each node
    (far,) = on_own_disk
    message = out["node_local"]
    assert message.startswith(f"trainer.default_local_dir={node_local} is not one folder for every rank")
    assert f"1 of the 2 rank(s): rank {far} (host " in message
    assert f"pid {out['rank_pid'][str(far)]}, wrote {node_local}/.rank_probe-" in message
    assert f"rank {1 - far} (" not in message           # the driver's node's rank wrote where it reads
