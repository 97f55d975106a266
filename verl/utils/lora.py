"""LoRA on the FSDP2 actor with Hugging Face PEFT (`actor_rollout_ref.model.lora_rank > 0`, veRL's keys).

    spec = LoraSpec.from_model_config(cfg.actor_rollout_ref.model)   # None when lora_rank == 0
    module = build_causal_lm(...)                                     # on the meta device
    spec.inject(module, frozen_dtype=torch.bfloat16)                  # before FSDP2 wraps it

- `inject` puts PEFT's LoRA layers into the Hugging Face model in place
  (`peft.inject_adapter_in_model`: the model keeps its class, so gradient checkpointing, FSDP2's
  per-layer wrapping and `base_model_prefix` work as without LoRA). Every parameter but the
  adapter's is frozen and cast to `frozen_dtype` (bf16 on GPUs: no fp32 master copy of frozen
  weights); the adapter stays fp32 and is all the optimizer sees (it takes requires_grad params).
- The sharded load (verl/utils/sharded_init.py) reads the base weights under their checkpoint names
  (`checkpoint_name`: PEFT's `.base_layer` dropped) and initialises the adapter as PEFT does
  (`init_adapter`: lora_A Kaiming-uniform, lora_B zero, so the adapted model starts as the base),
  or from `lora_adapter_path`'s adapter_model.safetensors.
- `adapter_disabled(module)`: the base model (the reference policy's log-probs, no second model).
- `merged_state(module)`: full (gathered) weights with W + scaling * B @ A under checkpoint names:
  what a vLLM engine without LoRA loads (merge-and-load).
- `save_adapter(module, folder)`: adapter_model.safetensors + adapter_config.json, PEFT's format
  (`PeftModel.from_pretrained(base, folder)` reads it; so does infer.py).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

ADAPTER_NAME = "default"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."   # PeftModel.save_pretrained's key prefix


def import_peft() -> Any:
    """The peft package, or an error saying how to install it (LoRA is the only user)."""
    try:
        import peft
    except ImportError as err:
        raise ImportError("actor_rollout_ref.model.lora_rank > 0 needs Hugging Face PEFT: "
                          "`pip install peft -c requirements-lock.txt` (it is in requirements.txt)") from err
    return peft


def is_adapter_param(name: str) -> bool:
    """A LoRA adapter parameter's name (lora_A / lora_B of any adapter)."""
    return ".lora_A." in name or ".lora_B." in name


def checkpoint_name(name: str) -> str:
    """A LoRA-injected model's parameter name as the base checkpoint spells it."""
    return name.replace(".base_layer.", ".")


@dataclass(frozen=True)
class LoraSpec:
    """What LoRA to put into the actor: veRL's keys, read once."""

    rank: int
    alpha: float
    target_modules: Any          # "all-linear" or a list of module names
    exclude_modules: Any = None
    adapter_path: str | None = None

    @classmethod
    def from_model_config(cls, model_cfg: Any) -> LoraSpec | None:
        """None when `lora_rank` is 0 (LoRA off). With `lora_adapter_path`, the adapter's own
        adapter_config.json gives rank, alpha and target modules (its weights must fit them)."""
        rank = int(model_cfg.get("lora_rank", 0) or 0)
        if rank <= 0:
            return None
        adapter_path = model_cfg.get("lora_adapter_path")
        target = model_cfg.get("target_modules", "all-linear")
        target = target if isinstance(target, str) else [str(t) for t in target]
        exclude = model_cfg.get("exclude_modules")
        exclude = exclude if exclude is None or isinstance(exclude, str) else [str(t) for t in exclude]
        alpha = float(model_cfg.get("lora_alpha", 16))
        if adapter_path:
            saved = read_adapter_config(str(adapter_path))
            rank, alpha = int(saved["r"]), float(saved["lora_alpha"])
            target, exclude = saved.get("target_modules", target), saved.get("exclude_modules", exclude)
            if isinstance(target, list):
                target = sorted(target)
        return cls(rank, alpha, target, exclude, str(adapter_path) if adapter_path else None)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def peft_config(self) -> Any:
        peft = import_peft()
        kwargs: dict[str, Any] = {"r": self.rank, "lora_alpha": self.alpha, "target_modules": self.target_modules,
                                  "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM"}
        if self.exclude_modules is not None:
            kwargs["exclude_modules"] = self.exclude_modules
        return peft.LoraConfig(**kwargs)

    def inject(self, module: nn.Module, frozen_dtype: torch.dtype | None = None) -> nn.Module:
        """PEFT's LoRA layers into `module` in place; everything else frozen (in `frozen_dtype` if
        given). Works on a model whose parameters are on the meta device."""
        peft = import_peft()
        try:
            peft.inject_adapter_in_model(self.peft_config(), module, adapter_name=ADAPTER_NAME)
        except ValueError as err:   # PEFT's own message does not name our key
            raise ValueError(f"actor_rollout_ref.model.target_modules={self.target_modules!r} / exclude_modules="
                             f"{self.exclude_modules!r} matched no module of {type(module).__name__}: {err}") from err
        adapters = 0
        for name, param in module.named_parameters():
            if is_adapter_param(name):
                param.requires_grad_(True)
                adapters += 1
            else:
                param.requires_grad_(False)
                if frozen_dtype is not None and param.dtype != frozen_dtype and param.is_floating_point():
                    param.data = param.data.to(frozen_dtype)
        if adapters == 0:
            raise ValueError(f"actor_rollout_ref.model.target_modules={self.target_modules!r} matched no module of "
                             f"{type(module).__name__}: LoRA would train nothing")
        return module

    def init_adapter(self, owner_name: str, replica: nn.Module) -> bool:
        """Initialise one adapter linear (`owner_name` ends in lora_A.<adapter> or lora_B.<adapter>),
        a CPU replica: from `adapter_path` if given, else as PEFT does (A Kaiming-uniform, B zero).
        False for a module that is no adapter linear."""
        part = owner_name.rsplit(".", 2)
        if len(part) < 3 or part[1] not in ("lora_A", "lora_B"):
            return False
        weight = replica.weight
        if self.adapter_path:
            saved = _adapter_tensors(self.adapter_path)
            key = f"{_PEFT_PREFIX}{part[0]}.{part[1]}.weight"
            if key not in saved:
                raise ValueError(f"actor_rollout_ref.model.lora_adapter_path={self.adapter_path}: no tensor {key} "
                                 "(the adapter was trained on another model or other target_modules)")
            if tuple(saved[key].shape) != tuple(weight.shape):
                raise ValueError(f"lora_adapter_path: {key} has shape {tuple(saved[key].shape)}, the model's "
                                 f"adapter {tuple(weight.shape)}")
            weight.data.copy_(saved[key])
        elif part[1] == "lora_A":
            nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        else:
            nn.init.zeros_(weight)
        return True


