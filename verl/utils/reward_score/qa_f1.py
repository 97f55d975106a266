"""Token-level F1 between an answer and its golden answers, as FlashRAG (the original's evaluation) computes it.

Normalisation is SQuAD's (`qa_em.normalize_answer`: lowercase, drop punctuation, drop the
articles a/an/the, collapse whitespace), the same FlashRAG's `normalize_answer` applies. As in
FlashRAG's `F1_Score.token_level_scores`: a "yes"/"no"/"noanswer" on either side scores only
against the identical string, an answer with no token in common scores 0, and the result is the
maximum over the golden answers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from verl.utils.reward_score.qa_em import (
    _as_answer_list,
    extract_solution,
    golden_answers_of,
    normalize_answer,
)

_SPECIAL = frozenset({"yes", "no", "noanswer"})


def f1_check(prediction: str, golden_answers: str | Sequence[str] | np.ndarray) -> float:
    """Best token F1 of `prediction` against any golden answer, in [0, 1]."""
    normalized_prediction = normalize_answer(prediction)
    prediction_tokens = normalized_prediction.split()
    best = 0.0
    for answer in _as_answer_list(golden_answers):
        normalized_answer = normalize_answer(answer)
        if (normalized_prediction in _SPECIAL or normalized_answer in _SPECIAL) \
                and normalized_prediction != normalized_answer:
            continue
        answer_tokens = normalized_answer.split()
        same = sum((Counter(prediction_tokens) & Counter(answer_tokens)).values())
        if same == 0:
            continue
        precision = same / len(prediction_tokens)
        recall = same / len(answer_tokens)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


def compute_score_f1(solution_str: str, ground_truth: Any) -> float:
    """Token F1 of the last `<answer>` in `solution_str` (0 when there is none)."""
    answer = extract_solution(solution_str)
    if answer is None:
        return 0.0
    return f1_check(answer, golden_answers_of(ground_truth))
