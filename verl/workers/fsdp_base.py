"""What both FSDP2 workers share (verl/workers/fsdp_workers.py, verl/workers/critic_worker.py): the
process group and device mesh, model preparation and FSDP2 wrapping, the sharded checkpoint load,
and moving params / grads / optimizer state to the host between calls (`*_offload` keys)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from verl.single_controller.base import Worker
from verl.utils import device as device_utils
from verl.utils import fsdp_utils
from verl.utils.attention import attn_implementation
from verl.utils.device import get_device_name, get_dist_backend
from verl.utils.lora import LoraSpec
from verl.utils.sharded_init import load_sharded_model


class FSDPWorkerBase(Worker):
    """Process-group set-up, model wrapping and offload shared by both workers."""

    def _init_distributed(self) -> None:
        if not dist.is_initialized():
            dist.init_process_group(backend=get_dist_backend(), rank=self.rank, world_size=self.world_size)
        self.device = get_device_name()
        if self.device == "cuda":
            # Ray may show each actor only its own GPU, which is then cuda:0.
            torch.cuda.set_device(self.local_rank % torch.cuda.device_count())
        self.device_mesh = init_device_mesh(self.device, (self.world_size,), mesh_dim_names=("fsdp",))

    def _attn_implementation(self, model_cfg: Any) -> str | None:
        """The registered packed attention (verl/utils/attention.py) when the model packs; sdpa otherwise."""
        return attn_implementation(self.device, bool(model_cfg.get("use_remove_padding", False)),
                                   str(model_cfg.get("packing_kernel", "varlen_attn")))

    def _prepare(self, module: nn.Module, model_cfg: Any, trainable: bool, lora: LoraSpec | None = None) -> None:
        """Gradient checkpointing, freezing, LoRA's adapters: what must be set before FSDP2 wraps the
        model. With LoRA the frozen base is kept in the compute dtype (bf16 on GPUs: no fp32 master
        copy of weights nobody trains); the fp32 adapter is all that requires grad."""
        if trainable and model_cfg.get("enable_gradient_checkpointing", False):
            module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if not trainable:
            module.requires_grad_(False)
        elif lora is not None:
            lora.inject(module, frozen_dtype=torch.bfloat16 if self.device == "cuda" else None)

    def _wrap(self, module: nn.Module, model_cfg: Any, trainable: bool) -> nn.Module:
        """An already loaded model: prepared, then FSDP2 over every decoder layer and the root."""
        self._prepare(module, model_cfg, trainable)
        mixed_precision = fsdp_utils.gpu_mixed_precision() if self.device == "cuda" else None
        module = fsdp_utils.apply_fsdp2(module, self.device_mesh, mixed_precision)
        if self.device == "cuda":
            module.to(self.device)
        return module

    def _load_sharded(self, build: Callable[[], nn.Module], model_cfg: Any, trainable: bool,
                      lora: LoraSpec | None = None) -> nn.Module:
        """`build()` on the meta device, prepared and sharded with FSDP2; rank 0 alone reads the
        checkpoint and streams it to every rank's shard (verl/utils/sharded_init.py: no rank ever
        holds the whole model). Weights the checkpoint lacks (the value head) are seeded with 0."""
        mixed_precision = fsdp_utils.gpu_mixed_precision() if self.device == "cuda" else None
        device = torch.device("cuda", torch.cuda.current_device()) if self.device == "cuda" else torch.device("cpu")
        module, _ = load_sharded_model(build, model_cfg.path, self.device_mesh, device,
                                       prepare=lambda m: self._prepare(m, model_cfg, trainable, lora),
                                       mixed_precision=mixed_precision, seed=0, adapter=lora)
        return module

    # Offload: params / grads / optimizer state live on the host between calls when asked.
    def _onload(self, module: nn.Module, optimizer: torch.optim.Optimizer | None, fsdp_cfg: Any) -> None:
        if fsdp_cfg.get("param_offload", False):
            fsdp_utils.load_fsdp_model_to_device(module, self.device)
        if fsdp_cfg.get("grad_offload", False):
            fsdp_utils.load_fsdp_grad(module, self.device)
        if optimizer is not None and fsdp_cfg.get("optimizer_offload", False):
            fsdp_utils.load_fsdp_optimizer(optimizer, self.device)

    def _offload(self, module: nn.Module, optimizer: torch.optim.Optimizer | None, fsdp_cfg: Any) -> None:
        if fsdp_cfg.get("param_offload", False):
            fsdp_utils.offload_fsdp_model_to_cpu(module)
        if fsdp_cfg.get("grad_offload", False):
            fsdp_utils.offload_fsdp_grad(module)
        if optimizer is not None and fsdp_cfg.get("optimizer_offload", False):
            fsdp_utils.offload_fsdp_optimizer(optimizer)
        if any(fsdp_cfg.get(key, False) for key in ("param_offload", "grad_offload", "optimizer_offload")):
            device_utils.empty_cache()   # what moved to host memory is free for other processes now

    def _require(self, flag: bool, method: str) -> None:
        """Refuse a method this worker's role does not serve, naming both."""
        if not flag:
            raise RuntimeError(f"{method} is not available for role {getattr(self, 'role', None)!r}")
