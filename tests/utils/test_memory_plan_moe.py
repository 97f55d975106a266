"""The memory plan's parameter count for Qwen3 (dense and MoE) and the other MoE families against the
models transformers builds from the same config.json (on the meta device: no storage, so the shipped
30B and 32B configs are counted exactly), total and active; what the plan charges by total (weights,
the gathered layer, the HF export's largest tensor) and by active (activations, FLOPs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from verl.utils.flops_counter import FlopsCounter
from verl.utils.memory_plan import ModelShape, _activations
from verl.utils.memory_plan_lora import lora_counts, moe_lora_error
from verl.utils.tiny_model import ARCHITECTURES, tiny_config, train_bpe_tokenizer

CONFIGS = Path(__file__).resolve().parents[2] / "example" / "model_configs"


def _meta_model(config: dict) -> torch.nn.Module:
    hf = AutoConfig.for_model(**config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf)


def _counts(model: torch.nn.Module) -> tuple[int, int, int]:
    """(parameters, parameter tensors, parameters one token runs through) of a transformers model."""
    config = model.config
    experts = int(getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0) or 0)
    per_token = getattr(config, "num_experts_per_tok", 0)
    params = tensors = active = 0
    for name, p in model.named_parameters():
        params, tensors = params + p.numel(), tensors + 1
        # a fused expert tensor (E, ., .): a token runs experts_per_token of its E experts
        active += p.numel() * per_token // experts if ".experts." in name else p.numel()
    return params, tensors, active


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_plans_count_is_transformers_count_for_each_tiny_architecture(arch: str) -> None:
    config = tiny_config(train_bpe_tokenizer(), arch, tie_word_embeddings=False).to_dict()
    model = _meta_model(config)
    shape = ModelShape.from_config(config)
    params, tensors, active = _counts(model)
    assert shape.causal_lm() == (params, tensors)
    assert shape.active_params() == active
    assert shape.is_moe == (arch in ("qwen3_moe", "qwen2_moe", "mixtral"))
    assert shape.largest_tensor_params() == max(p.numel() for p in model.parameters())
    layer0 = sum(p.numel() for n, p in model.named_parameters() if ".layers.0." in n)
    assert shape.layer_params() == layer0


@pytest.mark.parametrize(("name", "total_b", "active_b"), [
    ("qwen3-4b", 4.02, 4.02), ("qwen3-8b", 8.19, 8.19), ("qwen3-32b", 32.76, 32.76),
    ("qwen3-30b-a3b", 30.53, 3.35)])
def test_the_shipped_qwen3_configs_count_as_transformers_builds_them(name: str, total_b: float, active_b: float) -> None:
    config = json.loads((CONFIGS / name / "config.json").read_text())
    shape = ModelShape.from_config(config)
    params, tensors, active = _counts(_meta_model(config))
    assert shape.causal_lm() == (params, tensors)
    assert shape.active_params() == active
    # Qwen's published sizes: 30.5 B total and 3.3 B active for the MoE
    assert round(params / 1e9, 2) == total_b and round(active / 1e9, 2) == active_b
    if name == "qwen3-32b":   # attention wider than the hidden size: 64 heads x 128 = 8192 > 5120
        assert shape.q_width == 8192 > shape.hidden_size


def test_an_moe_is_charged_all_experts_in_memory_and_its_active_ones_in_activations_and_flops() -> None:
    tok = train_bpe_tokenizer()
    few = tiny_config(tok, "qwen3_moe", num_experts=4, experts_per_token=2)
    many = tiny_config(tok, "qwen3_moe", num_experts=16, experts_per_token=2)
    a, b = ModelShape.from_config(few.to_dict()), ModelShape.from_config(many.to_dict())
    assert b.causal_lm()[0] > a.causal_lm()[0] and b.layer_params() > a.layer_params()
    assert b.active_params() - a.active_params() == 2 * 12 * few.hidden_size   # only the router grew
    for checkpointing in (False, True):
        assert _activations(a, 1000, checkpointing, True) == _activations(b, 1000, checkpointing, True)
    # the largest tensor in memory is a layer's fused gate_up; the largest stored one an expert's projection
    assert b.largest_tensor_params() == 16 * 2 * few.moe_intermediate_size * few.hidden_size
    assert b.largest_stored_params() == few.vocab_size * few.hidden_size
    # FLOPs: 6 per active matmul weight per token; more experts at the same top-k barely move them
    fa, fb = FlopsCounter(few), FlopsCounter(many)
    dense_a, _ = fa._dense_params_and_attention_width()
    dense_b, _ = fb._dense_params_and_attention_width()
    assert dense_b - dense_a == 2 * 12 * few.hidden_size
    model = _meta_model(few.to_dict())
    # every 2-D weight but the embeddings and head (counted apart); the fused experts at 2 of their 4 experts
    matmul_active = sum(p.numel() // 2 if ".experts." in n else p.numel()
                        for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n and "lm_head" not in n)
    assert dense_a == matmul_active + 2 * few.vocab_size * few.hidden_size


def test_lora_on_an_moe_is_counted_on_attention_and_refused_on_its_experts() -> None:
    from omegaconf import OmegaConf

    config = json.loads((CONFIGS / "qwen3-30b-a3b" / "config.json").read_text())
    shape = ModelShape.from_config(config)
    attention = OmegaConf.create({"lora_rank": 64, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]})
    counts = lora_counts(shape, attention)
    q, kv, h = 32 * 128, 4 * 128, 2048
    assert counts.per_layer == 64 * ((h + q) + 2 * (h + kv) + (q + h))
    for target in ("all-linear", ["q_proj", "gate_proj"], ["experts"]):
        assert "not supported here" in moe_lora_error(shape, target)
        with pytest.raises(ValueError, match="target_modules"):
            lora_counts(shape, OmegaConf.create({"lora_rank": 8, "target_modules": target}))
    dense = ModelShape.from_config(json.loads((CONFIGS / "qwen3-8b" / "config.json").read_text()))
    assert moe_lora_error(dense, "all-linear") == ""
