"""Exact-match (EM) and substring-EM outcome rewards for open-domain QA.

The caller passes only text the policy wrote (see verl/trainer/ppo/reward.py):
unlike the original Search-R1, which skipped the first `<answer>` match to
avoid the prompt's example, no match here is skipped -- the prompt, retrieved
passages and the invalid-action notice simply never reach this module.
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from typing import Any

import numpy as np

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD normalisation: lowercase, drop punctuation and the articles a/an/the, collapse whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCTUATION)
    s = _ARTICLES_RE.sub(" ", s)
    return " ".join(s.split())


def _as_answer_list(golden_answers: str | Sequence[str] | np.ndarray) -> list[str]:
    if isinstance(golden_answers, str):
        return [golden_answers]
    answers = list(golden_answers)
    for position, answer in enumerate(answers):
        if not isinstance(answer, str):
            raise TypeError(f"golden answer #{position} is {type(answer).__name__}, expected str: {answer!r}")
    return answers


def golden_answers_of(ground_truth: Any) -> list[str]:
    """The answer list from a ground truth `{"target": [...]}` (list or numpy array), or a bare string."""
    if isinstance(ground_truth, str):
        return [ground_truth]
    if isinstance(ground_truth, dict):
        if "target" not in ground_truth:
            raise KeyError(f"ground_truth has no 'target' key (keys: {sorted(ground_truth)})")
        return _as_answer_list(ground_truth["target"])
    raise TypeError(f"ground_truth must be a dict with 'target' or a str, got {type(ground_truth).__name__}")


def em_check(prediction: str, golden_answers: str | Sequence[str] | np.ndarray) -> int:
    """1 if the normalised prediction equals any normalised golden answer, else 0."""
    normalized = normalize_answer(prediction)
    return int(any(normalize_answer(answer) == normalized for answer in _as_answer_list(golden_answers)))


def subem_check(prediction: str, golden_answers: str | Sequence[str] | np.ndarray) -> int:
    """1 if any normalised golden answer is a substring of the normalised prediction, else 0."""
    normalized = normalize_answer(prediction)
    return int(any(normalize_answer(answer) in normalized for answer in _as_answer_list(golden_answers)))


def extract_solution(solution_str: str) -> str | None:
    """The stripped content of the LAST `<answer>...</answer>` in `solution_str`; None if there is none."""
    matches = _ANSWER_RE.findall(solution_str)
    if not matches:
        return None
    return matches[-1].strip()


def compute_score_em(solution_str: str, ground_truth: Any, format_score: float = 0.0, score: float = 1.0) -> float:
    """`score` for an exact match, `format_score` for a wrong extracted answer, 0 when no answer was given."""
    answer = extract_solution(solution_str)
    if answer is None:
        return 0.0
    return float(score) if em_check(answer, golden_answers_of(ground_truth)) else float(format_score)


def compute_score_subem(solution_str: str, ground_truth: Any, format_score: float = 0.0,
                        score: float = 1.0) -> float:
    """As compute_score_em, but a golden answer contained in the prediction counts as correct."""
    answer = extract_solution(solution_str)
    if answer is None:
        return 0.0
    return float(score) if subem_check(answer, golden_answers_of(ground_truth)) else float(format_score)
