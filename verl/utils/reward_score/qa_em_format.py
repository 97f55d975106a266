"""Format-aware EM reward: the Search-R1 v0.3 rule.

The answer is read from the policy's own text (`solution_str`); the structure
and retrieval checks read the full response (`response_str`, observations
included), because a valid trajectory is defined by how the policy's actions
and the inserted `<information>` blocks interleave.

A valid response is

    <think>..</think> ( <search>..</search> <information>..</information> <think>..</think> )* <answer>..</answer>

with only whitespace between tags and every tag balanced. The inside of an
`<information>` block is opaque: a retrieved passage that happens to contain
a tag is not the policy's formatting error (the original counted it as one).
"""

from __future__ import annotations

import re
from typing import Any

from verl.utils.reward_score.qa_em import em_check, extract_solution, golden_answers_of, normalize_answer

_TAGS = ("think", "search", "information", "answer")
_TAG_SPLIT_RE = re.compile(r"(</?(?:think|search|information|answer)>)")
_INFORMATION_RE = re.compile(r"<information>(.*?)</information>", re.DOTALL)

# (state, tag) -> next state. "information" = just closed an <information> block;
# the only way forward from there is a new <think>.
_TRANSITIONS = {
    ("start", "<think>"): "in_think",
    ("information", "<think>"): "in_think",
    ("in_think", "</think>"): "after_think",
    ("after_think", "<search>"): "in_search",
    ("in_search", "</search>"): "after_search",
    ("after_search", "<information>"): "in_information",
    ("in_information", "</information>"): "information",
    ("after_think", "<answer>"): "in_answer",
    ("in_answer", "</answer>"): "end",
}
# States between tags, where only whitespace may appear. Text after </answer> is
# tolerated (as in v0.3): without stop strings the model may run on to EOS.
_BETWEEN_TAGS = frozenset({"start", "after_think", "after_search", "information"})


def sequence_format_error(text: str) -> str | None:
    """Why `text` breaks the think/search/information/answer structure, or None if it is valid."""
    text = _INFORMATION_RE.sub("<information></information>", text)
    for tag in _TAGS:
        opened, closed = text.count(f"<{tag}>"), text.count(f"</{tag}>")
        if opened != closed:
            return f"unbalanced <{tag}>: {opened} opening vs {closed} closing"
    state = "start"
    for part in _TAG_SPLIT_RE.split(text):
        if not part.strip():
            continue
        if _TAG_SPLIT_RE.fullmatch(part):
            next_state = _TRANSITIONS.get((state, part))
            if next_state is None:
                return f"unexpected {part} in state {state!r}"
            state = next_state
        elif state in _BETWEEN_TAGS:
            return f"text outside tags in state {state!r}: {part.strip()[:40]!r}"
    if state != "end":
        return f"ended in state {state!r} instead of after </answer>"
    return None


def is_valid_sequence(text: str) -> bool:
    """True if `text` follows think -> (search -> information -> think)* -> answer with balanced tags."""
    return sequence_format_error(text) is None


def is_retrieval_correct(text: str, golden_answers: list[str] | str) -> bool:
    """True if a (normalised) golden answer appears inside some <information> block of `text`."""
    answers = [golden_answers] if isinstance(golden_answers, str) else list(golden_answers)
    blocks = [normalize_answer(block) for block in _INFORMATION_RE.findall(text)]
    wanted = [normalize_answer(answer) for answer in answers]
    return any(answer and answer in block for block in blocks for answer in wanted)


def compute_score_em(solution_str: str, ground_truth: Any, structure_format_score: float = 0,
                     final_format_score: float = 0, retrieval_score: float = 0, format_score: float = 0,
                     score: float = 1.0, response_str: str | None = None) -> float:
    """Search-R1 v0.3 reward. `answer` comes from `solution_str`, format/retrieval from `response_str`.

    Rules, in order:
      1. correct answer, valid format          -> score
      2. correct answer, invalid format        -> score - structure_format_score
      3. wrong answer, valid format            -> structure_format_score
                                                  (+ retrieval_score if an <information> block holds an answer)
      4. wrong answer, invalid format          -> final_format_score if an answer was extracted, else 0
    A valid format implies an answer was given, so "no answer" always falls under rule 4.
    `format_score` is accepted for signature compatibility with the original and is unused,
    as in v0.3.
    """
    del format_score
    full_text = solution_str if response_str is None else response_str
    answers = golden_answers_of(ground_truth)
    valid_format = is_valid_sequence(full_text)
    answer = extract_solution(solution_str)
    if answer is not None and em_check(answer, answers):
        return float(score) if valid_format else float(score) - float(structure_format_score)
    if valid_format:
        bonus = float(retrieval_score) if is_retrieval_correct(full_text, answers) else 0.0
        return float(structure_format_score) + bonus
    return float(final_format_score) if answer is not None else 0.0