_ADAPTER_CACHE: dict[tuple[str, float], dict[str, torch.Tensor]] = {}


def _adapter_tensors(folder: str) -> dict[str, torch.Tensor]:
    """A saved adapter's tensors under PeftModel.save_pretrained's keys, read once per file version
    (one load initialises every adapter linear from it)."""
    path = os.path.join(folder, ADAPTER_WEIGHTS)
    key = (os.path.abspath(path), os.path.getmtime(path))
    if key not in _ADAPTER_CACHE:
        from safetensors.torch import load_file

        _ADAPTER_CACHE.clear()   # only the latest adapter stays in memory
        _ADAPTER_CACHE[key] = {k if k.startswith(_PEFT_PREFIX) else _PEFT_PREFIX + k: v
                               for k, v in load_file(path).items()}
    return _ADAPTER_CACHE[key]


def read_adapter_config(folder: str) -> dict[str, Any]:
    """A saved adapter's adapter_config.json, checked to be a LoRA adapter with its weights beside it."""
    path = os.path.join(folder, ADAPTER_CONFIG)
    if not os.path.isfile(path) or not os.path.isfile(os.path.join(folder, ADAPTER_WEIGHTS)):
        raise FileNotFoundError(f"{folder}: a LoRA adapter folder holds {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    with open(path) as f:
        config = json.load(f)
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"{path}: peft_type={config.get('peft_type')!r}, not a LoRA adapter")
    return config


def lora_layers(module: nn.Module) -> list[nn.Module]:
    peft = import_peft()
    return [m for m in module.modules() if isinstance(m, peft.tuners.lora.LoraLayer)]


def has_lora(module: nn.Module) -> bool:
    return any(is_adapter_param(name) for name, _ in module.named_parameters())


@contextmanager
def adapter_disabled(module: nn.Module) -> Iterator[None]:
    """Inside: `module` computes as its base model (every LoRA layer bypassed). The flag PEFT's own
    `disable_adapter()` sets, without its requires_grad toggling (the FSDP2 parameters stay as they are)."""
    layers = lora_layers(module)
    before = [layer._disable_adapters for layer in layers]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer, was in zip(layers, before):
            layer._disable_adapters = was


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach()


def lora_scalings(module: nn.Module) -> dict[str, float]:
    """alpha / r of each LoRA-wrapped module, by its name."""
    return {name: float(layer.scaling[ADAPTER_NAME]) for name, layer in module.named_modules()
            if hasattr(layer, "lora_A") and ADAPTER_NAME in getattr(layer, "scaling", {})}


def merged_weight(name: str, full: torch.Tensor, state: dict[str, torch.Tensor],
                  scaling: dict[str, float]) -> torch.Tensor | None:
    """W + scaling * B @ A in fp32 when `name` is a LoRA-wrapped linear's base weight (`full`: that
    weight gathered; the adapter's factors are gathered from `state`, a collective), else None."""
    owner, _, local = name.rpartition(".base_layer.")
    if local != "weight" or owner not in scaling:
        return None
    a = _full(state[f"{owner}.lora_A.{ADAPTER_NAME}.weight"]).float()
    b = _full(state[f"{owner}.lora_B.{ADAPTER_NAME}.weight"]).float()
    return full.float() + scaling[owner] * (b @ a)


def merged_state(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, full tensor) of the adapted model: each LoRA-wrapped weight merged
    (W + scaling * B @ A, in W's dtype), the adapters left out; other entries as they are. Every rank
    must iterate it to the end (gathering a shard is a collective)."""
    state = module.state_dict()
    scaling = lora_scalings(module)
    for name, tensor in state.items():
        if is_adapter_param(name):
            continue
        full = _full(tensor)
        merged = merged_weight(name, full, state, scaling)
        yield checkpoint_name(name), full if merged is None else merged.to(full.dtype)


def adapter_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's full tensors under PeftModel.save_pretrained's keys (a collective, as merged_state)."""
    out = {}
    for name, tensor in module.state_dict().items():
        if is_adapter_param(name):
            key = name.replace(f".{ADAPTER_NAME}.", ".")
            out[_PEFT_PREFIX + key] = _full(tensor).float().contiguous().cpu()
    return out


def save_adapter(tensors: dict[str, torch.Tensor], spec: LoraSpec, base_model_path: str, folder: str) -> None:
    """adapter_model.safetensors + adapter_config.json (PEFT's format) into `folder`."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, ADAPTER_WEIGHTS))
    config = spec.peft_config()
    config.base_model_name_or_path = base_model_path
    config.save_pretrained(folder)
