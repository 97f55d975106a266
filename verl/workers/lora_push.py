"""What a pipelined run's weight push sends when the actor trains LoRA (`actor_rollout_ref.model.lora_rank > 0`).

The push itself is verl/workers/weight_sync.py (manifest, gather, broadcast); this module picks its
tensors. The rollout pool's engine decides (`push_mode`), the driver hands the mode to the train pool
with the manifest (`PushManifest.mode`):

- `full`: no LoRA; the actor's weights (weight_sync.push_state).
- `adapter`: vLLM with `rollout.lora_sync=adapter`. The engine was built with `enable_lora` and loaded
  the frozen base from `model.path` once; a push carries only the adapter's tensors under PEFT's names
  (as `verl.utils.lora.adapter_state` / `save_adapter` write them), in the engine's dtype; the rollout
  rank writes them as its version's adapter folder and every later request carries its LoRARequest
  (verl/workers/rollout/vllm_lora.py). Bytes: sum over targeted linears of r * (in + out) * dtype bytes.
- `merged`: the HF engine (a plain module without LoRA) or `lora_sync=merged`; the full weights with
  each adapted linear merged (W + scaling * B @ A) under the base checkpoint's names.

    mode = push_mode(lora, engine_is_vllm, lora_sync)            # on a rollout rank
    manifest = lora_push_manifest(actor_module, dtype, mode)     # train pool, no collective
    sent = send_state(group, lora_push_state(actor_module, mode), manifest, device)
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from verl.utils.fsdp_utils import full_tensor
from verl.utils.lora import ADAPTER_NAME, LoraSpec, is_adapter_param, lora_scalings, merged_weight
from verl.utils.lora import checkpoint_name as lora_checkpoint_name
from verl.workers.weight_sync import PushManifest, TensorSpec, checkpoint_name, push_manifest, push_state

PUSH_MODES = ("full", "adapter", "merged")
_PEFT_PREFIX = "base_model.model."


def push_mode(lora: LoraSpec | None, adapter_engine: bool) -> str:
    """A rollout engine's push mode: `full` without LoRA, `adapter` where the engine serves the
    adapter over its own base (vLLM, lora_sync=adapter), else `merged`."""
    if lora is None:
        return "full"
    return "adapter" if adapter_engine else "merged"


def adapter_push_name(name: str) -> str:
    """A LoRA parameter's state-dict name as PEFT's adapter file spells it."""
    return _PEFT_PREFIX + checkpoint_name(name).replace(f".{ADAPTER_NAME}.", ".")


def merged_push_name(name: str) -> str:
    """A LoRA-injected module's frozen entry under the base checkpoint's name."""
    return checkpoint_name(lora_checkpoint_name(name))


def _distinct(module: nn.Module) -> list[tuple[str, torch.Tensor, list[str]]]:
    """(raw name, tensor, raw names of the same tensor) per distinct state-dict tensor, in order."""
    first: dict[int, tuple[str, torch.Tensor, list[str]]] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in first:
            first[id(tensor)][2].append(name)
        else:
            first[id(tensor)] = (name, tensor, [])
    return list(first.values())


def _check_mode(module: nn.Module, mode: str) -> None:
    if mode not in PUSH_MODES:
        raise ValueError(f"weight push mode {mode!r} is not one of {list(PUSH_MODES)}")
    lora = any(is_adapter_param(name) for name, _ in module.named_parameters())
    if lora != (mode != "full"):
        raise ValueError(f"weight push mode {mode!r}: the actor {'has' if lora else 'has no'} LoRA adapter "
                         "(actor_rollout_ref.model.lora_rank must be the same for both pools)")


def lora_push_manifest(module: nn.Module, dtype: torch.dtype, mode: str) -> PushManifest:
    """The manifest of `lora_push_state(module, mode)` travelling in `dtype` (full shapes; no collective)."""
    _check_mode(module, mode)
    if mode == "full":
        return push_manifest(module, dtype)
    specs = []
    for name, tensor, aliases in _distinct(module):
        if (mode == "adapter") != is_adapter_param(name):
            continue
        if mode == "adapter":
            specs.append(TensorSpec(adapter_push_name(name), tuple(tensor.shape)))
        else:
            specs.append(TensorSpec(merged_push_name(name), tuple(tensor.shape),
                                    tuple(merged_push_name(a) for a in aliases)))
    return PushManifest(tuple(specs), dtype, mode)


def _merged(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Each frozen entry once, full (gathered: a collective on every rank, in the same order), an
    adapted linear's weight merged in fp32: W + scaling * B @ A."""
    scaling = lora_scalings(module)
    state = module.state_dict(keep_vars=True)
    for name, tensor, _ in _distinct(module):
        if is_adapter_param(name):
            continue
        full = full_tensor(tensor)
        merged = merged_weight(name, full, state, scaling)
        yield merged_push_name(name), full if merged is None else merged


def lora_push_state(module: nn.Module, mode: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) in the manifest's order: what `send_state` casts, gathers and broadcasts."""
    _check_mode(module, mode)
    if mode == "full":
        yield from push_state(module)
    elif mode == "adapter":
        for name, tensor, _ in _distinct(module):
            if is_adapter_param(name):
                yield adapter_push_name(name), tensor
    else:
        yield from _merged(module)

