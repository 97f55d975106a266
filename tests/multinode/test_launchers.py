"""Fast checks (no Ray, no Slurm) of the launchers and of the driver's cluster settings.

The launchers run with a stand-in `python3` on PATH that records its arguments
(tests/multinode/_launch_record.py), so the exact Hydra overrides they would pass (through
train_grpo.sh / train_ppo.sh) are composed and validated like a real run's: an unknown key or a
batch size that does not divide over nnodes x n_gpus_per_node fails here, not on a 32-GPU
cluster. The sbatch files run the same way with stand-ins for `srun` and `scontrol`: their
preflight (`+trainer.preflight=true`, the real one or recorded) runs before the first srun.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.multinode._launch_record import run_recorded, slurm_env
from verl.trainer.config_check import validate_config
from verl.trainer.config_schema import trainer_flag
from verl.trainer.main_ppo import check_cluster_settings, compose_config, per_node_need
from verl.trainer.run_config import RunConfig, Trainer

LAUNCHERS = {
    "train_grpo_multinode_32b.sh": ("grpo", "Qwen/Qwen2.5-32B-Instruct", 4, 4),
    "train_ppo_multinode_32b.sh": ("gae", "Qwen/Qwen2.5-32B", 4, 4),
    "train_grpo_multinode_72b.sh": ("grpo", "Qwen/Qwen2.5-72B-Instruct", 8, 8),
}


def _recorded_overrides(script: str, tmp_path: Path, env: dict[str, str]) -> list[str]:
    run = run_recorded(f"example/multinode/{script}", tmp_path, env, ("trainer.total_training_steps=3",))
    assert run.returncode == 0, run.output
    return run.overrides


def _divide_like_the_workers(cfg) -> None:
    """The workers' own division of the global batch sizes (raises ValueError naming the key)."""
    from verl.workers.fsdp_workers import normalize_actor_batch_sizes, normalize_critic_batch_sizes

    run = RunConfig.from_config(cfg)
    role = "actor_rollout_ref" if run.algorithm.need_reference_policy else "actor_rollout"
    normalize_actor_batch_sizes(copy.deepcopy(cfg.actor_rollout_ref), role, run.pools.world_size)
    if run.algorithm.need_critic:
        normalize_critic_batch_sizes(copy.deepcopy(cfg.critic), run.pools.world_size)


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
    assert RunConfig.from_config(cfg).pools.world_size == 8
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
    assert Trainer.from_config(compose_config([])).cluster_address == "10.0.0.1:6379"
    check_cluster_settings(compose_config(["trainer.nnodes=2"]))
    assert Trainer.from_config(compose_config(["trainer.ray_address=auto"])).cluster_address == "auto"


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


# --------------------------------------------------------------------------- the shipped recipes
def _composed(overrides: list[str]):
    """The config a launcher's overrides compose to, validated and divided as the run would."""
    cfg = compose_config(overrides)
    OmegaConf.resolve(cfg)
    validate_config(cfg)
    _divide_like_the_workers(cfg)
    return cfg


def _assert_papers_sampling_and_data(cfg) -> None:
    rollout = cfg.actor_rollout_ref.rollout
    assert (rollout.temperature, rollout.top_p, rollout.top_k, rollout.do_sample) == (1, 0.95, -1, True)
    assert (cfg.data.train_batch_size, cfg.data.val_batch_size, cfg.data.val_data_num) == (512, 256, None)
    assert (cfg.data.max_prompt_length, cfg.data.max_start_length, cfg.data.max_response_length,
            cfg.data.max_obs_length) == (4096, 2048, 500, 500)
    assert (cfg.max_turns, cfg.retriever.topk) == (2, 3)
    assert trainer_flag(cfg, "val_before_train") is True
    assert (cfg.trainer.test_freq, cfg.trainer.save_freq, cfg.trainer.total_training_steps) == (50, 100, 1005)
    assert rollout.gpu_memory_utilization == 0.6
    assert rollout.log_prob_micro_batch_size == cfg.actor_rollout_ref.ref.log_prob_micro_batch_size == 128
    actor = cfg.actor_rollout_ref.actor
    assert (actor.ppo_mini_batch_size, actor.ppo_micro_batch_size) == (256, 64)
    assert all(actor.fsdp_config[k] is True for k in ("param_offload", "grad_offload", "optimizer_offload"))
    assert cfg.actor_rollout_ref.ref.fsdp_config.param_offload is True


