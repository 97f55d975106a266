"""Rule rewards by data source, and the typed values they hand back.

Every supported source is an open-domain QA set scored by exact match; the
format-aware variant (Search-R1 v0.3) is chosen by the reward manager's config,
not by the source. Validation EM and the training reward go through the same
`get_scorer`, so there is one definition of "correct".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from verl.utils.reward_score import qa_em, qa_em_format

SUPPORTED_DATA_SOURCES = frozenset({
    "nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle",
    "demo_onehop", "demo_twohop", "demo",
})


@dataclass(frozen=True)
class RewardBreakdown:
    """What one response scored and why."""

    score: float
    em: int                     # exact match of the extracted answer (0 when none was extracted)
    answer: str | None          # the last <answer> the policy wrote; None if it wrote none
    format_valid: bool | None   # v0.3 structure check; None when the plain EM rule is used


@dataclass(frozen=True)
class FormatScoreConfig:
    """The v0.3 format-aware reward's weights (`reward_model.*` in ppo_trainer.yaml)."""

    structure_format_score: float = 0.0
    final_format_score: float = 0.0
    retrieval_score: float = 0.0
    format_score: float = 0.0

    @classmethod
    def from_config(cls, reward_model_cfg: Any) -> FormatScoreConfig:
        """Read the weights from the `reward_model` config node (missing keys default to 0)."""
        return cls(**{name: float(reward_model_cfg.get(name, 0.0) or 0.0)
                      for name in ("structure_format_score", "final_format_score",
                                   "retrieval_score", "format_score")})


Scorer = Callable[..., float]


def validate_data_sources(sources: Iterable[str]) -> None:
    """Raise ValueError naming every data source that has no scorer."""
    unknown = sorted({str(source) for source in sources} - SUPPORTED_DATA_SOURCES)
    if unknown:
        raise ValueError(f"no reward scorer for data_source {unknown}; supported: {sorted(SUPPORTED_DATA_SOURCES)}")


def get_scorer(data_source: str, format_aware: bool = False) -> Scorer:
    """The scoring function for `data_source` (plain EM, or the v0.3 format-aware EM)."""
    validate_data_sources([data_source])
    return qa_em_format.compute_score_em if format_aware else qa_em.compute_score_em


__all__ = ["SUPPORTED_DATA_SOURCES", "FormatScoreConfig", "RewardBreakdown", "get_scorer", "validate_data_sources"]
