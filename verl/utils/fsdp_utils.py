"""FSDP2 helpers: wrap a Hugging Face model, build its optimizer and LR schedule, offload state.

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
    apply_fsdp2(model, mesh, mixed_precision=None)      # each decoder layer, then the root
    optimizer, scheduler = build_optimizer(model, cfg.actor.optim)
    offload_fsdp_model_to_cpu(model); load_fsdp_model_to_device(model, "cuda")
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from verl.utils.torch_functional import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A state-dict entry or parameter as the whole tensor, detached: an FSDP2 shard (DTensor) is
    gathered, which is a collective every rank of its mesh must call in the same order."""
    from torch.distributed.tensor import DTensor

    tensor = tensor.detach()
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def decoder_layer_classes(model: nn.Module) -> set[type]:
    """Classes of the transformer blocks, from HF's `_no_split_modules` (e.g. Qwen2DecoderLayer)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not classes:
        raise ValueError(f"{type(model).__name__} declares no decoder layer class in _no_split_modules; "
                         "cannot choose FSDP units")
    return classes


def apply_fsdp2(model: nn.Module, mesh: Any, mixed_precision: MixedPrecisionPolicy | None = None,
                reshard_after_forward: bool = True) -> nn.Module:
    """fully_shard each decoder layer, then the root (embeddings, norm, heads) over `mesh`."""
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mixed_precision is not None:
        kwargs["mp_policy"] = mixed_precision
    layer_classes = tuple(decoder_layer_classes(model))
    for module in list(model.modules()):
        if isinstance(module, layer_classes):
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    return model


def gpu_mixed_precision() -> MixedPrecisionPolicy:
    """bf16 compute with fp32 gradient reduction (the fp32 master copy stays sharded)."""
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def build_optimizer(module: nn.Module, optim_cfg: Any) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW from optim.{lr, betas, weight_decay} + warm-up (constant or cosine) over total_training_steps."""
    optimizer = torch.optim.AdamW(
        [p for p in module.parameters() if p.requires_grad],
        lr=float(optim_cfg.lr),
        betas=tuple(float(b) for b in optim_cfg.get("betas", (0.9, 0.999))),
        weight_decay=float(optim_cfg.get("weight_decay", 0.01)),
    )
    total_steps = int(optim_cfg.get("total_training_steps", -1))
    ratio = float(optim_cfg.get("lr_warmup_steps_ratio", 0.0))
    if ratio and total_steps <= 0:
        raise ValueError("optim.lr_warmup_steps_ratio > 0 needs optim.total_training_steps (set by the trainer)")
    warmup_steps = int(ratio * total_steps) if total_steps > 0 else 0
    style = optim_cfg.get("warmup_style", "constant")
    if style == "constant":
        scheduler = get_constant_schedule_with_warmup(optimizer, num_warmup_steps=warmup_steps)
    elif style == "cosine":
        if total_steps <= 0:
            raise ValueError("optim.warmup_style=cosine needs optim.total_training_steps (set by the trainer)")
        min_lr_ratio = optim_cfg.get("min_lr_ratio", None)
        scheduler = get_cosine_schedule_with_warmup(
            optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps,
            min_lr_ratio=0.0 if min_lr_ratio is None else float(min_lr_ratio))
    else:
        raise ValueError(f"unknown optim.warmup_style {style!r}; expected 'constant' or 'cosine'")
    return optimizer, scheduler


# --------------------------------------------------------------------------- offload
# Between calls the worker may park parameters, gradients and optimizer state in host
# memory to leave the accelerator to the rollout. On a CPU-only machine these moves are
# no-ops, but the same code runs, so the flags are exercised everywhere.

@torch.no_grad()
def offload_fsdp_model_to_cpu(module: nn.Module) -> None:
    module.to("cpu")


@torch.no_grad()
def load_fsdp_model_to_device(module: nn.Module, device: str | torch.device) -> None:
    module.to(device)


@torch.no_grad()
def offload_fsdp_grad(module: nn.Module) -> None:
    for p in module.parameters():
        if p.grad is not None:
            p.grad = p.grad.to("cpu", non_blocking=True)


@torch.no_grad()
def load_fsdp_grad(module: nn.Module, device: str | torch.device) -> None:
    for p in module.parameters():
        if p.grad is not None:
            p.grad = p.grad.to(device, non_blocking=True)


def _move_optimizer_state(optimizer: torch.optim.Optimizer, device: str | torch.device) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            # Adam's scalar step counter stays where torch created it (CPU unless capturable).
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device, non_blocking=True)


@torch.no_grad()
def offload_fsdp_optimizer(optimizer: torch.optim.Optimizer) -> None:
    _move_optimizer_state(optimizer, "cpu")


@torch.no_grad()
def load_fsdp_optimizer(optimizer: torch.optim.Optimizer, device: str | torch.device) -> None:
    _move_optimizer_state(optimizer, device)


def count_parameters(module: nn.Module) -> int:
    """Total (unsharded) parameter count of an FSDP2 or plain module."""
    return int(sum(math.prod(p.shape) for p in module.parameters()))
