"""FLOPs estimate for Qwen2-style decoders and the device peak table."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, Qwen2Config, Qwen2ForCausalLM

from verl.utils import flops_counter
from verl.utils.flops_counter import FlopsCounter, get_device_peak_flops, gpu_peak_flops_by_name

CFG = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)


def test_step_flops_by_hand():
    counter = FlopsCounter(Qwen2Config(**CFG), device="cpu")
    # head_dim 16 ; q width 64 ; kv width 32
    # attention proj = 64*(64 + 2*32) + 64*64 = 12288 ; mlp = 3*64*128 = 24576
    # dense = 2 layers * 36864 + embed/head 2*100*64 = 86528
    # seqlens [3, 5]: 6*86528*8 tokens + 12*(9+25)*64*2 layers = 4153344 + 52224
    assert counter.estimate_step_flops([3, 5]) == 4205568.0
    achieved, promised = counter.estimate_flops([3, 5], delta_time=0.5)
    # Python double arithmetic on the same integers: approx only for the division's rounding.
    assert achieved == pytest.approx(4205568.0 / 0.5 / 1e12)
    assert promised > 0


def test_dense_count_matches_real_matmul_weights():
    model = Qwen2ForCausalLM(Qwen2Config(**CFG))
    matmul_weights = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2)
    dense, _ = FlopsCounter(model.config)._dense_params_and_attention_width()
    assert dense == matmul_weights


def test_llama_supported_and_unknown_model_type_rejected():
    FlopsCounter(LlamaConfig(**CFG))
    bad = Qwen2Config(**CFG)
    bad.model_type = "gpt_neox"
    with pytest.raises(ValueError, match="gpt_neox"):
        FlopsCounter(bad)


def test_gpu_peak_table_and_cached_cpu_measurement():
    assert gpu_peak_flops_by_name("NVIDIA H100 80GB HBM3") == 989e12
    assert gpu_peak_flops_by_name("NVIDIA H200") == 989e12
    assert gpu_peak_flops_by_name("NVIDIA A100-SXM4-80GB") == 312e12
    assert gpu_peak_flops_by_name("Some Future Chip") == float("inf")
    first = get_device_peak_flops("cpu")
    assert 1e7 < first < 1e14
    assert get_device_peak_flops("cpu") == first  # measured once, then cached
    assert flops_counter._measured_cpu_peak_flops.cache_info().hits >= 1


def test_measuring_the_cpu_peak_leaves_the_global_rng_alone() -> None:
    """The workers measure their peak after seeding their sampling RNG: it must not shift it."""
    import torch

    from verl.utils.flops_counter import _measured_cpu_peak_flops

    _measured_cpu_peak_flops.cache_clear()
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    assert _measured_cpu_peak_flops(size=64, repeats=1) > 0
    assert torch.equal(torch.rand(4), expected)
