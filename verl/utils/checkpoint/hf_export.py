"""Export an FSDP2-sharded model as a Hugging Face folder (config + tokenizer + safetensors).

Parameters are gathered one at a time (`full_tensor()`, a collective every rank
joins) and rank 0 appends each to the current safetensors shard, writing the
shard out once it passes `max_shard_mb`. Peak host memory is about one shard,
never the whole model. The folder loads with `AutoModelForCausalLM.from_pretrained`.

    export_hf_model(fsdp_module, tokenizer, "ckpt/global_step_10/actor/huggingface")
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

INDEX_NAME = "model.safetensors.index.json"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class _ShardWriter:
    """Rank 0's side: collect tensors, flush a numbered shard whenever it is full."""

    def __init__(self, out_dir: str, max_shard_bytes: int) -> None:
        self.out_dir = out_dir
        self.max_shard_bytes = max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.weight_map: dict[str, str] = {}
        self.total_bytes = 0
        self.shard_index = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.pending[name] = tensor.detach().to("cpu").contiguous()
        self.pending_bytes += tensor.numel() * tensor.element_size()
        if self.pending_bytes >= self.max_shard_bytes:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        self.shard_index += 1
        filename = f"model-{self.shard_index:05d}.safetensors"
        save_file(self.pending, os.path.join(self.out_dir, filename), metadata={"format": "pt"})
        for name in self.pending:
            self.weight_map[name] = filename
        self.total_bytes += self.pending_bytes
        self.pending, self.pending_bytes = {}, 0

    def write_index(self) -> None:
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(self.weight_map.items()))}
        with open(os.path.join(self.out_dir, INDEX_NAME), "w") as f:
            json.dump(index, f, indent=2)


def export_hf_model(module: nn.Module, tokenizer: Any, out_dir: str, dtype: torch.dtype | None = None,
                    max_shard_mb: float = 1024) -> None:
    """Write `module` (FSDP2 or plain) to `out_dir` in HF format. Every rank must call this."""
    rank = _rank()
    writer = _ShardWriter(out_dir, int(max_shard_mb * 1024**2)) if rank == 0 else None
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
    config = module.config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for name, tensor in module.state_dict().items():
        if tied and name.endswith("lm_head.weight"):
            # HF re-ties the head to the embeddings on load; storing it twice only costs space.
            # (The same decision on every rank, so the gathers below still line up.)
            continue
        full = _full(tensor)  # collective: every rank, same order
        if writer is None:
            del full
            continue
        writer.add(name, full.to(dtype) if dtype is not None and full.is_floating_point() else full)
    if writer is not None:
        writer.flush()
        writer.write_index()
        config.save_pretrained(out_dir)
        generation_config = getattr(module, "generation_config", None)
        if generation_config is not None:
            generation_config.save_pretrained(out_dir)
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
