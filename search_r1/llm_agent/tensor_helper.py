"""Small tensor helpers for the generation manager: padding token lists into batches,
masks, position ids, and trimming all-pad columns.

The manager keeps each row's tokens as Python lists while a rollout runs (so no
pad token is ever mistaken for a real one) and turns them into padded tensors only
at the engine boundary and at the end; these helpers do that conversion.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def left_pad(rows: Sequence[Sequence[int]], pad_token_id: int, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists to `width` (default: the longest). Returns (ids, mask), both (B, width) long."""
    width = max((len(r) for r in rows), default=0) if width is None else width
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if len(row) > width:
            raise ValueError(f"row {i} has {len(row)} tokens, more than the padded width {width}")
        if row:
            ids[i, width - len(row):] = torch.as_tensor(list(row), dtype=torch.long)
            mask[i, width - len(row):] = 1
    return ids, mask


def right_pad(rows: Sequence[Sequence[int]], pad_value: int, width: int | None = None) -> torch.Tensor:
    """Right-pad integer lists (token ids or 0/1 masks) to `width` (default: the longest); (B, width) long."""
    width = max((len(r) for r in rows), default=0) if width is None else width
    out = torch.full((len(rows), width), pad_value, dtype=torch.long)
    for i, row in enumerate(rows):
        if len(row) > width:
            raise ValueError(f"row {i} has {len(row)} values, more than the padded width {width}")
        if row:
            out[i, : len(row)] = torch.as_tensor(list(row), dtype=torch.long)
    return out


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """cumsum(mask) - 1, clipped at 0: left padding gets position 0 and real tokens count from 0."""
    return torch.clamp(torch.cumsum(attention_mask, dim=-1) - 1, min=0)


def cut_to_effective_len(tensors: dict[str, torch.Tensor], attention_mask: torch.Tensor,
                         left_padded: bool = True) -> dict[str, torch.Tensor]:
    """Drop the columns that are padding in every row (leading ones if left-padded, else trailing)."""
    width = int(attention_mask.sum(dim=-1).max().item()) if attention_mask.numel() else 0
    if left_padded:
        return {k: v[:, v.shape[1] - width:] for k, v in tensors.items()}
    return {k: v[:, :width] for k, v in tensors.items()}


def masked_rows(values: torch.Tensor, mask: torch.Tensor) -> list[list]:
    """The values of each row where `mask` is 1, in order, as lists."""
    if values.shape != mask.shape:
        raise ValueError(f"values {tuple(values.shape)} and mask {tuple(mask.shape)} differ in shape")
    return [row[m.bool()].tolist() for row, m in zip(values, mask, strict=True)]


def real_tokens(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """The tokens of each row where `mask` is 1, in order, as lists."""
    return masked_rows(ids, mask)
