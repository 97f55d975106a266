"""LoRA in the vLLM rollout: the engine serves the actor's adapter over the frozen base (`lora_sync=adapter`).

With `actor_rollout_ref.model.lora_rank > 0` and `actor_rollout_ref.rollout.lora_sync=adapter` (the
default) the engine is built with `enable_lora` and loads the BASE model from the model path once
(`load_format=auto`): the base is frozen, so its weights never travel again. After each actor update
the worker gathers the adapter (PEFT's names and format, `verl.utils.lora.save_adapter`), writes it
into this rank's folder `<root>/actor-v<version>` and every later request carries
`LoRARequest("actor-v<version>", version + 1, folder)`; the previous adapter leaves the engine and its
folder is deleted. `lora_sync=merged` is the fallback: the engine has no LoRA, and each sync streams
the full merged weights (W + scaling * B @ A) as without LoRA (docs/lora.md).

    sync = AdapterSync(engine, rank=0)
    sent = sync.publish(adapter_tensors, spec, base_model_path, version)   # bytes written for the engine
    engine.add_request(..., lora_request=sync.request)
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import weakref
from typing import Any

import torch

from verl.utils.lora import LoraSpec, save_adapter

logger = logging.getLogger(__name__)

LORA_SYNC_MODES = ("adapter", "merged")
# The ranks vLLM 0.32's LoRAConfig.max_lora_rank accepts (vllm/config/lora.py, MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as `max_lora_rank` that holds an adapter of rank `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"actor_rollout_ref.model.lora_rank={rank}: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}; "
                     "set actor_rollout_ref.rollout.lora_sync=merged to load merged weights instead")


def lora_sync_mode(rollout_cfg: Any, lora: LoraSpec | None) -> str | None:
    """How a vLLM engine gets the actor's LoRA model: 'adapter', 'merged', or None (no LoRA)."""
    if lora is None:
        return None
    mode = str(rollout_cfg.get("lora_sync", "adapter"))
    if mode not in LORA_SYNC_MODES:
        raise ValueError(f"actor_rollout_ref.rollout.lora_sync={mode!r} must be one of {list(LORA_SYNC_MODES)}")
    return mode


def lora_engine_args(lora: LoraSpec) -> dict[str, Any]:
    """The `vllm.LLM` arguments that let the engine serve the actor's adapter (one at a time)."""
    # every request carries the adapter: no second set of CUDA graphs captured for LoRA-free batches
    return {"enable_lora": True, "max_lora_rank": vllm_max_lora_rank(lora.max_rank), "max_loras": 1,
            "compilation_config": {"cudagraph_specialize_lora": False}}


def adapter_name(version: int) -> str:
    return f"actor-v{int(version)}"


def tensor_bytes(tensors: Any) -> int:
    """Bytes of a dict's or an iterable's tensors (what a sync hands the engine)."""
    values = tensors.values() if isinstance(tensors, dict) else tensors
    return sum(t.numel() * t.element_size() for t in values)


class AdapterSync:
    """This rank's adapter folders and the LoRARequest of the newest one.

    `engine`: vLLM's LLMEngine (or a stand-in with add_lora / remove_lora); `request_cls`: the
    LoRARequest class (vllm.lora.request.LoRARequest by default). Folders live under one temporary
    root per rank, removed when this object goes."""

    def __init__(self, engine: Any, rank: int = 0, root: str | None = None, request_cls: Any = None) -> None:
        if request_cls is None:
            from vllm.lora.request import LoRARequest as request_cls
        self.engine = engine
        self.request_cls = request_cls
        self.root = root or tempfile.mkdtemp(prefix=f"verl-lora-rank{rank}-")
        os.makedirs(self.root, exist_ok=True)
        self.request: Any = None
        self.version: int | None = None
        self.syncs = 0
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.root, True)

    def folder(self, version: int) -> str:
        return os.path.join(self.root, adapter_name(version))

    def publish(self, tensors: dict[str, torch.Tensor], spec: LoraSpec, base_model_path: str, version: int,
                dtype: torch.dtype | None = None) -> int:
        """Write the adapter of weights `version` (in `dtype`, the engine's, if given) and make it the one
        every later request uses; the previous one leaves the engine and the disk. Returns its bytes."""
        if dtype is not None:
            tensors = {name: t.to(dtype).contiguous() for name, t in tensors.items()}
        folder = self.folder(version)
        save_adapter(tensors, spec, base_model_path, folder)
        request = self.request_cls(adapter_name(version), int(version) + 1, folder)
        previous, self.request, self.version = self.request, request, int(version)
        if previous is not None and previous.lora_int_id != request.lora_int_id:
            self.engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        if not self.engine.add_lora(request):
            raise RuntimeError(f"vLLM refused the actor's adapter {folder}; set actor_rollout_ref.rollout.lora_sync="
                               "merged to load merged weights instead")
        self.syncs += 1
        return tensor_bytes(tensors)

    def close(self) -> None:
        self._cleanup()
