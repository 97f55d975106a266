"""Fast checks (no Ray, no Slurm) of the multi-node launchers and of the driver's cluster settings.

The example/multinode scripts run with a stand-in `python3` on PATH that records its arguments,
so the exact Hydra overrides they would pass (through train_grpo.sh / train_ppo.sh) are composed
and validated like a real run's: an unknown key or a batch size that does not divide over
nnodes x n_gpus_per_node fails here, not on a 32-GPU cluster.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.multinode._local_ray import REPO
from verl.trainer.config_check import validate_config, world_size
from verl.trainer.main_ppo import check_cluster_settings, cluster_address, compose_config, per_node_need

LAUNCHERS = {
    "train_grpo_multinode_32b.sh": ("grpo", "Qwen/Qwen2.5-32B-Instruct", 4, 4),
    "train_ppo_multinode_32b.sh": ("gae", "Qwen/Qwen2.5-32B", 4, 4),
    "train_grpo_multinode_72b.sh": ("grpo", "Qwen/Qwen2.5-72B-Instruct", 8, 8),
}


def _recorded_overrides(script: str, tmp_path: Path, env: dict[str, str]) -> list[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$ARGV_OUT"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    argv_out = tmp_path / "argv.txt"
    run_env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "SLURM_NNODES", "BASE_MODEL")}
    run_env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", ARGV_OUT=str(argv_out),
                   EXPERIMENT_NAME=str(tmp_path / "exp"), **env)   # train_*.sh tees to $EXPERIMENT_NAME.log
    proc = subprocess.run(["bash", str(REPO / "example" / "multinode" / script), "trainer.total_training_steps=3"],
                          env=run_env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    args = argv_out.read_text().splitlines()
    assert args[:2] == ["-m", "verl.trainer.main_ppo"]
    return args[2:]


@pytest.mark.parametrize("script", sorted(LAUNCHERS))
def test_example_launchers_compose_a_valid_multinode_config(script: str, tmp_path: Path) -> None:
    adv, model, nnodes, tp = LAUNCHERS[script]
    cfg = compose_config(_recorded_overrides(script, tmp_path, {}))
    OmegaConf.resolve(cfg)
    validate_config(cfg)
    assert cfg.algorithm.adv_estimator == adv
    assert cfg.actor_rollout_ref.model.path == model
    assert (cfg.trainer.ray_address, cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == ("auto", nnodes, 8)
    assert cfg.actor_rollout_ref.rollout.tensor_model_parallel_size == tp
    assert cfg.actor_rollout_ref.actor.fsdp_config.param_offload is True
    assert cfg.trainer.total_training_steps == 3          # extra arguments win
    if adv == "gae":
        assert cfg.critic.model.path == model


def test_example_launchers_follow_their_environment(tmp_path: Path) -> None:
    overrides = _recorded_overrides("train_grpo_multinode_32b.sh", tmp_path, {
        "NNODES": "2", "GPUS_PER_NODE": "4", "TP_SIZE": "2", "RAY_ADDRESS": "10.0.0.1:6379",
        "BASE_MODEL": "Qwen/Qwen2.5-14B-Instruct", "RETRIEVER_URL": "http://10.0.0.2:8000/retrieve"})
    cfg = compose_config(overrides)
    OmegaConf.resolve(cfg)
    validate_config(cfg)
    assert world_size(cfg) == 8
    assert cfg.trainer.ray_address == "10.0.0.1:6379"
    assert cfg.actor_rollout_ref.rollout.tensor_model_parallel_size == 2
    assert cfg.actor_rollout_ref.model.path == "Qwen/Qwen2.5-14B-Instruct"
    assert cfg.retriever.url == "http://10.0.0.2:8000/retrieve"


def test_cluster_settings_are_checked_naming_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ValueError, match=r"trainer.nnodes=2 needs a Ray cluster.*trainer.ray_address"):
        check_cluster_settings(compose_config(["trainer.nnodes=2"]))
    with pytest.raises(ValueError, match=r"trainer.ray_wait_s must be a number of seconds >= 0, got -1"):
        check_cluster_settings(compose_config(["trainer.ray_wait_s=-1"]))
    with pytest.raises(ValueError, match=r"trainer.ray_wait_s .* got 'soon'"):
        check_cluster_settings(compose_config(["trainer.ray_wait_s=soon"]))
    with pytest.raises(ValueError, match=r"trainer.nnodes must be an int >= 1, got 0"):
        check_cluster_settings(compose_config(["trainer.nnodes=0"]))
    check_cluster_settings(compose_config(["trainer.nnodes=2", "trainer.ray_address=auto"]))
    # RAY_ADDRESS alone joins a cluster too (as `ray start` users expect)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert cluster_address(compose_config([])) == "10.0.0.1:6379"
    check_cluster_settings(compose_config(["trainer.nnodes=2"]))
    assert cluster_address(compose_config(["trainer.ray_address=auto"])) == "auto"


def test_per_node_need_asks_for_gpus_only_on_a_gpu_cluster_or_with_device_cuda() -> None:
    cpu_node = {"Resources": {"CPU": 16.0}}
    gpu_node = {"Resources": {"CPU": 64.0, "GPU": 8.0}}
    auto = compose_config(["trainer.n_gpus_per_node=8"])
    assert per_node_need(auto, [cpu_node]) == {"CPU": 8.0}
    assert per_node_need(auto, [cpu_node, gpu_node]) == {"CPU": 8.0, "GPU": 8.0}
    assert per_node_need(compose_config(["trainer.n_gpus_per_node=8", "trainer.device=cuda"]), [cpu_node]) \
        == {"CPU": 8.0, "GPU": 8.0}
    assert per_node_need(compose_config(["trainer.n_gpus_per_node=2", "trainer.device=cpu"]), [gpu_node]) \
        == {"CPU": 2.0}
