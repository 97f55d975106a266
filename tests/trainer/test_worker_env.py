"""Every worker runs with main_ppo.WORKER_ENV, and a value from the user's own environment wins.

The driver passes the variables as Ray's runtime_env (`main_ppo.worker_env`), which overrides what a
worker would inherit from its node; a variable already set in the driver's environment is passed
with the driver's value. The run starts Ray the way the trainer does (`main_ppo._init_ray`), in a
subprocess (the test process may already hold the session's Ray), and reads the environment of a
worker of a real worker group.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.workers._batches import load_trainer_config
from verl.trainer.main_ppo import WORKER_ENV, pinned_alloc_conf, worker_env

ROOT = Path(__file__).resolve().parents[2]
READ_WORKER_ENV = """
import json, os, sys, ray
import torch
from verl.single_controller.base import Dispatch, Worker, register
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.trainer.main_ppo import WORKER_ENV, _init_ray, compose_config

class EnvWorker(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def environment(self, keys):
        return {key: os.environ.get(key) for key in keys}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def allocator_settings(self):
        return torch._C._accelerator_getAllocatorSettings()   # what this worker's torch read

config = compose_config(["trainer.device=cpu", "trainer.n_gpus_per_node=1", *sys.argv[1:]])
assert _init_ray(config, use_gpu=False), "a local Ray was not started"
pool = RayResourcePool([1], use_gpu=False)
group = RayWorkerGroup(pool, RayClassWithInitArgs(EnvWorker))
keys = [*WORKER_ENV, "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"]
seen = {k: v for k, v in group.environment(keys)[0].items() if v is not None or k in WORKER_ENV}
print("WORKER_ENV_JSON " + json.dumps({**seen, "torch": group.allocator_settings()[0]}), flush=True)
ray.shutdown()
"""


def test_worker_env_is_the_defaults_unless_the_driver_environment_sets_a_variable() -> None:
    assert worker_env({}) == WORKER_ENV
    assert worker_env({"NCCL_DEBUG": "INFO", "UNRELATED": "x"}) == {**WORKER_ENV, "NCCL_DEBUG": "INFO"}
    assert {"NCCL_DEBUG": "WARN", "VLLM_LOGGING_LEVEL": "WARN", "TOKENIZERS_PARALLELISM": "false"}.items() \
        <= WORKER_ENV.items()
    # veRL sets these for its own reasons that do not hold here (docs/multinode.md "Worker environment")
    assert not {"NCCL_CUMEM_ENABLE", "VLLM_DISABLE_COMPILE_CACHE", "CUDA_DEVICE_MAX_CONNECTIONS"} & set(WORKER_ENV)


def _worker_sees(tmp_path: Path, *overrides: str, **user_env: str) -> dict:
    drop = ("RAY_ADDRESS", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", *WORKER_ENV)
    clean = {k: v for k, v in os.environ.items() if k not in drop}
    # The user's own settings; the node (the raylet this driver starts) inherits the same environment,
    # so only the runtime_env could give the worker another value.
    env = {**clean, "HOME": str(tmp_path), **user_env}
    result = subprocess.run([sys.executable, "-c", READ_WORKER_ENV, *overrides], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    lines = [line for line in result.stdout.splitlines() if line.startswith("WORKER_ENV_JSON ")]
    assert result.returncode == 0 and lines, result.stderr[-3000:]
    return json.loads(lines[0][len("WORKER_ENV_JSON "):])


ROUND = "pinned_max_round_threshold_mb:16,pinned_max_cached_size_mb:16"
ADAPTER = {"actor_rollout_ref.model.lora_rank": 8}   # LoRA with lora_sync=adapter (the default): level-1 sleep


@pytest.mark.parametrize(("user", "expected"), [
    ({}, {"PYTORCH_ALLOC_CONF": ROUND}),
    ({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, {"PYTORCH_ALLOC_CONF": f"expandable_segments:True,{ROUND}"}),
    # torch reads the older name when the new one is unset: the setting joins the user's value there
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128,"},
     {"PYTORCH_CUDA_ALLOC_CONF": f"max_split_size_mb:128,{ROUND}"}),
    ({"PYTORCH_ALLOC_CONF": "a:1", "PYTORCH_CUDA_ALLOC_CONF": "b:2"}, {"PYTORCH_ALLOC_CONF": f"a:1,{ROUND}"}),
    # the user's own threshold is theirs; the cache cap (which makes blocks above it exact and uncached) is added
    ({"PYTORCH_ALLOC_CONF": "pinned_max_round_threshold_mb:64"},
     {"PYTORCH_ALLOC_CONF": "pinned_max_round_threshold_mb:64,pinned_max_cached_size_mb:16"}),
])
def test_level_one_sleeping_workers_cap_torchs_pinned_rounding_and_cache_merged_into_the_users_setting(
        user: dict[str, str], expected: dict[str, str]) -> None:
    assert pinned_alloc_conf(user) == expected
    vllm = load_trainer_config("/m", **{"actor_rollout_ref.rollout.name": "vllm", **ADAPTER})
    assert worker_env(user, vllm) == {**WORKER_ENV, **expected}
    auto = load_trainer_config("/m", **{"actor_rollout_ref.rollout.name": "auto", **ADAPTER})   # vLLM on a GPU host
    assert worker_env(user, auto) == {**WORKER_ENV, **expected}
    # level 2 (no LoRA, or the merged push) backs up only vLLM's small pools: torch's defaults stay
    assert worker_env(user, load_trainer_config("/m", **{"actor_rollout_ref.rollout.name": "vllm"})) == WORKER_ENV
    merged = load_trainer_config("/m", **{"actor_rollout_ref.rollout.name": "vllm", **ADAPTER,
                                          "actor_rollout_ref.rollout.lora_sync": "merged"})
    assert worker_env(user, merged) == WORKER_ENV
    hf = load_trainer_config("/m", **{"actor_rollout_ref.rollout.name": "hf", **ADAPTER})
    assert worker_env(user, hf) == WORKER_ENV      # the HF rollout: no pinned backups


def test_a_worker_without_the_pinned_settings_is_named() -> None:
    from verl.utils.host_memory_plan import pinned_alloc_missing

    assert pinned_alloc_missing({}) == ["pinned_max_round_threshold_mb", "pinned_max_cached_size_mb"]
    assert pinned_alloc_missing({"PYTORCH_ALLOC_CONF": "pinned_max_round_threshold_mb:16"}) == ["pinned_max_cached_size_mb"]
    assert pinned_alloc_missing({"PYTORCH_CUDA_ALLOC_CONF": ROUND}) == []
    # torch reads PYTORCH_ALLOC_CONF first: the older name's settings do not count when it is set
    assert pinned_alloc_missing({"PYTORCH_ALLOC_CONF": "a:1", "PYTORCH_CUDA_ALLOC_CONF": ROUND}) != []


def test_a_worker_sees_the_worker_env_the_users_own_values_win_and_torch_read_the_pinned_rounding(
        tmp_path: Path) -> None:
    # One local Ray for both (each start is ~19 s of CPU): a variable of WORKER_ENV the user set, and
    # an allocator setting of theirs that a vLLM run with a LoRA adapter (level-1 sleep) adds to.
    seen = _worker_sees(tmp_path, "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.model.lora_rank=8",
                        NCCL_DEBUG="INFO", PYTORCH_ALLOC_CONF="expandable_segments:False")
    assert seen == {**WORKER_ENV, "NCCL_DEBUG": "INFO", "PYTORCH_ALLOC_CONF": f"expandable_segments:False,{ROUND}",
                    "torch": f"expandable_segments:False,{ROUND}"}    # set before torch read it, in the worker


def test_an_hf_runs_workers_get_the_worker_env_without_the_pinned_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    # The real start above is a vLLM run's; an HF run's (no level-1 sleep) is read from the arguments
    # _init_ray gives ray.init, so that the test costs no second local Ray.
    import ray

    from verl.trainer.main_ppo import _init_ray, compose_config

    for key in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "RAY_AUTH_MODE", *WORKER_ENV):   # restored after
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    calls: list[dict] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    config = compose_config(["trainer.device=cpu", "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.name=hf",
                             "actor_rollout_ref.model.lora_rank=8"])
    assert _init_ray(config, use_gpu=False)
    assert [c["runtime_env"] for c in calls] == [{"env_vars": {**WORKER_ENV, "NCCL_DEBUG": "INFO"}}]
