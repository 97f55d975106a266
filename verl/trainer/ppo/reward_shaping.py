"""Scoring a rolled-out training batch: the rule reward, DAPO's overlong reward shaping, and the
per-row values dynamic sampling filters on.

    shaping = OverlongBuffer.from_config(cfg)                 # reward_model.overlong_buffer (veRL's keys)
    metrics = score_rollouts(reward_fn, batch, shaping, cfg.data.max_response_length)
    # batch: token_level_scores (B, R); non-tensors `acc`, `score`, `seq_reward` (one float per row)

Overlong shaping (DAPO, veRL's `DAPORewardManager`): a row longer than
`max_response_length - len` tokens loses `(length - (max_response_length - len)) / len * penalty_factor`,
linearly from 0 to `penalty_factor` over the last `len` tokens; it is added to the score on the
row's last policy token. The length is what `data.max_response_length` bounds, so the penalty grows
as a row nears the length at which it would be cut:

- tool protocol (rollout.multi_turn.enable): the whole response, tool messages included (veRL's
  valid response length; its agent loop cuts the trajectory there);
- tag protocol (and single turn): the row's longest turn, i.e. the longest run of policy tokens
  (the bound is per generation turn; retrieved passages and the other turns do not count, so a row
  is not penalised for searching more). Single turn: the response's policy tokens.
(docs/algorithms.md, "DAPO").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from omegaconf import DictConfig

from verl.trainer.config_schema import ConfigError
from verl.utils import batch_keys as K

if TYPE_CHECKING:   # verl.protocol imports tensordict (and with it torch._dynamo): preflight's config checks read
    from verl.protocol import DataProto  # this module's settings without it

# Per-row values the scoring writes into non_tensor_batch (veRL's reward_extra_info names).
ACC, SCORE, SEQ_REWARD = "acc", "score", "seq_reward"


@dataclass(frozen=True)
class OverlongBuffer:
    """`reward_model.overlong_buffer`: DAPO's soft penalty over the last `len` tokens of the budget."""

    enable: bool = False
    len: int = 0
    penalty_factor: float = 1.0
    log: bool = False
    whole_response: bool = False    # tool protocol: count the whole response; else the longest policy turn

    @classmethod
    def from_config(cls, cfg: DictConfig) -> OverlongBuffer:
        node = cfg.get("reward_model", {}).get("overlong_buffer") or {}
        enable, length = bool(node.get("enable", False)), node.get("len", 0)
        factor, log = node.get("penalty_factor", 1.0), bool(node.get("log", False))
        if not enable:
            return cls(enable=False)
        errors = []
        max_len = int(cfg.data.max_response_length)
        if isinstance(length, bool) or not isinstance(length, int) or not 0 < length <= max_len:
            errors.append(f"reward_model.overlong_buffer.len={length!r} must be an int in (0, "
                          f"data.max_response_length={max_len}]: the penalty ramps over the last len tokens")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor < 0:
            errors.append(f"reward_model.overlong_buffer.penalty_factor={factor!r} must be a number >= 0")
        if errors:
            raise ConfigError(errors[0], errors)
        tool = bool(cfg.actor_rollout_ref.rollout.get("multi_turn", {}).get("enable", False))
        return cls(enable=True, len=int(length), penalty_factor=float(factor), log=log, whole_response=tool)


def overlong_penalty(lengths: torch.Tensor, max_response_length: int, buffer_len: int,
                     penalty_factor: float) -> torch.Tensor:
    """veRL's overlong reward per row: min(-(length - (max_len - buffer_len)) / buffer_len * factor, 0)."""
    expected = max_response_length - buffer_len
    exceed = lengths.float() - expected
    return torch.clamp(-exceed / buffer_len * penalty_factor, max=0.0)


def longest_run(mask_BR: torch.Tensor) -> torch.Tensor:
    """Length of each row's longest run of 1s in a (B, R) mask: its longest generation turn."""
    run = torch.zeros(mask_BR.shape[0], dtype=torch.long, device=mask_BR.device)
    best = torch.zeros_like(run)
    for col in range(mask_BR.shape[-1]):
        run = (run + 1) * mask_BR[:, col].long()
        best = torch.maximum(best, run)
    return best


def overlong_lengths(batch: DataProto, whole_response: bool) -> torch.Tensor:
    """The length per row the buffer reads (module docstring): the response's real tokens, or the
    longest run of policy tokens (response_mask)."""
    if whole_response:
        width = batch.batch[K.RESPONSES].shape[-1]
        return batch.batch[K.ATTENTION_MASK][:, -width:].sum(-1)
    return longest_run(batch.batch[K.RESPONSE_MASK])


