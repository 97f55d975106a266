"""Rollout engines, chosen by `actor_rollout_ref.rollout.name`."""

from __future__ import annotations

import importlib.util
from typing import Any

from torch import nn

from .base import BaseRollout
from .hf_rollout import HFRollout

__all__ = ["BaseRollout", "HFRollout", "build_rollout"]


def build_rollout(config: Any, module: nn.Module, tokenizer: Any) -> BaseRollout:
    """`hf` -> HFRollout over the actor's module; `vllm` -> the GPU engine (optional extra).

    The vLLM seam: a `verl/workers/rollout/vllm_rollout.py` with a `vLLMRollout(module,
    config, tokenizer)` implementing BaseRollout, plus a sharding manager that syncs the
    FSDP weights into the engine, plugs in here.
    """
    name = config.get("name", "hf")
    if name == "hf":
        return HFRollout(module, config, tokenizer)
    if name == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise ImportError("actor_rollout_ref.rollout.name=vllm needs the `vllm` package "
                              "(pip install vllm, GPU only); use rollout.name=hf otherwise")
        try:
            from .vllm_rollout import vLLMRollout  # type: ignore[import-not-found]
        except ImportError as err:
            raise NotImplementedError(
                "actor_rollout_ref.rollout.name=vllm: the vLLM rollout (verl/workers/rollout/vllm_rollout.py) "
                "is not part of this build; use rollout.name=hf") from err
        return vLLMRollout(module, config, tokenizer)
    raise ValueError(f"unknown actor_rollout_ref.rollout.name {name!r}; expected 'hf' or 'vllm'")
