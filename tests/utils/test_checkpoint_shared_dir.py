"""The checkpoint folder must be one folder for every rank: the marker probe before the first save.

Fast cases here: the probe's check on its own (a rank whose marker lands on another disk), and a real
local Ray worker group of two `ActorRolloutRefWorker` ranks whose working directory is not the
driver's, through the trainer's own `load_checkpoint`. The case of a second node whose view of the
same absolute path is another file system is tests/multinode/test_checkpoint_dir_two_nodes.py.
"""

from __future__ import annotations

import os
import shutil
import socket
import uuid
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from scripts.bench.toy_task import ContainsTokenReward, toy_overrides, write_toy_parquets
from verl.trainer import main_ppo
from verl.utils.checkpoint.shared_dir import (
    PROBE_PREFIX,
    SharedDirError,
    verify_shared_dir,
    write_rank_marker,
)

REPO = Path(__file__).resolve().parents[2]


def test_markers_every_rank_writes_where_the_driver_reads_pass_and_are_removed(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    markers = verify_shared_dir(root, lambda r, probe: [write_rank_marker(r, probe, rank) for rank in (0, 1)])
    assert [m.rank for m in markers] == [0, 1]
    assert all(Path(m.path).parent.parent == root and m.pid == os.getpid() for m in markers)
    assert list(root.iterdir()) == []   # the probe folder is gone; the root itself stays


def test_a_rank_that_writes_on_another_disk_is_named_with_its_host_pid_and_path(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "ckpt", tmp_path / "node1_local_disk"

    def write(r: str, probe: str) -> list:
        # rank 1's node resolves the same path to a disk of its own (here: another folder)
        return [write_rank_marker(r, probe, 0), write_rank_marker(str(elsewhere), probe, 1)]

    with pytest.raises(SharedDirError) as info:
        verify_shared_dir(root, write)
    message = str(info.value)
    wrote = next(elsewhere.glob(f"{PROBE_PREFIX}*/rank_1.json"))
    assert message.startswith(f"trainer.default_local_dir={root} is not one folder for every rank")
    assert f"1 of the 2 rank(s): rank 1 (host {socket.gethostname()}, pid {os.getpid()}, wrote {wrote})" in message
    assert "rank 0" not in message
    assert "a file system every node mounts at the same place" in message and "No checkpoint was written" in message
    assert not list(root.glob(f"{PROBE_PREFIX}*"))   # the driver's side of the probe is cleaned up


@pytest.fixture(scope="module")
def trainer(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory):
    """A built trainer (no workers of its own) with two ActorRolloutRefWorker ranks (no model: the
    probe needs none) as its actor group, on the session's local Ray."""
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    data = write_toy_parquets(tmp_path_factory.mktemp("data"), n_train=8, n_val=2)
    overrides = toy_overrides(tiny_model_dir, data, str(tmp_path_factory.mktemp("ckpt")), n_workers=2)
    config = main_ppo.compose_config([*overrides, "trainer.save_freq=1"])
    built = main_ppo.build_trainer(config, reward_fn=ContainsTokenReward(AutoTokenizer.from_pretrained(tiny_model_dir)))
    pool = RayResourcePool([2], use_gpu=False)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(ActorRolloutRefWorker, config=config.actor_rollout_ref,
                                                      role="actor"))
    built.actor_rollout_wg = group
    yield built
    group.shutdown()
    pool.release()


def test_build_trainer_gives_the_workers_an_absolute_checkpoint_dir(
        ray_cluster, trainer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The driver runs in tmp_path; the workers were started in the session cluster's directory (the
    # repository): a relative path would be two different folders.
    name = f"ckpt-{uuid.uuid4().hex[:8]}"
    monkeypatch.chdir(tmp_path)
    trainer.config.trainer.default_local_dir = name
    assert main_ppo.resolve_checkpoint_dir(trainer.config) == str(tmp_path / name)
    assert trainer.config.trainer.default_local_dir == str(tmp_path / name)
    try:
        trainer._checked_checkpoint_root = None
        assert trainer.load_checkpoint() is None    # save_freq=1: probed at start-up, nothing to resume
        assert trainer._checked_checkpoint_root == str(tmp_path / name)
    finally:
        shutil.rmtree(REPO / name, ignore_errors=True)   # where a worker given the relative path writes
    markers = verify_shared_dir(str(tmp_path / name), trainer.actor_rollout_wg.write_checkpoint_probe)
    assert [m.rank for m in markers] == [0, 1]
    assert all(Path(m.path).is_absolute() and m.path.startswith(str(tmp_path / name)) for m in markers)
    assert len({m.pid for m in markers} | {os.getpid()}) == 3   # two worker processes, not the driver


def test_a_relative_checkpoint_dir_that_workers_resolve_elsewhere_stops_the_run_at_start_up(
        ray_cluster, trainer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # What happened before the driver resolved the path: both ranks write under their own working
    # directory, the driver looks under its own.
    name = f"ckpt-{uuid.uuid4().hex[:8]}"
    monkeypatch.chdir(tmp_path)
    trainer.config.trainer.default_local_dir = name
    trainer._checked_checkpoint_root = None
    try:
        with pytest.raises(SharedDirError) as info:
            trainer.load_checkpoint()
        message = str(info.value)
        assert message.startswith(f"trainer.default_local_dir={name} is not one folder for every rank")
        assert "2 of the 2 rank(s): rank 0 (host" in message and f"wrote {REPO / name}/{PROBE_PREFIX}" in message
        assert f"'{name}' is a relative path" in message
    finally:
        shutil.rmtree(REPO / name, ignore_errors=True)
    assert trainer._checked_checkpoint_root is None
