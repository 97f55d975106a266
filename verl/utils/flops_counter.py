"""Model FLOPs per training step, and the device's peak, for an MFU metric.

The count is the usual dense-transformer estimate: 6 FLOPs per parameter per
token (forward + backward) for every matmul weight, plus the attention score
and value products, which grow with the square of each sequence's length.
A mixture-of-experts layer counts the experts a token runs (experts_per_token
of them, and the router), not all of them: MFU is over *active* parameters
(the memory plan's count, verl/utils/memory_plan.py `ModelShape`).
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch

# bf16 dense tensor-core peaks (no sparsity), FLOP/s. Matched as substrings of
# torch.cuda.get_device_name(); the more specific names come first.
_GPU_PEAK_BF16 = (
    ("H200", 989e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("H20", 148e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("A10", 125e12),
    ("4090", 165e12),
)

SUPPORTED_MODEL_TYPES = ("qwen2", "llama", "qwen2_5", "mistral", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral")


def gpu_peak_flops_by_name(name: str) -> float:
    """bf16 dense peak for a GPU name; inf when unknown (so MFU reads 0 rather than a wrong number)."""
    for key, flops in _GPU_PEAK_BF16:
        if key in name:
            return flops
    return float("inf")


@functools.lru_cache(maxsize=1)
def _measured_cpu_peak_flops(size: int = 512, repeats: int = 5) -> float:
    """Best fp32 matmul throughput of a few square matmuls; measured once per process."""
    # Its own generator: measuring the peak must not move the worker's sampling RNG.
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator)
    b = torch.randn(size, size, generator=generator)
    torch.mm(a, b)  # warm-up: first call pays for allocation and thread start-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / max(best, 1e-9)


def get_device_peak_flops(device: str | torch.device = "cpu") -> float:
    """Peak FLOP/s of `device`: a table by GPU name, or a measured fp32 matmul peak on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return gpu_peak_flops_by_name(torch.cuda.get_device_name(device))
    if device.type == "cpu":
        return _measured_cpu_peak_flops()
    raise ValueError(f"no peak-FLOPs estimate for device type {device.type!r}")


class FlopsCounter:
    """FLOPs of a Qwen2 / Qwen3 / Llama-style decoder, dense or MoE (active parameters); `estimate_flops`
    gives achieved and peak TFLOP/s."""

    def __init__(self, hf_config: Any, device: str | torch.device | None = None) -> None:
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"FlopsCounter: config.model_type {model_type!r} not in {SUPPORTED_MODEL_TYPES}")
        self.config = hf_config
        self.device = device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")

    def _dense_params_and_attention_width(self) -> tuple[int, int]:
        cfg = self.config
        hidden = cfg.hidden_size
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or hidden // heads
        q_width, kv_width = heads * head_dim, kv_heads * head_dim
        attn_proj = hidden * (q_width + 2 * kv_width) + q_width * hidden   # q, k, v, o
        # gate, up, down of the MLP a token runs (MoE: its experts and the shared one) and the router
        from verl.utils.memory_plan import ModelShape

        shape = ModelShape.from_config(cfg.to_dict())
        mlp = 3 * hidden * shape.active_intermediate_size + shape.num_experts * hidden
        # Embedding lookup costs no matmul, but counting it with the LM head matches
        # the convention of veRL / Megatron reports, so numbers stay comparable.
        embed_and_head = 2 * cfg.vocab_size * hidden
        return (attn_proj + mlp) * cfg.num_hidden_layers + embed_and_head, q_width * cfg.num_hidden_layers

    def estimate_step_flops(self, batch_seqlens: list[int]) -> float:
        """Total FLOPs of one forward + backward over sequences of the given lengths."""
        dense_params, attention_width = self._dense_params_and_attention_width()
        tokens = sum(batch_seqlens)
        square_sum = sum(length * length for length in batch_seqlens)
        # QK^T and AV: 2 matmuls x 2 FLOPs x 3 (fwd + bwd) = 12 per (query, key, channel).
        return 6.0 * dense_params * tokens + 12.0 * square_sum * attention_width

    def estimate_flops(self, batch_seqlens: list[int], delta_time: float) -> tuple[float, float]:
        """(achieved TFLOP/s over `delta_time` seconds, the device's peak TFLOP/s)."""
        if delta_time <= 0:
            raise ValueError(f"estimate_flops: delta_time must be > 0, got {delta_time}")
        achieved = self.estimate_step_flops(batch_seqlens) / delta_time / 1e12
        promised = get_device_peak_flops(self.device) / 1e12
        return achieved, promised
