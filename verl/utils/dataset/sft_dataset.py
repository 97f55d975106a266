"""Supervised fine-tuning data: parquet rows -> token ids with a per-token loss weight.

Two row layouts are read:

* multi-turn (Search-R1 trajectories): a `prompt` column holding chat messages (as in the
  RL parquet) and a `turns` column, a list of `{"role": "policy" | "observation", "text"}`.
  The prompt is rendered with the tokenizer's chat template (generation prompt on), and
  every segment is tokenized on its own and concatenated, exactly as a rollout appends
  sampled tokens and observations; so each weight lines up with its token.
* single-turn (veRL's SFT layout): `prompt_key` and `response_key` columns of text (or
  a chat-message list for the prompt).

Weights come from `loss_weights` per role: e.g. {prompt: 0, policy: 1, observation: 0}
trains only on what the policy writes; the EOS after the last policy turn is a policy token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from torch.utils.data import Dataset

ROLES = ("prompt", "policy", "observation")


@dataclass(frozen=True)
class Segment:
    role: str   # one of ROLES
    text: str


@dataclass(frozen=True)
class SFTExample:
    """One tokenized row; `loss_weight_L[t]` weighs the loss of predicting token t."""

    input_ids_L: torch.Tensor
    loss_weight_L: torch.Tensor


def read_parquets(files: str | Sequence[str]) -> pd.DataFrame:
    files = [files] if isinstance(files, str) else list(files)
    if not files:
        raise ValueError("no parquet files given (data.train_files is empty)")
    return pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)


def _as_list(value: object) -> list:
    return list(value) if isinstance(value, list | tuple | np.ndarray) else [value]


def render_prompt(tokenizer, prompt: object) -> str:
    """Chat messages -> templated text (generation prompt on); plain text passes through."""
    if isinstance(prompt, str):
        return prompt
    messages = [dict(m) for m in _as_list(prompt)]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def row_segments(row: Mapping, tokenizer, prompt_key: str, response_key: str, where: str) -> list[Segment]:
    """The row as segments: prompt first, then policy/observation turns (or one response)."""
    if prompt_key not in row:
        raise KeyError(f"{where}: missing column {prompt_key!r}")
    segments = [Segment("prompt", render_prompt(tokenizer, row[prompt_key]))]
    if "turns" in row and row["turns"] is not None:
        for j, turn in enumerate(_as_list(row["turns"])):
            role, text = turn.get("role"), turn.get("text")
            if role not in ("policy", "observation") or not isinstance(text, str):
                raise ValueError(f"{where}: turns[{j}] must be {{'role': 'policy'|'observation', 'text': str}}, "
                                 f"got {turn!r}")
            segments.append(Segment(role, text))
    elif response_key in row:
        segments.append(Segment("policy", str(row[response_key])))
    else:
        raise KeyError(f"{where}: needs a 'turns' column or the response column {response_key!r}")
    return segments


def tokenize_segments(tokenizer, segments: Sequence[Segment], loss_weights: Mapping[str, float],
                      append_eos: bool = True) -> SFTExample:
    """Tokenize each segment alone and concatenate; weights follow the segments' roles."""
    ids: list[int] = []
    weights: list[float] = []
    for seg in segments:
        if seg.role not in loss_weights:
            raise KeyError(f"no loss weight for segment role {seg.role!r}; data.loss_weights has {sorted(loss_weights)}")
        seg_ids = tokenizer(seg.text, add_special_tokens=False)["input_ids"]
        ids.extend(seg_ids)
        weights.extend([float(loss_weights[seg.role])] * len(seg_ids))
    if append_eos:
        ids.append(tokenizer.eos_token_id)
        weights.append(float(loss_weights["policy"]))
    return SFTExample(torch.tensor(ids, dtype=torch.long), torch.tensor(weights, dtype=torch.float32))


class SFTDataset(Dataset):
    """Parquet rows tokenized up front (the demo's data sets are small).

    `truncation`: "error" raises naming the row, "right" cuts the tail, "skip" drops the row.
    """

    def __init__(self, files: str | Sequence[str], tokenizer, max_length: int,
                 loss_weights: Mapping[str, float], prompt_key: str = "prompt", response_key: str = "response",
                 truncation: str = "error") -> None:
        if truncation not in ("error", "right", "skip"):
            raise ValueError(f"data.truncation must be error|right|skip, got {truncation!r}")
        frame = read_parquets(files)
        self.examples: list[SFTExample] = []
        self.skipped = 0
        for i, row in enumerate(frame.to_dict("records")):
            where = f"{files} row {i}"
            ex = tokenize_segments(tokenizer, row_segments(row, tokenizer, prompt_key, response_key, where),
                                   loss_weights)
            if len(ex.input_ids_L) > max_length:
                if truncation == "error":
                    raise ValueError(f"{where}: {len(ex.input_ids_L)} tokens > data.max_length={max_length}")
                if truncation == "skip":
                    self.skipped += 1
                    continue
                ex = SFTExample(ex.input_ids_L[:max_length], ex.loss_weight_L[:max_length])
            self.examples.append(ex)
        if not self.examples:
            raise ValueError(f"{files}: no usable rows")

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> SFTExample:
        return self.examples[i]


def collate_right_padded(examples: Sequence[SFTExample], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest row: input_ids, attention_mask, position_ids, loss_weight (B, L)."""
    length = max(len(e.input_ids_L) for e in examples)
    batch = len(examples)
    input_ids = torch.full((batch, length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, length), dtype=torch.long)
    loss_weight = torch.zeros((batch, length), dtype=torch.float32)
    for b, e in enumerate(examples):
        n = len(e.input_ids_L)
        input_ids[b, :n] = e.input_ids_L
        attention_mask[b, :n] = 1
        loss_weight[b, :n] = e.loss_weight_L
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
            "loss_weight": loss_weight}
