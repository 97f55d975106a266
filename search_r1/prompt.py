"""The Search-R1 prompt: the exact template released checkpoints were trained with.

`PROMPT_TEMPLATE` is byte-identical to shared/fixtures/prompt_template.txt (final
newline included); `{question}` is the slot. `make_prefix` is what data processing,
inference and the demo all call, so every entry point builds the same prompt.
"""

from __future__ import annotations

PROMPT_TEMPLATE = 'Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get new information. After reasoning, if you find you lack some knowledge, you can call a search engine by <search> query </search> and it will return the top searched results between <information> and </information>. You can search as many times as your want. If you find no further external knowledge needed, you can directly provide the answer inside <answer> and </answer>, without detailed illustrations. For example, <answer> Beijing </answer>. Question: {question}\n'


def normalize_question(question: str) -> str:
    """Strip the question and give it a trailing "?" if it has none (as the original does)."""
    question = question.strip()
    if not question:
        raise ValueError("empty question")
    if not question.endswith("?"):
        question += "?"
    return question


def make_prefix(question: str) -> str:
    """The user message for `question`: the template with the normalised question filled in."""
    return PROMPT_TEMPLATE.replace("{question}", normalize_question(question))
