"""Rule-based reward manager: decode each response, score it, put the score on its last policy token.

Departure from the original Search-R1 (DESIGN §4.6): the answer is extracted
from policy text only. Each maximal run of `loss_mask == 1` tokens is decoded
on its own and the runs are joined with "\n", so the prompt's example answer,
retrieved passages and the invalid-action notice (all mask 0) can never be
scored. The format-aware rule still sees the full response, observations
included, because its structure check is about how they interleave.

Reads:  batch `responses` (B, R), `loss_mask` (B, R) [fallback `attention_mask[:, -R:]`],
        optional `attention_mask` (B, T); non-tensors `data_source`, `reward_model`.
Writes: nothing; returns `token_level_scores` (B, R).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import torch

from verl.protocol import DataProto
from verl.utils import batch_keys as K
from verl.utils.reward_score import (
    FormatScoreConfig,
    RewardBreakdown,
    get_scorer,
    validate_data_sources,
)
from verl.utils.reward_score.qa_em import em_check, extract_solution, golden_answers_of
from verl.utils.reward_score.qa_em_format import is_valid_sequence


def _policy_runs(mask_row: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of every maximal run of 1s in a 1-D mask."""
    padded = torch.cat([torch.zeros(1, dtype=torch.long), mask_row.long(), torch.zeros(1, dtype=torch.long)])
    edges = torch.diff(padded)
    starts = torch.nonzero(edges == 1).flatten().tolist()
    ends = torch.nonzero(edges == -1).flatten().tolist()
    return list(zip(starts, ends, strict=True))


def _has_key(data: DataProto, key: str) -> bool:
    return data.batch is not None and key in data.batch.keys()


