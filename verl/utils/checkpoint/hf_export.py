"""Export an FSDP2-sharded model as a Hugging Face folder (config + tokenizer + safetensors).

Parameters are gathered one at a time (`full_tensor()`, a collective every rank
joins) and rank 0 appends each to the current safetensors shard, writing the
shard out once it passes `max_shard_mb`. Peak host memory is about one shard,
never the whole model. The folder loads with `AutoModelForCausalLM.from_pretrained`. Tensors are
written under the names `save_pretrained` writes (verl/utils/checkpoint/name_map.py): transformers
5's fused experts split back into the per-expert tensors of the model's Hub checkpoints, which
every loader (vLLM's, older transformers', this project's) reads.

Export dtype (`export_dtype`), first match wins:
1. the `dtype` argument;
2. the dtype training computed in: FSDP2's mixed-precision `param_dtype` (bf16 on GPU, where
   the workers keep fp32 master weights and compute in bf16);
3. bf16 when the source checkpoint's config says so (`dtype` / `torch_dtype` in the
   config.json the model was loaded from, e.g. Qwen2.5's): the workers load in fp32, which
   overwrites the in-memory `config.dtype`, so the file is read;
4. otherwise the parameters' own dtype (fp32 on the CPU demo, whose model config says fp32).
Floating tensors are cast, integer buffers are kept, and the exported config.json states the
export dtype, so `from_pretrained(path, dtype="auto")` loads what was written. A bf16 export
is half the size of an fp32 one and is what vLLM and `infer.py` load anyway.

    export_hf_model(fsdp_module, tokenizer, "ckpt/global_step_10/actor/huggingface")
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from verl.utils.checkpoint.name_map import NameMap

INDEX_NAME = "model.safetensors.index.json"
# The safetensors file bound of an HF export (MiB): FSDPCheckpointManager's default, and what the host memory
# plan stages on rank 0 (verl/utils/host_memory_plan.py reads it here, without the checkpoint manager).
HF_MAX_SHARD_MB = 1024


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _training_param_dtype(module: nn.Module) -> torch.dtype | None:
    """FSDP2's mixed-precision compute dtype for ``module`` (None without FSDP2 or a policy)."""
    get_state = getattr(module, "_get_fsdp_state", None)  # fully_shard; torch has no public getter
    if get_state is None:
        return None
    policy = getattr(get_state(), "_mp_policy", None)
    return getattr(policy, "param_dtype", None)


def _declared_dtype(config: Any) -> str | None:
    """The dtype named by the config.json the model was loaded from (its local folder or the
    hub cache, never the network); else the in-memory config's."""
    source = getattr(config, "_name_or_path", "") or ""
    path = os.path.join(source, "config.json")
    if source and not os.path.isfile(path):
        try:
            from transformers.utils import cached_file

            path = cached_file(source, "config.json", local_files_only=True,
                               _raise_exceptions_for_missing_entries=False) or ""
        except (OSError, ValueError):
            path = ""
    if source and path and os.path.isfile(path):
        with open(path) as f:
            saved = json.load(f)
        declared = saved.get("dtype") or saved.get("torch_dtype")
    else:
        declared = getattr(config, "dtype", None)
    return str(declared).removeprefix("torch.") if declared is not None else None


def export_dtype(module: nn.Module, dtype: torch.dtype | None = None) -> torch.dtype | None:
    """The dtype `export_hf_model` writes floating tensors in (module docstring); None keeps each
    parameter's own dtype."""
    if dtype is not None:
        return dtype
    trained = _training_param_dtype(module)
    if trained is not None:
        return trained
    if _declared_dtype(module.config) == "bfloat16":
        return torch.bfloat16
    return None


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
                    max_shard_mb: float = HF_MAX_SHARD_MB, state: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
    """Write `module` (FSDP2 or plain) to `out_dir` in HF format, floating tensors in
    `export_dtype(module, dtype)`. Every rank must call this. `state`: (checkpoint name, tensor)
    to write instead of the module's state dict (a LoRA model's merged weights, verl/utils/lora.py)."""
    rank = _rank()
    dtype = export_dtype(module, dtype)
    writer = _ShardWriter(out_dir, int(max_shard_mb * 1024**2)) if rank == 0 else None
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
    config = module.config
    names_map = NameMap.of(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for name, tensor in (module.state_dict().items() if state is None else state):
        if tied and name.endswith("lm_head.weight"):
            # HF re-ties the head to the embeddings on load; storing it twice only costs space.
            # (The same decision on every rank, so the gathers below still line up.)
            continue
        full = _full(tensor)  # collective: every rank, same order
        if writer is None:
            del full
            continue
        # Stored as save_pretrained stores it: fused experts split per expert (checkpoint/name_map.py).
        for stored_name, part in names_map.to_checkpoint(name, full):
            writer.add(stored_name, part.to(dtype) if dtype is not None and part.is_floating_point() else part)
    if writer is not None:
        writer.flush()
        writer.write_index()
        if dtype is not None:
            config = copy.deepcopy(config)  # the live model's config stays as it is
            config.dtype = dtype
        config.save_pretrained(out_dir)
        generation_config = getattr(module, "generation_config", None)
        if generation_config is not None:
            generation_config.save_pretrained(out_dir)
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
