"""LoRA's parameter counts for the memory plan (verl/utils/memory_plan.py; docs/lora.md).

PEFT's adapter on a linear layer (in -> out) of rank r is lora_A (r x in) and lora_B (out x r): r x
(in + out) fp32 parameters in 2 tensors, trained with AdamW; the base stays frozen in bf16 on the GPU.
`target_modules: all-linear` is what PEFT adapts on a decoder (every nn.Linear but the output head):
q/k/v/o and gate/up/down in each layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraCounts:
    params: int       # adapter parameters in the whole model
    tensors: int      # adapter parameter tensors
    per_layer: int    # adapter parameters in one decoder layer


def _names(value: Any) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else [str(v) for v in value]


def lora_counts(shape: Any, model_cfg: Any) -> LoraCounts | None:
    """The adapter `model_cfg` (actor_rollout_ref.model) puts on a model of `shape` (a ModelShape),
    or None when lora_rank is 0. Module names as PEFT matches them: a layer's attribute name."""
    rank = int(model_cfg.get("lora_rank", 0) or 0)
    if rank <= 0:
        return None
    h, i = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    target = model_cfg.get("target_modules", "all-linear")
    moe_error = moe_lora_error(shape, target)
    if moe_error:
        raise ValueError(moe_error)
    names = list(ALL_LINEAR) if target == "all-linear" else [n for n in _names(target) if n in dims]
    excluded = set(_names(model_cfg.get("exclude_modules")))
    names = [n for n in names if n not in excluded]
    per_layer = sum(rank * (dims[n][0] + dims[n][1]) for n in names)
    return LoraCounts(per_layer * shape.num_hidden_layers, 2 * len(names) * shape.num_hidden_layers, per_layer)


def moe_lora_error(shape: Any, target: Any) -> str:
    """Why `target` (actor_rollout_ref.model.target_modules) is refused on a mixture-of-experts `shape`
    (the message verl/utils/lora.py gives at injection, for preflight to give first), or ''."""
    if not getattr(shape, "is_moe", False):
        return ""
    mlp = sorted({"gate_proj", "up_proj", "down_proj", "gate", "experts", "w1", "w2", "w3"} & set(_names(target)))
    if target == "all-linear" or mlp:
        return (f"actor_rollout_ref.model.target_modules={target!r} on a mixture-of-experts model reaches "
                f"{'its routed experts and router' if target == 'all-linear' else mlp}: {MOE_LORA_REASON}")
    return ""


# LoRA on MoE experts: PEFT 0.21 can wrap a fused expert parameter (ParamWrapper, what `all-linear` does to
# transformers 5's experts) and the router, but this project's sharded load, merged push and vLLM adapter
# path take adapters on nn.Linear layers only.
MOE_LORA_REASON = ("LoRA on the routed experts (transformers 5 fuses them into 3-D parameters, which PEFT wraps "
                   "as ParamWrapper) or on the router is not supported here: the sharded load, the merged "
                   "weight push and vLLM's adapter path take adapters on nn.Linear layers only; set "
                   "actor_rollout_ref.model.target_modules=[q_proj,k_proj,v_proj,o_proj] (attention)")


def lora_actor_bytes(lora: LoraCounts, base_params: int, world: int, shard: Callable[[int, int], int],
                     adamw_state_bytes: Callable[[int, int], int]) -> tuple[int, int, int, int]:
    """(fp32 adapter shard, actor params = bf16 base shard + adapter shard, grads = the adapter's,
    AdamW state = the adapter's) in bytes per GPU."""
    adapter = shard(4 * lora.params, world)
    return (adapter, shard(2 * base_params, world) + adapter, adapter,
            shard(adamw_state_bytes(lora.params, lora.tensors), world))


def lora_note(lora: LoraCounts, rank: int) -> str:
    return (f"LoRA rank {rank}: {lora.params / 1e6:.1f}M adapter parameters; 'actor params' = the frozen base in "
            "bf16 + the fp32 adapter (shards), grads and AdamW the adapter's alone; the reference is the actor "
            "with the adapter off (no reference weights)")