def test_train_grpo_sh_ships_the_papers_grpo_recipe_on_8_gpus(tmp_path: Path) -> None:
    run = run_recorded("train_grpo.sh", tmp_path, {"BASE_MODEL": "Qwen/Qwen2.5-3B"})
    assert run.returncode == 0, run.output
    cfg = _composed(run.overrides)
    assert (RunConfig.from_config(cfg).pools.world_size, cfg.algorithm.adv_estimator) == (8, "grpo")
    _assert_papers_sampling_and_data(cfg)
    assert cfg.actor_rollout_ref.rollout.n_agent == 5
    assert RunConfig.from_config(cfg).batches.optimizer_steps["actor"] == 10          # 2560 rollouts / 256
    assert cfg.actor_rollout_ref.actor.use_kl_loss is True
    assert "VLLM_ATTENTION_BACKEND" not in run.env                # a vLLM 0.6 workaround, not set any more


def test_the_documented_serve_command_is_valid_on_2_nodes_of_8(tmp_path: Path) -> None:
    # docs/multinode.md "Retrieval that scales with the cluster": train_grpo.sh with retriever.serve=ray
    args = ("trainer.ray_address=auto", "trainer.nnodes=2", "trainer.n_gpus_per_node=8",
            "actor_rollout_ref.rollout.mode=async", "retriever.serve=ray",
            "+retriever.server_args.index_path=/shared/wiki/e5_Flat.index",
            "+retriever.server_args.corpus_path=/shared/wiki/wiki-18.jsonl",
            "+retriever.server_args.retriever_name=e5", "+retriever.server_args.retriever_model=intfloat/e5-base-v2")
    run = run_recorded("train_grpo.sh", tmp_path, {"BASE_MODEL": "Qwen/Qwen2.5-7B-Instruct"}, args)
    assert run.returncode == 0, run.output
    cfg = _composed(run.overrides)
    assert RunConfig.from_config(cfg).pools.world_size == 16 and cfg.retriever.serve == "ray" and cfg.retriever.replicas is None
    from verl.trainer.ppo.rollout_setup import generation_config

    assert generation_config(cfg, RunConfig.from_config(cfg).pools.world_size).search_url == "ray-serve://search_r1_retrieval"


def test_train_ppo_sh_ships_the_papers_ppo_recipe_on_8_gpus(tmp_path: Path) -> None:
    run = run_recorded("train_ppo.sh", tmp_path, {"BASE_MODEL": "Qwen/Qwen2.5-3B"})
    assert run.returncode == 0, run.output
    cfg = _composed(run.overrides)
    assert (RunConfig.from_config(cfg).pools.world_size, cfg.algorithm.adv_estimator) == (8, "gae")
    _assert_papers_sampling_and_data(cfg)
    assert cfg.actor_rollout_ref.rollout.n_agent == 1
    assert cfg.critic.ppo_micro_batch_size == 8                  # the original's value on 8 GPUs
    assert all(cfg.critic.model.fsdp_config[k] is True for k in ("param_offload", "grad_offload", "optimizer_offload"))
    assert RunConfig.from_config(cfg).batches.optimizer_steps["actor"] == RunConfig.from_config(cfg).batches.optimizer_steps["critic"] == 2
    assert "VLLM_ATTENTION_BACKEND" not in run.env


def test_the_2_gpu_example_keeps_the_small_setting(tmp_path: Path) -> None:
    run = run_recorded("example/train_grpo_2gpu.sh", tmp_path, {"BASE_MODEL": "Qwen/Qwen2.5-3B-Instruct"})
    assert run.returncode == 0, run.output
    cfg = _composed(run.overrides)
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    assert RunConfig.from_config(cfg).pools.world_size == 2
    assert (cfg.data.train_batch_size, rollout.n_agent, actor.ppo_mini_batch_size, actor.ppo_micro_batch_size) \
        == (64, 4, 128, 8)
    assert (cfg.data.val_data_num, cfg.data.val_batch_size, cfg.data.max_obs_length) == (256, 64, 2048)
    assert not any(actor.fsdp_config[k] for k in ("param_offload", "grad_offload", "optimizer_offload"))
    assert rollout.gpu_memory_utilization == 0.45
    assert trainer_flag(cfg, "val_before_train") is False
    assert (rollout.temperature, rollout.top_p) == (1, 0.95)
    assert RunConfig.from_config(cfg).batches.optimizer_steps["actor"] == 2
    # its extra arguments still win, +trainer.val_before_train included (appended once)
    again = run_recorded("example/train_grpo_2gpu.sh", tmp_path / "again", {"BASE_MODEL": "m"},
                         ("+trainer.val_before_train=true", "data.train_batch_size=32"))
    cfg = compose_config(again.overrides)
    assert trainer_flag(cfg, "val_before_train") is True and cfg.data.train_batch_size == 32


