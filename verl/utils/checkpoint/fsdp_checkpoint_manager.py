"""Sharded, resumable checkpoints of an FSDP2 model, its optimizer and its LR schedule.
(A LoRA model's checkpoint holds its adapter and the adapter's optimizer state; the frozen base is
the model path's, loaded at start-up.)

Each rank writes only its own shard of the model and optimizer through
torch.distributed.checkpoint (DCP); the full state is never gathered on one
process. Per-rank extra state (LR scheduler, torch / numpy / python RNG) goes
into `extra_state_rank{r}.pt`. The driver chooses the folder (step directory,
atomic rename, keep-last-K); this class only writes into it.

    manager = FSDPCheckpointManager(model, optimizer, lr_scheduler, tokenizer)
    manager.save_checkpoint("ckpt/global_step_10/actor", global_step=10, hf_path=".../huggingface")
    manager.load_checkpoint("ckpt/global_step_10/actor")
"""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from verl.utils.checkpoint.hf_export import HF_MAX_SHARD_MB, export_hf_model

DCP_DIR = "dcp"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class FSDPCheckpointManager:
    """Save / load model + optimizer shards (DCP) and per-rank scheduler + RNG state."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 lr_scheduler: Any = None, tokenizer: Any = None, hf_max_shard_mb: float = HF_MAX_SHARD_MB,
                 lora: Any = None, base_model_path: str | None = None) -> None:
        self.model = model
        # LoRA (a verl.utils.lora.LoraSpec): the HF export is the adapter (PEFT's files) over base_model_path
        self.lora = lora
        self.base_model_path = base_model_path
        self.hf_max_shard_mb = hf_max_shard_mb
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.tokenizer = tokenizer

    def _state_dicts(self) -> dict[str, Any]:
        options = StateDictOptions(full_state_dict=False)
        model_state = get_model_state_dict(self.model, options=options)
        if self.lora is not None:   # the frozen base comes from model.path at start-up: the adapter alone
            from verl.utils.lora import is_adapter_param

            model_state = {k: v for k, v in model_state.items() if is_adapter_param(k)}
        state = {"model": model_state}
        if self.optimizer is not None:
            state["optimizer"] = get_optimizer_state_dict(self.model, self.optimizer, options=options)
        return state

    def save_checkpoint(self, local_path: str, global_step: int = 0, hf_path: str | None = None,
                        merged_hf_path: str | None = None) -> None:
        """Write this rank's shards into `local_path` (created); every rank must call it. `hf_path`:
        the HF export (LoRA: the adapter, adapter_model.safetensors + adapter_config.json, and the
        tokenizer); `merged_hf_path` (LoRA only): the adapter merged into the base, a full HF model."""
        rank = _rank()
        os.makedirs(local_path, exist_ok=True)
        dcp.save(self._state_dicts(), checkpoint_id=os.path.join(local_path, DCP_DIR))
        extra = {
            "global_step": global_step,
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "rng": get_rng_state(),
        }
        torch.save(extra, os.path.join(local_path, f"extra_state_rank{rank}.pt"))
        if hf_path is not None and self.lora is not None:
            self._export_adapter(hf_path)
        elif hf_path is not None:
            export_hf_model(self.model, self.tokenizer, hf_path, max_shard_mb=self.hf_max_shard_mb)
        if merged_hf_path is not None:
            if self.lora is None:
                raise ValueError("merged_hf_path is for a LoRA model (actor_rollout_ref.model.lora_rank > 0)")
            from verl.utils.lora import merged_state

            export_hf_model(self.model, self.tokenizer, merged_hf_path, max_shard_mb=self.hf_max_shard_mb,
                            state=merged_state(self.model))
        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    def _export_adapter(self, out_dir: str) -> None:
        from verl.utils.lora import adapter_state, save_adapter

        tensors = adapter_state(self.model)   # collective: every rank gathers
        if _rank() == 0:
            save_adapter(tensors, self.lora, str(self.base_model_path), out_dir)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(out_dir)

    def load_checkpoint(self, local_path: str) -> int:
        """Restore model, optimizer, scheduler and RNG from `local_path`; returns the saved global step."""
        rank = _rank()
        dcp_path = os.path.join(local_path, DCP_DIR)
        extra_path = os.path.join(local_path, f"extra_state_rank{rank}.pt")
        for path in (dcp_path, extra_path):
            if not os.path.exists(path):
                raise FileNotFoundError(f"checkpoint {local_path!r} has no {os.path.basename(path)} "
                                        f"(saved with a different world size, or not a checkpoint folder?)")
        state = self._state_dicts()
        dcp.load(state, checkpoint_id=dcp_path)
        set_model_state_dict(self.model, state["model"],
                             options=StateDictOptions(full_state_dict=False, strict=self.lora is None))
        if self.optimizer is not None:
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"],
                                     options=StateDictOptions(full_state_dict=False))
        extra = torch.load(extra_path, weights_only=False)
        if self.lr_scheduler is not None and extra["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        set_rng_state(extra["rng"])
        return int(extra["global_step"])
