"""run_all.sh's Qwen3-30B-A3B memory-plan check (scripts/gpu_checks/memory_plan_vs_allocated.py) on CPU:
`--tiny-moe` builds Qwen3-MoE's layout (4 experts, 2 a token) and runs the GPU check's whole path (plan, FSDP2
actor, log-prob pass, two updates); `--num-layers` keeps a model's layer shape with fewer layers (what lets
Qwen3-30B-A3B's 128-expert layers fit one GPU). Measured values are null here; their plan is the MoE one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from scripts.gpu_checks import memory_plan_vs_allocated as check

REPO = Path(__file__).resolve().parents[3]


def test_num_layers_keeps_the_shape_with_fewer_layers() -> None:
    args = Namespace(model_config=str(REPO / "example/model_configs/qwen3-30b-a3b/config.json"), tiny=False,
                     tiny_moe=False, num_layers=2, rows=4, micro=4, prompt_length=2048, response_length=512)
    config, _ = check.model_and_shape(args)
    full = json.loads((REPO / "example/model_configs/qwen3-30b-a3b/config.json").read_text())
    assert config["num_hidden_layers"] == 2 and {k: v for k, v in config.items() if k not in (
        "num_hidden_layers", "max_window_layers")} == {k: v for k, v in full.items() if k not in (
            "num_hidden_layers", "max_window_layers")}


@pytest.mark.slow   # a subprocess building and training the tiny MoE actor: ~1-2 min on 2 busy cores
def test_the_moe_check_runs_its_whole_path_on_cpu() -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "scripts.gpu_checks.memory_plan_vs_allocated", "--device", "cpu",
                           "--tiny-moe", "--rows", "4", "--micro", "2", "--prompt-length", "16", "--response-length", "8"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout)
    model = report["model"]
    assert model["config"]["model_type"] == "qwen3_moe"
    # the built actor holds what the plan counts: every expert, fp32
    assert model["parameters"] == model["plan_parameters"] > 0
    assert report["held_bytes"]["actor params (fp32 shard)"] == 4 * model["parameters"]
    log_prob = report["phases"]["actor_log_prob"]["plan_certain"]
    assert "gathered layer (bf16, all 4 experts)" in log_prob
    assert report["update"]["parameter_tensors_changed"] == report["update"]["parameter_tensors"]
    assert report["log_prob"]["finite"]