# --------------------------------------------------------------------------- the sbatch path
# The documented sbatch commands (docs/multinode.md, the sbatch headers): (file, nodes, environment, args)
SBATCH_COMMANDS = [
    ("train_grpo.sbatch", 2, {}, ()),
    ("train_ppo.sbatch", 2, {}, ()),
    ("train_grpo.sbatch", 4, {"BASE_MODEL": "Qwen/Qwen2.5-7B"}, ("data.train_batch_size=512",)),
    ("train_ppo.sbatch", 4, {"BASE_MODEL": "Qwen/Qwen2.5-7B"}, ()),
    ("train_grpo.sbatch", 8, {"TRAIN_SCRIPT": "example/multinode/train_grpo_multinode_72b.sh"}, ()),
    ("train_ppo.sbatch", 4, {"TRAIN_SCRIPT": "example/multinode/train_ppo_multinode_32b.sh"}, ()),
    ("train_grpo.sbatch", 2, {"RETRIEVER_SERVE": "ray", "file_path": "/shared/wiki"}, ()),
]


@pytest.mark.parametrize(("sbatch", "nnodes", "env", "args"), SBATCH_COMMANDS)
def test_documented_sbatch_commands_compose_a_config_that_holds_on_their_nodes(
        sbatch: str, nnodes: int, env: dict[str, str], args: tuple[str, ...], tmp_path: Path) -> None:
    run = run_recorded(f"scripts/slurm/{sbatch}", tmp_path, {**slurm_env(nnodes, 8), **env}, args)
    # ray_on_slurm.sh ran the launcher's preflight (recorded here), then stopped at its first srun
    assert run.overrides and run.overrides[-1] == "+trainer.preflight=true", run.output[-3000:]
    assert run.returncode != 0 and run.srun_calls, run.output[-3000:]
    cfg = _composed(run.overrides)
    assert (cfg.trainer.ray_address, cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == ("auto", nnodes, 8)
    assert cfg.algorithm.adv_estimator == ("gae" if "ppo" in sbatch else "grpo")
    if env.get("RETRIEVER_SERVE") == "ray":   # the retriever on Ray Serve, over the retriever's variables
        assert cfg.retriever.serve == "ray"
        assert dict(cfg.retriever.server_args) == {
            "index_path": "/shared/wiki/e5_Flat.index", "corpus_path": "/shared/wiki/wiki-18.jsonl",
            "retriever_name": "e5", "retriever_model": "intfloat/e5-base-v2"}
        assert cfg.retriever.health_wait_s == 900       # RETRIEVER_WAIT_S's default: every node loads the index
        # RETRIEVER_CPUS's default: a wiki-18 e5 Flat replica needs >= 23 CPUs (search/serve_checks.py)
        assert cfg.retriever.replica_resources.num_cpus == 32
    else:
        assert cfg.retriever.serve is None


def test_the_sbatch_path_runs_the_real_preflight_before_any_ray_node_or_server(tmp_path: Path) -> None:
    # critic.ppo_micro_batch_size=8 over 2 x 8 workers: the sbatch default before this check existed
    bad = run_recorded("scripts/slurm/train_ppo.sbatch", tmp_path / "bad", slurm_env(2, 8),
                       ("critic.ppo_micro_batch_size=8",), real_python=True)
    assert bad.returncode != 0
    assert "preflight FAILED" in bad.output and "critic.ppo_micro_batch_size=8" in bad.output, bad.output[-3000:]
    assert "no Ray node or retrieval server was started" in bad.output
    assert bad.srun_calls == []                 # no srun: no Ray head, no node, no retrieval server
    # The real preflight reads the data files and the model's config.json and needs the GPUs' memory
    # from here (a CPU machine); the job starts its own retrieval server after preflight. Saving is
    # off: the recipe's 3 checkpoints of a 7B PPO run (178 GiB each) need more disk than a CI box has.
    from tests.trainer._preflight_data import write_data

    write_data(tmp_path / "data")
    env = {**slurm_env(2, 8), "DATA_DIR": str(tmp_path / "data"), "BASE_MODEL": "example/model_configs/qwen2.5-7b"}
    good = run_recorded("scripts/slurm/train_ppo.sbatch", tmp_path / "good", env, real_python=True,
                        args=("trainer.gpu_memory_gib=80", "trainer.save_freq=-1",
                              f"trainer.default_local_dir={tmp_path / 'ckpt'}"))
    assert "preflight OK" in good.output and "preflight passed" in good.output, good.output[-3000:]
    assert good.srun_calls                      # then on to the Ray head (where the stand-in srun stops it)
