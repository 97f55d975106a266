"""The Search-R1 prompt: the exact template released checkpoints were trained with.

`PROMPT_TEMPLATE` is byte-identical to shared/fixtures/prompt_template.txt (final
newline included); `{question}` is the slot. `make_prefix` is what data processing,
inference and the demo all call, so every entry point builds the same prompt.
"""

from __future__ import annotations

PROMPT_TEMPLATE = 'Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get new information. After reasoning, if you find you lack some knowledge, you can call a search engine by <search> query </search> and it will return the top searched results between <information> and </information>. You can search as many times as your want. If you find no further external knowledge needed, you can directly provide the answer inside <answer> and </answer>, without detailed illustrations. For example, <answer> Beijing </answer>. Question: {question}\n'


# `--template_type open` (scripts/data_process) for runs with the open tag (`open_tag.enable`;
# docs/agent.md "The open tag"): the same template with one sentence added after the search one.
# Not a released template: no checkpoint was trained on it.
OPEN_SENTENCE = ('Each result shows its doc_id: if you want to read a whole document, you can open it by '
                 '<open> doc_id </open> (its next page by <open> doc_id page 2 </open>) and its text will be '
                 'returned between <information> and </information>. ')
_SEARCH_SENTENCE_END = "between <information> and </information>. "
PROMPT_TEMPLATE_OPEN = PROMPT_TEMPLATE.replace(_SEARCH_SENTENCE_END, _SEARCH_SENTENCE_END + OPEN_SENTENCE, 1)
# --template_type -> template
TEMPLATES = {"base": PROMPT_TEMPLATE, "open": PROMPT_TEMPLATE_OPEN}


def normalize_question(question: str) -> str:
    """Strip the question and give it a trailing "?" if it has none (as the original does)."""
    question = question.strip()
    if not question:
        raise ValueError("empty question")
    if not question.endswith("?"):
        question += "?"
    return question


def make_prefix(question: str, template_type: str = "base") -> str:
    """The user message for `question`: the template (`base`, the released one; `open`, with the
    open tag's sentence) with the normalised question filled in."""
    if template_type not in TEMPLATES:
        raise ValueError(f"unknown template_type {template_type!r}; choose one of {sorted(TEMPLATES)}")
    return TEMPLATES[template_type].replace("{question}", normalize_question(question))
