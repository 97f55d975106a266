"""Rule rewards by data source, and the typed values they hand back.

Every supported source is an open-domain QA set scored by exact match; the
format-aware variant (Search-R1 v0.3) is chosen by the reward manager's config,
not by the source. Validation EM and the training reward go through the same
`get_scorer`, so there is one definition of "correct".

Rows in veRL upstream's tool format name their source `searchR1_<source>`
(what its preprocess_search_r1_dataset.py and our `--format tool` write); they
are scored with that recipe's own rule, `search_r1_like_qa_em.compute_score`
(EM, a correct answer quartered past 10 `<answer>` tags).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from verl.utils.reward_score import qa_em, qa_em_format, search_r1_like_qa_em

# The sources of the tag protocol's rows (and of FlashRAG, which both data formats read).
TAG_DATA_SOURCES = frozenset({
    "nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle",
    "demo_onehop", "demo_twohop", "demo",
})
# veRL's preprocess_search_r1_dataset.py names a row's source "searchR1_" + its FlashRAG source.
SEARCH_R1_LIKE_PREFIX = "searchR1_"
SEARCH_R1_LIKE_DATA_SOURCES = frozenset(SEARCH_R1_LIKE_PREFIX + source for source in TAG_DATA_SOURCES)
SUPPORTED_DATA_SOURCES = TAG_DATA_SOURCES | SEARCH_R1_LIKE_DATA_SOURCES


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
    """The scoring function for `data_source`.

    Tag-protocol sources: plain EM, or the v0.3 format-aware EM. `searchR1_*` sources: the
    reproduction's `search_r1_like_qa_em.compute_score`, which has no format-aware variant.
    """
    validate_data_sources([data_source])
    if data_source in SEARCH_R1_LIKE_DATA_SOURCES:
        if format_aware:
            # The v0.3 structure check is about <search>/<information> tags; tool-format rows
            # have none, so every response would be judged malformed.
            raise ValueError(
                f"data_source {data_source!r} is scored by the search_r1_like reward, which has no "
                "format-aware variant; set reward_model.structure_format_score, final_format_score and "
                "retrieval_score to 0 for tool-format data (the v0.3 format reward checks <search> tags)")
        return search_r1_like_qa_em.compute_score
    return qa_em_format.compute_score_em if format_aware else qa_em.compute_score_em


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None,
                          **kwargs: Any) -> float:
    """veRL's default reward function, by data source (a custom reward function may call it): the
    built-in rule of `get_scorer` (EM; the search_r1_like rule for `searchR1_*` rows)."""
    del extra_info, kwargs   # veRL's signature; the rule reads the text and the ground truth only
    return float(get_scorer(str(data_source))(solution_str, ground_truth))


__all__ = ["SEARCH_R1_LIKE_DATA_SOURCES", "SEARCH_R1_LIKE_PREFIX", "SUPPORTED_DATA_SOURCES", "TAG_DATA_SOURCES",
           "FormatScoreConfig", "RewardBreakdown", "default_compute_score", "get_scorer", "validate_data_sources"]