class RewardManager:
    """Scores a batch of rollouts with the EM rule (or the v0.3 format-aware EM rule)."""

    def __init__(self, tokenizer: Any, num_examine: int, format_score_cfg: FormatScoreConfig | None = None) -> None:
        self.tokenizer = tokenizer
        self.num_examine = int(num_examine)
        self.format_score_cfg = format_score_cfg
        # Counters from the last call, for the trainer's metrics.
        self.last_metrics: dict[str, float] = {}
        # Each row's breakdown from the last call (the validation dump's reward parts).
        self.last_breakdowns: list[RewardBreakdown] = []

    def _masks(self, data: DataProto) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        responses = data.batch[K.RESPONSES]
        length = responses.shape[-1]
        attention = data.batch[K.ATTENTION_MASK][:, -length:] if _has_key(data, K.ATTENTION_MASK) else None
        if _has_key(data, K.LOSS_MASK):
            policy_mask = data.batch[K.LOSS_MASK]
        elif attention is not None:
            policy_mask = attention
        else:
            raise KeyError(f"RewardManager needs batch key '{K.LOSS_MASK}' or '{K.ATTENTION_MASK}'")
        if policy_mask.shape != responses.shape:
            raise ValueError(f"batch key '{K.LOSS_MASK}' has shape {tuple(policy_mask.shape)}, "
                             f"'{K.RESPONSES}' has {tuple(responses.shape)}")
        real_tokens = attention if attention is not None else (responses != self.tokenizer.pad_token_id).long()
        # Decoding is host work; one copy up front instead of a sync per row.
        return responses.cpu(), policy_mask.cpu(), real_tokens.cpu()

    def decode_row(self, response_ids: torch.Tensor, policy_mask: torch.Tensor,
                   real_tokens: torch.Tensor) -> tuple[str, str]:
        """(policy_text, response_text) for one row."""
        pieces = [self.tokenizer.decode(response_ids[start:end].tolist(), skip_special_tokens=True)
                  for start, end in _policy_runs(policy_mask)]
        response_text = self.tokenizer.decode(response_ids[real_tokens.bool()].tolist(), skip_special_tokens=True)
        return "\n".join(pieces), response_text

    def validate_sources(self, sources: Any) -> None:
        """Refuse data sources the built-in rules cannot score (a custom reward function scores any)."""
        validate_data_sources(sources)

    def _score(self, data_source: str, policy_text: str, response_text: str, ground_truth: Any) -> RewardBreakdown:
        answer = extract_solution(policy_text)
        em = em_check(answer, golden_answers_of(ground_truth)) if answer is not None else 0
        cfg = self.format_score_cfg
        if cfg is None:
            score = get_scorer(data_source)(policy_text, ground_truth)
            return RewardBreakdown(score=score, em=em, answer=answer, format_valid=None)
        score = get_scorer(data_source, format_aware=True)(
            policy_text, ground_truth,
            structure_format_score=cfg.structure_format_score, final_format_score=cfg.final_format_score,
            retrieval_score=cfg.retrieval_score, format_score=cfg.format_score, response_str=response_text,
        )
        return RewardBreakdown(score=score, em=em, answer=answer, format_valid=is_valid_sequence(response_text))

    def __call__(self, data: DataProto,
                 return_breakdown: bool = False) -> torch.Tensor | tuple[torch.Tensor, list[RewardBreakdown]]:
        """token_level_scores (B, R): each row's score on its last policy token, 0 elsewhere."""
        device = data.batch[K.RESPONSES].device
        responses, policy_mask, real_tokens = self._masks(data)
        for key in (K.DATA_SOURCE, K.REWARD_MODEL):
            if key not in data.non_tensor_batch:
                raise KeyError(f"RewardManager needs non-tensor key '{key}'")
        sources = data.non_tensor_batch[K.DATA_SOURCE]
        self.validate_sources(sources)

        scores = torch.zeros(responses.shape, dtype=torch.float32)
        breakdowns: list[RewardBreakdown] = []
        examined: dict[str, int] = defaultdict(int)
        rows_without_policy_token = 0
        for row in range(responses.shape[0]):
            policy_text, response_text = self.decode_row(responses[row], policy_mask[row], real_tokens[row])
            reward_model = data.non_tensor_batch[K.REWARD_MODEL][row]
            if "ground_truth" not in reward_model:
                raise KeyError(f"row {row}: non-tensor '{K.REWARD_MODEL}' has no 'ground_truth' key")
            ground_truth = reward_model["ground_truth"]
            source = str(sources[row])
            breakdown = self._score(source, policy_text, response_text, ground_truth)
            breakdowns.append(breakdown)
            policy_positions = torch.nonzero(policy_mask[row]).flatten()
            if len(policy_positions) == 0:
                rows_without_policy_token += 1
            else:
                scores[row, policy_positions[-1]] = breakdown.score
            if examined[source] < self.num_examine:
                examined[source] += 1
                print(f"[reward {source}] score={breakdown.score} answer={breakdown.answer!r} "
                      f"golden={golden_answers_of(ground_truth)}\n[response]\n{response_text}")
        self.last_metrics = {
            "reward/rows_without_policy_token": float(rows_without_policy_token),
            "reward/mean_score": float(np.mean([b.score for b in breakdowns])) if breakdowns else 0.0,
        }
        scores = scores.to(device)
        self.last_breakdowns = breakdowns
        if return_breakdown:
            return scores, breakdowns
        return scores


def em_by_data_source(data: DataProto, scores: torch.Tensor) -> dict[str, float]:
    """Mean per-row score (row sum of `scores`, (B, R)) for each data source."""
    sources = data.non_tensor_batch[K.DATA_SOURCE]
    row_scores = scores.sum(dim=-1).tolist()
    grouped: dict[str, list[float]] = defaultdict(list)
    for source, value in zip(sources, row_scores, strict=True):
        grouped[str(source)].append(value)
    return {source: float(np.mean(values)) for source, values in sorted(grouped.items())}


def load_reward_managers(config: Any, tokenizer: Any) -> tuple[RewardManager, RewardManager]:
    """(training reward, validation reward) from the full trainer config.

    Training uses the format-aware rule when any `reward_model.*_score` weight is
    set; validation always reports plain EM. Both print `reward_model.num_examine`
    decoded examples per data source per call.
    """
    rm_cfg = config.get("reward_model", {})
    num_examine = int(rm_cfg.get("num_examine", 1))
    format_cfg = FormatScoreConfig.from_config(rm_cfg)
    use_format = any(value != 0.0 for value in (format_cfg.structure_format_score,
                                               format_cfg.final_format_score, format_cfg.retrieval_score))
    train = RewardManager(tokenizer, num_examine=num_examine, format_score_cfg=format_cfg if use_format else None)
    val = RewardManager(tokenizer, num_examine=num_examine, format_score_cfg=None)
    return train, val