def _last_positions(mask_BR: torch.Tensor) -> torch.Tensor:
    """Index of each row's last 1 in a (B, R) mask (0 for a row with none)."""
    width = mask_BR.shape[-1]
    idx = torch.arange(width, device=mask_BR.device).expand_as(mask_BR)
    return torch.where(mask_BR.bool(), idx, torch.zeros_like(idx)).max(dim=-1).values


def reward_parts(scores: Any, breakdowns: list | None, row_metrics: list[dict] | None,
                 overlong: list[float] | None) -> np.ndarray:
    """Per row, a dict of the reward's parts (`reward_extra_info`, what the dumps show): the reward
    function's score, and where known the exact match, the extracted answer, the v0.3 format check,
    the token F1 and the judge's verdict (the reward manager's `last_row_metrics`) and the overlong
    penalty. Only JSON values."""
    n = len(scores)
    if row_metrics is not None and len(row_metrics) != n:
        row_metrics = None   # another batch's (a custom reward function that keeps its own)
    out = np.empty(n, dtype=object)
    for row in range(n):
        parts: dict[str, Any] = {"score": float(scores[row])}
        if breakdowns is not None:
            b = breakdowns[row]
            parts.update(em=int(b.em), answer=b.answer)
            if b.format_valid is not None:
                parts["format_valid"] = bool(b.format_valid)
        for key, value in (row_metrics[row] if row_metrics is not None else {}).items():
            parts[str(key)] = float(value)
        if overlong is not None:
            parts["overlong"] = float(overlong[row])
        out[row] = parts
    return out


def loop_reward_scores(batch: DataProto, scores_BR: torch.Tensor) -> torch.Tensor:
    """A row whose agent loop set its own `reward_score` (AgentLoopOutput) gets that score in place of the
    reward function's, on its last policy token (veRL's rm_scores); the other rows keep theirs."""
    column = batch.non_tensor_batch.get(K.ROLLOUT_REWARD_SCORE)
    rows = [] if column is None else [i for i, value in enumerate(column) if value is not None]
    if not rows:
        return scores_BR
    last_B = _last_positions(batch.batch[K.RESPONSE_MASK]).to(scores_BR.device)
    for i in rows:
        scores_BR[i] = 0.0
        scores_BR[i, last_B[i]] = float(column[i])
    return scores_BR


def score_rollouts(reward_fn: Any, batch: DataProto, shaping: OverlongBuffer, max_response_length: int,
                   row_values: bool = False) -> dict[str, float]:
    """Score `batch` with `reward_fn`, shape overlong rows, write token_level_scores; with `row_values`
    (dynamic sampling) also the per-row non-tensors `acc` (exact match where the reward manager
    reports it, else the score), `score` (before shaping) and `seq_reward` (the row's total after
    shaping). Returns the reward metrics."""
    from verl.trainer.ppo.reward import RewardManager

    breakdowns = None
    if isinstance(reward_fn, RewardManager):
        scores_BR, breakdowns = reward_fn(batch, return_breakdown=True)
    else:
        scores_BR = reward_fn(batch)
    from verl.protocol import DataProto

    if isinstance(scores_BR, DataProto):
        scores_BR = scores_BR.batch[K.TOKEN_LEVEL_SCORES]
    scores_BR = loop_reward_scores(batch, scores_BR.float().clone())
    metrics = dict(getattr(reward_fn, "last_metrics", {}) or {})
    raw = scores_BR.sum(-1).cpu().double().numpy()
    acc = np.array([float(b.em) for b in breakdowns]) if breakdowns is not None else raw.copy()
    if shaping.enable:
        mask_BR = batch.batch[K.RESPONSE_MASK]
        lengths_B = overlong_lengths(batch, shaping.whole_response)
        penalty_B = overlong_penalty(lengths_B, max_response_length, shaping.len, shaping.penalty_factor)
        rows = torch.arange(scores_BR.shape[0], device=scores_BR.device)
        scores_BR[rows, _last_positions(mask_BR).to(scores_BR.device)] += penalty_B.to(scores_BR.device)
        if shaping.log:
            metrics["reward/overlong_reward_mean"] = float(penalty_B.mean())
            metrics["reward/overlong_fraction"] = float((penalty_B < 0).float().mean())
    batch.batch[K.TOKEN_LEVEL_SCORES] = scores_BR
    batch.non_tensor_batch[K.REWARD_EXTRA_INFO] = reward_parts(
        raw, breakdowns, getattr(reward_fn, "last_row_metrics", None),
        penalty_B.cpu().tolist() if shaping.enable else None)
    if not row_values:
        return metrics
    batch.non_tensor_batch[ACC] = acc.astype(np.float64)
    batch.non_tensor_batch[SCORE] = raw
    batch.non_tensor_batch[SEQ_REWARD] = scores_BR.sum(-1).cpu().double().numpy()
    return metrics
