"""The loader's name map: a model's parameter names against its checkpoint's tensor names, for the
architectures whose Hugging Face class (transformers 5) renames or fuses checkpoint tensors on load.

transformers 5 builds the routed experts of a mixture-of-experts layer as two 3-D parameters,
while checkpoints (the Hub's, and `save_pretrained`'s, which converts back on save) store one 2-D
tensor per expert and projection. For Qwen3-MoE (and Qwen2-MoE, OLMoE):

    model.layers.L.mlp.experts.gate_up_proj  (E, 2I, H)   [e, :I] <- ...mlp.experts.{e}.gate_proj.weight
                                                           [e, I:] <- ...mlp.experts.{e}.up_proj.weight
    model.layers.L.mlp.experts.down_proj     (E, H, I)    [e]     <- ...mlp.experts.{e}.down_proj.weight

Mixtral stores w1 / w3 / w2 under `block_sparse_moe` (its router too: `block_sparse_moe.gate`), which
the model calls `mlp`. This table (`EXPERT_LAYOUTS`) mirrors transformers' own conversions for these
model types (transformers/conversion_mapping.py); tests/utils/test_name_map.py checks each against
what `save_pretrained` writes and `from_pretrained` reads. A model whose fused experts have no entry
here is refused by name (`NameMap.pieces`).

Loading (verl/utils/sharded_init.py) reads a fused parameter as its pieces, one stored tensor at a
time: each piece lands at one expert's index (and, for gate_up, one half of its rows), so each rank
copies only the experts of its FSDP2 shard and no rank assembles the fused tensor. Exporting
(verl/utils/checkpoint/hf_export.py) splits the gathered fused tensor back into the stored names.
Everything else passes through unchanged.

    names = NameMap.of(model.config)
    names.pieces("model.layers.0.mlp.experts.gate_up_proj", (4, 64, 64), manifest)   # [Piece, ...]
    list(names.to_checkpoint("model.layers.0.mlp.experts.down_proj", full))           # per expert
"""

from __future__ import annotations

from collections.abc import Container, Iterator
from dataclasses import dataclass
from typing import Any

import torch

FUSED_GATE_UP = "experts.gate_up_proj"
FUSED_DOWN = "experts.down_proj"


@dataclass(frozen=True)
class ExpertLayout:
    """How one model type stores its experts: the projections' names and the MoE block's name."""

    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    stored_block: str = "mlp"     # the MoE block's name in the checkpoint (the model's is `mlp`)


EXPERT_LAYOUTS: dict[str, ExpertLayout] = {
    "qwen3_moe": ExpertLayout(),
    "qwen2_moe": ExpertLayout(),
    "olmoe": ExpertLayout(),
    "mixtral": ExpertLayout(gate="w1", up="w3", down="w2", stored_block="block_sparse_moe"),
}


@dataclass(frozen=True)
class Piece:
    """One stored tensor of a fused parameter: it fills index `expert` of dim 0 and, when `rows` is
    set, rows [rows[0], rows[1]) of dim 1 within it (gate_up's two halves)."""

    name: str
    expert: int
    rows: tuple[int, int] | None = None


def is_fused_expert(name: str) -> bool:
    """A transformers 5 fused-expert parameter's name (gate_up_proj or down_proj of an `experts` module)."""
    return name.endswith("." + FUSED_GATE_UP) or name.endswith("." + FUSED_DOWN)


@dataclass(frozen=True)
class NameMap:
    """Model names <-> checkpoint names for one model type (`layout` None: names are stored as named)."""

    model_type: str
    layout: ExpertLayout | None

    @classmethod
    def of(cls, config: Any) -> NameMap:
        model_type = str(getattr(config, "model_type", "") or "")
        return cls(model_type, EXPERT_LAYOUTS.get(model_type))

    def _stored(self, name: str) -> str:
        """`name` with the MoE block renamed as the checkpoint names it (Mixtral's block_sparse_moe)."""
        if self.layout is None or self.layout.stored_block == "mlp":
            return name
        return name.replace(".mlp.", f".{self.layout.stored_block}.")

    def candidates(self, name: str) -> list[str]:
        """The names a checkpoint may store the (unfused) tensor `name` under, preferred first."""
        stored = self._stored(name)
        return [name] if stored == name else [name, stored]

    def pieces(self, name: str, shape: tuple[int, ...], stored: Container[str]) -> list[Piece] | None:
        """The stored tensors that make fused parameter `name` (of `shape`), when every one is in
        `stored`; None when `name` is not a fused expert parameter or a piece is missing (the
        caller reports it missing). Raises for fused experts of a model type the map lacks."""
        if not is_fused_expert(name):
            return None
        if self.layout is None:
            raise ValueError(f"{name}: fused expert weights of model type {self.model_type!r}, which the loader's "
                             f"name map (verl/utils/checkpoint/name_map.py EXPERT_LAYOUTS: {sorted(EXPERT_LAYOUTS)}) "
                             "does not know: add its per-expert checkpoint names there")
        block = self._stored(name).rsplit(".experts.", 1)[0] + ".experts"
        experts = shape[0]
        if name.endswith(FUSED_GATE_UP):
            half = shape[1] // 2
            out = [piece for e in range(experts) for piece in (
                Piece(f"{block}.{e}.{self.layout.gate}.weight", e, (0, half)),
                Piece(f"{block}.{e}.{self.layout.up}.weight", e, (half, 2 * half)))]
        else:
            out = [Piece(f"{block}.{e}.{self.layout.down}.weight", e) for e in range(experts)]
        return out if all(piece.name in stored for piece in out) else None

    def to_checkpoint(self, name: str, full: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, tensor) for the model's full tensor `name`, as `save_pretrained` stores
        it: a fused expert parameter split per expert (each piece a copy: safetensors refuses tensors
        that share storage), other names renamed (`full` itself)."""
        if self.layout is None or not is_fused_expert(name):
            yield self._stored(name), full
            return
        block = self._stored(name).rsplit(".experts.", 1)[0] + ".experts"
        if name.endswith(FUSED_GATE_UP):
            half = full.shape[1] // 2
            for e in range(full.shape[0]):
                yield f"{block}.{e}.{self.layout.gate}.weight", full[e, :half].clone()
                yield f"{block}.{e}.{self.layout.up}.weight", full[e, half:].clone()
        else:
            for e in range(full.shape[0]):
                yield f"{block}.{e}.{self.layout.down}.weight", full[e].clone()
