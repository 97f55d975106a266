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

from verl.trainer.main_ppo import WORKER_ENV, worker_env

ROOT = Path(__file__).resolve().parents[2]
READ_WORKER_ENV = """
import json, os, ray
from verl.single_controller.base import Dispatch, Worker, register
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.trainer.main_ppo import WORKER_ENV, _init_ray, compose_config

class EnvWorker(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def environment(self, keys):
        return {key: os.environ.get(key) for key in keys}

config = compose_config(["trainer.device=cpu", "trainer.n_gpus_per_node=1"])
assert _init_ray(config, use_gpu=False), "a local Ray was not started"
pool = RayResourcePool([1], use_gpu=False)
group = RayWorkerGroup(pool, RayClassWithInitArgs(EnvWorker))
print("WORKER_ENV_JSON " + json.dumps(group.environment(list(WORKER_ENV))[0]), flush=True)
ray.shutdown()
"""


def test_worker_env_is_the_defaults_unless_the_driver_environment_sets_a_variable() -> None:
    assert worker_env({}) == WORKER_ENV
    assert worker_env({"NCCL_DEBUG": "INFO", "UNRELATED": "x"}) == {**WORKER_ENV, "NCCL_DEBUG": "INFO"}
    assert {"NCCL_DEBUG": "WARN", "VLLM_LOGGING_LEVEL": "WARN", "TOKENIZERS_PARALLELISM": "false"}.items() \
        <= WORKER_ENV.items()
    # veRL sets these for its own reasons that do not hold here (docs/multinode.md "Worker environment")
    assert not {"NCCL_CUMEM_ENABLE", "VLLM_DISABLE_COMPILE_CACHE", "CUDA_DEVICE_MAX_CONNECTIONS"} & set(WORKER_ENV)


def test_a_worker_sees_the_worker_env_and_the_users_own_value_wins(tmp_path: Path) -> None:
    clean = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", *WORKER_ENV)}
    # The user's own setting for one variable; the node (the raylet this driver starts) inherits the
    # same environment, so only the runtime_env could give the worker another value.
    env = {**clean, "HOME": str(tmp_path), "NCCL_DEBUG": "INFO"}
    result = subprocess.run([sys.executable, "-c", READ_WORKER_ENV], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    lines = [line for line in result.stdout.splitlines() if line.startswith("WORKER_ENV_JSON ")]
    assert result.returncode == 0 and lines, result.stderr[-3000:]
    seen = json.loads(lines[0][len("WORKER_ENV_JSON "):])
    assert seen == {**WORKER_ENV, "NCCL_DEBUG": "INFO"}
