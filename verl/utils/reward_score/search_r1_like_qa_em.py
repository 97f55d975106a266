"""The reward of veRL upstream's Search-R1 reproduction (its `search_r1_like` recipe).

Rows written for the tool protocol carry data sources `searchR1_<source>` (see
scripts/data_process, `--format tool`) and are scored here, with the rule that
recipe trains on:

- the LAST `<answer>...</answer>` is the prediction (stripped); none -> 0;
- an exact match (SQuAD normalisation, any golden answer) -> `score`, but only
  `score / 4` when the text holds more than MAX_ANSWER_TAGS opening or closing
  `<answer>` tags -- the reproduction's guard against a policy that spams
  answers hoping one of them is scored;
- a wrong prediction -> `format_score`.

`compute_score_subem` counts a golden answer contained in the prediction as
correct and, as in the reproduction, has no tag penalty.

As everywhere in this project (DESIGN §4.6) the caller passes policy text only
(verl/trainer/ppo/reward.py decodes the loss-mask-1 runs), so the prompt's
example `<answer> Beijing </answer>` and tool responses are neither extracted
nor counted as tags. Nothing is printed here: the reward manager prints its own
`reward_model.num_examine` examples.
"""

from __future__ import annotations

from typing import Any

from verl.utils.reward_score.qa_em import em_check, extract_solution, golden_answers_of, subem_check

OPEN_TAG = "<answer>"
CLOSE_TAG = "</answer>"
# More tags than this (opening or closing, counted separately) quarters a correct score.
MAX_ANSWER_TAGS = 10
TOO_MANY_TAGS_DIVISOR = 4.0


def count_answer_tags(text: str) -> tuple[int, int]:
    """(number of `<answer>`, number of `</answer>`) in `text`."""
    return text.count(OPEN_TAG), text.count(CLOSE_TAG)


def has_too_many_answer_tags(text: str) -> bool:
    """True when either tag occurs more than MAX_ANSWER_TAGS times."""
    opening, closing = count_answer_tags(text)
    return opening > MAX_ANSWER_TAGS or closing > MAX_ANSWER_TAGS


def compute_score(solution_str: str, ground_truth: Any, method: str = "strict", format_score: float = 0.0,
                  score: float = 1.0) -> float:
    """EM of the last answer: `score` (quartered past MAX_ANSWER_TAGS tags), `format_score` if wrong, 0 if none.

    `ground_truth` is `{"target": [...]}` (list, numpy array or str) or a bare string.
    `method` is accepted for the reproduction's signature; like there, it changes nothing.
    """
    del method  # the reproduction's signature has it; extraction is always the last-answer rule
    answer = extract_solution(solution_str)
    if answer is None:
        return 0.0
    if not em_check(answer, golden_answers_of(ground_truth)):
        return float(format_score)
    if has_too_many_answer_tags(solution_str):
        return float(score) / TOO_MANY_TAGS_DIVISOR
    return float(score)


def compute_score_subem(solution_str: str, ground_truth: Any, method: str = "strict", format_score: float = 0.0,
                        score: float = 1.0) -> float:
    """As compute_score with substring EM, and without the tag penalty (as in the reproduction)."""
    del method
    answer = extract_solution(solution_str)
    if answer is None:
        return 0.0
    return float(score) if subem_check(answer, golden_answers_of(ground_truth)) else float(format_score)
