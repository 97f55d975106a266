"""Pack a padded batch into one row of real tokens ("remove padding"), and back.

A rollout batch is mostly padding (left-padded prompts, right-padded responses).
Packing drops every pad token and lays the sequences end to end in a single row;
position ids restart at 0 for each sequence. The workers load packing models with the
attention registered in `verl/utils/packed_attention.py`, which reads the sequence
boundaries from those position ids (varlen_attn on CUDA, per-sequence sdpa on CPU); a
model on plain sdpa / eager builds a dense block-diagonal causal mask from them instead.
Either way no token attends across a sequence boundary and the result equals the padded
forward.

    packed = pack_batch(input_ids, attention_mask, position_ids)
    logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids,
                   attention_mask=None, use_cache=False).logits      # (1, N, V)
    token_logp_BT = unpack_to_padded(logp_N, packed)                  # (B, T)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedBatch:
    """The non-pad tokens of a (B, T) batch laid end to end."""

    input_ids: torch.Tensor      # (1, N) long
    position_ids: torch.Tensor   # (1, N) long, restarting at 0 per sequence
    indices: torch.Tensor        # (N,) flat indices into the (B*T) padded layout
    batch_size: int
    seqlen: int


def pack_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> PackedBatch:
    """Keep the tokens where attention_mask == 1, row after row."""
    if input_ids.shape != attention_mask.shape or input_ids.shape != position_ids.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)}, attention_mask {tuple(attention_mask.shape)} and "
            f"position_ids {tuple(position_ids.shape)} must have the same (B, T) shape")
    batch_size, seqlen = input_ids.shape
    indices = torch.nonzero(attention_mask.reshape(-1) == 1, as_tuple=False).squeeze(-1)
    # Positions are recomputed from the mask so each packed sequence starts at 0 even if
    # the caller's position_ids were offset; the packing detector in transformers relies on it.
    real_positions = (torch.cumsum(attention_mask, dim=-1) - 1).clamp(min=0)
    return PackedBatch(
        input_ids=input_ids.reshape(-1)[indices].unsqueeze(0),
        position_ids=real_positions.reshape(-1)[indices].unsqueeze(0),
        indices=indices,
        batch_size=batch_size,
        seqlen=seqlen,
    )


def next_token_labels(packed: PackedBatch) -> torch.Tensor:
    """(N,) label of each packed position: the next packed token.

    At a sequence's last token the label is the next sequence's first token, which
    is wrong but harmless: that position never predicts a response token.
    """
    return torch.roll(packed.input_ids.squeeze(0), shifts=-1, dims=0)


def unpack_to_padded(values_N: torch.Tensor, packed: PackedBatch, fill: float = 0.0) -> torch.Tensor:
    """Scatter per-token values (N, ...) back into the padded (B, T, ...) layout."""
    trailing = values_N.shape[1:]
    out = values_N.new_full((packed.batch_size * packed.seqlen, *trailing), fill)
    out = out.index_put((packed.indices,), values_N)
    return out.reshape(packed.batch_size, packed.seqlen, *trailing)


@torch.no_grad()
def check_packing_isolates_sequences(module: torch.nn.Module, vocab_size: int) -> None:
    """Raise if `module` lets packed sequences attend to each other.

    Packing relies on the model reading sequence boundaries from restarting position_ids; an
    architecture that ignores them would silently mix sequences. The check packs one sequence
    S behind two different first sequences of the same length: with isolation, S's logits do
    not depend on what precedes it, and since both forwards have the same shapes they run the
    same kernels in the same order, so S's logits agree to rounding in any dtype (bf16 mixed
    precision included). A leak moves them by a visible fraction of their scale. Two forwards,
    the same on every rank, so FSDP's collectives line up. They pass the boundaries as the actor
    and critic do (`packed_attention.boundary_kwargs`), so the check covers the path training runs.
    """
    from verl.utils.packed_attention import boundary_kwargs

    device = next(module.parameters()).device
    ids = [i % vocab_size for i in (1, 2, 3, 7, 8, 9, 4, 5)]
    second = torch.tensor([ids[6:]], device=device)
    positions = torch.tensor([[0, 1, 2, 0, 1]], device=device)
    logits = []
    for first in (ids[0:3], ids[3:6]):
        packed_ids = torch.cat([torch.tensor([first], device=device), second], dim=-1)
        out = module(input_ids=packed_ids, position_ids=positions, attention_mask=None, use_cache=False,
                     **boundary_kwargs(positions)).logits
        logits.append(out[:, 3:].float())
    scale = float(logits[0].abs().max()) + 1e-6
    if not torch.allclose(logits[0], logits[1], atol=1e-3 * scale, rtol=0):
        raise ValueError(
            f"{type(module).__name__} attends across packed sequences (it ignores restarting position_ids); "
            "set model.use_remove_padding=False for this architecture")
