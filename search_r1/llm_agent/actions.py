"""The rollout's text protocol (DESIGN §3.3): pure functions on text, no tokens.

A policy turn is parsed into an `Action`; retrieved hits are rendered into the
`<information>` observation; the notices the environment inserts (invalid action,
search budget spent, search failed) are fixed strings. The generation manager is the
only place where these strings become token ids.

Each way a trajectory can end is a small named function returning its reason, so
the manager can count why rows stopped (STYLE §6).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from search_r1.search.documents import Page, render_page
from search_r1.search.schema import Hit

SEARCH_OPEN, SEARCH_CLOSE = "<search>", "</search>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
# The second tag (`open_tag.enable`; off by default): `<open> doc_id </open>` or `<open> doc_id page 2 </open>`.
OPEN_OPEN, OPEN_CLOSE = "<open>", "</open>"
INFORMATION_OPEN = "\n\n<information>"
INFORMATION_CLOSE = "</information>\n\n"

# The engine stops a turn as soon as one of these is written (DESIGN §4.2).
STOP_STRINGS: tuple[str, ...] = (SEARCH_CLOSE, ANSWER_CLOSE)

# Observations, not policy text: they are masked out of the loss, and rewards read
# policy tokens only, so the tags inside the notice are never scored. The wording is
# the original's, byte for byte: a released checkpoint was trained on it.
INVALID_ACTION_NOTICE = (
    "\nMy previous action is invalid. "
    "If I want to search, I should put the query between <search> and </search>. "
    "If I want to give the final answer, I should put the answer between <answer> and </answer>. "
    "Let me try again.\n"
)
SEARCH_BUDGET_NOTICE = (
    "\nMy search budget is spent: this search was not run, and I cannot search any more.\n"
)
SEARCH_FAILED_TEXT = "The search engine failed to answer this query; no documents were retrieved."

# With the open tag on only (new strings: the original never had them). The invalid-action notice
# then also says how to open; the original's (above) is used whenever the tag is off.
INVALID_ACTION_NOTICE_WITH_OPEN = (
    "\nMy previous action is invalid. "
    "If I want to search, I should put the query between <search> and </search>. "
    "If I want to read a document from the search results, I should put its doc_id between <open> and </open>. "
    "If I want to give the final answer, I should put the answer between <answer> and </answer>. "
    "Let me try again.\n"
)
OPEN_BUDGET_NOTICE = (
    "\nMy open budget is spent: this document was not opened, and I cannot open any more documents.\n"
)
OPEN_FAILED_TEXT = "The document could not be opened: the search engine did not answer."

# The tags an action may use, without and with the open tag; a tag must close with its own name.
_TAGS = (("search", SEARCH_OPEN, SEARCH_CLOSE), ("answer", ANSWER_OPEN, ANSWER_CLOSE))
_TAGS_WITH_OPEN = _TAGS + (("open", OPEN_OPEN, OPEN_CLOSE),)
# An open's page number has at most this many digits; a longer one makes the open invalid (int() refuses
# past 4,300 digits and no document has a billion pages). docs/agent.md "Hostile inputs".
MAX_OPEN_PAGE_DIGITS = 9
_OPEN_SEPARATORS = ",;"     # between the doc id and `page N`, with any whitespace

ActionKind = Literal["search", "answer", "open", "invalid"]


@dataclass(frozen=True)
class Action:
    """What a policy turn asked for. `end` is the character offset just past the action
    in the parsed text (0 for an invalid action), so the caller can cut the turn there."""

    kind: ActionKind
    content: str
    end: int = 0

    @property
    def is_valid(self) -> bool:
        return self.kind != "invalid"


def parse_action(text: str, open_tag: bool = False) -> Action:
    """The first complete `<search>q</search>` or `<answer>a</answer>` in `text` (with `open_tag`,
    also `<open>doc_id</open>`; the first complete action of any kind wins).

    A search with an empty query is invalid: it could not be sent to the server
    without failing the whole batch's request. So is an open without a doc id.

    Found with str.find, linear in the text whatever it holds: of each tag, only the first
    opening can start the first complete action (if it is never closed, no later one is).
    """
    best: tuple[int, str, int, int] | None = None       # (start, kind, content start, content end)
    end = 0
    for kind, opening, closing in (_TAGS_WITH_OPEN if open_tag else _TAGS):
        start = text.find(opening)
        if start < 0 or (best is not None and start > best[0]):
            continue
        close = text.find(closing, start + len(opening))
        if close >= 0:
            best, end = (start, kind, start + len(opening), close), close + len(closing)
    if best is None:
        return Action(kind="invalid", content="")
    _, kind, content_start, content_end = best
    content = text[content_start:content_end].strip()
    if kind in ("search", "open") and not content:
        return Action(kind="invalid", content="")
    if kind == "open" and not parse_open(content)[0]:
        return Action(kind="invalid", content="")
    return Action(kind=kind, content=content, end=end)  # type: ignore[arg-type]


def parse_open(content: str) -> tuple[str, int]:
    """(doc_id, page) of an open's content: `doc_id` (page 1) or `doc_id page N` (`page` in any case,
    after whitespace, `,` or `;`). The id is taken as written (stripped); one the server does not know
    is answered as unknown, not refused here. A page of more than MAX_OPEN_PAGE_DIGITS digits gives
    ("", 0): no doc id, an invalid open.

    Read from the end without a regex (a pattern with a lazy id and a separator run backtracks
    quadratically on text like `a", ", ", …`): trailing digits, whitespace, `page`, then at least one
    separator; the id is what precedes the separators.
    """
    text = content.strip()
    i = len(text)
    while i > 0 and text[i - 1].isdecimal():
        i -= 1
    digits = text[i:]
    while i > 0 and text[i - 1].isspace():
        i -= 1
    word_start = i - len("page")
    sep = word_start
    while sep > 0 and (text[sep - 1].isspace() or text[sep - 1] in _OPEN_SEPARATORS):
        sep -= 1
    if not digits or word_start < 0 or text[word_start:i].lower() != "page" or sep == word_start:
        return text, 1
    if len(digits) > MAX_OPEN_PAGE_DIGITS:
        return "", 0
    return text[:sep].strip(), int(digits)


def has_complete_action(text: str, open_tag: bool = False) -> bool:
    """True once `text` contains a complete action (monotone in text prefixes)."""
    return parse_action(text, open_tag).is_valid


def render_passages(hits: list[Hit], show_doc_ids: bool = False) -> str:
    """`Doc {i}(Title: {first_line}) {rest}\\n` per hit, numbered from 1.

    `first_line` is the stored contents' first line exactly as stored (wiki-18 titles
    keep their double quotes) and `rest` the remaining lines, as the original renders
    them; `Hit.title` (quotes removed) is for rerankers and logs, not for this text.
    `show_doc_ids` (the open tag on): `Doc {i}(Title: {first_line}) [doc_id: {id}] {rest}`,
    the id the policy opens (the tool protocol's `show_doc_ids` choice, in this format).
    """
    parts = []
    for i, hit in enumerate(hits, start=1):
        first_line, _, rest = hit.contents.partition("\n")
        doc = f" [doc_id: {hit.doc_id}]" if show_doc_ids else ""
        parts.append(f"Doc {i}(Title: {first_line}){doc} {rest}\n")
    return "".join(parts)


def render_observation(hits: list[Hit], show_doc_ids: bool = False) -> str:
    """The observation appended after a search: the passages, stripped, inside `<information>`."""
    return INFORMATION_OPEN + render_passages(hits, show_doc_ids).strip() + INFORMATION_CLOSE


def render_open_page(title: str, page: Page, doc_id: str) -> str:
    """The observation appended after an open: one page of the document (`documents.render_page`'s
    header and text, as the tool protocol's open tool writes it) inside `<information>`."""
    return INFORMATION_OPEN + render_page(title, page, f"doc {doc_id}").strip() + INFORMATION_CLOSE


def render_open_unknown(message: str) -> str:
    """The observation appended when the server does not have the document or page asked for
    (`message` is the server's, e.g. `no document with id '9'`)."""
    return INFORMATION_OPEN + f"The document could not be opened: {message}." + INFORMATION_CLOSE


def render_open_failure() -> str:
    """The observation appended when the retrieval server could not answer an open."""
    return INFORMATION_OPEN + OPEN_FAILED_TEXT + INFORMATION_CLOSE


def render_search_failure() -> str:
    """The observation appended when the retrieval server could not answer."""
    return INFORMATION_OPEN + SEARCH_FAILED_TEXT + INFORMATION_CLOSE


# --- stop rules: each returns the reason a row ends, or None to keep going -------

ANSWERED = "answered"
EOS = "eos"
MAX_TURNS = "max_turns"
CONTEXT_FULL = "context_full"
INVALID_ACTION = "invalid_action"
STOP_REASONS: tuple[str, ...] = (ANSWERED, EOS, MAX_TURNS, CONTEXT_FULL, INVALID_ACTION)
# An agent loop of the user's ended the row by its own rule (agent_loops.py); counted only when it happens.
AGENT_LOOP = "agent_loop"


def stop_if_answered(action: Action) -> str | None:
    """An answer ends the trajectory."""
    return ANSWERED if action.kind == "answer" else None


def stop_if_eos(action: Action, emitted_eos: bool) -> str | None:
    """EOS without an action: the model closed its turn, nothing left to do."""
    return EOS if emitted_eos and not action.is_valid else None


def stop_if_final_turn(action: Action, is_final_turn: bool) -> str | None:
    """The turn after the last allowed search ends the row whatever it did.

    A search (or an open) there gets the budget notice; anything else that is not an
    answer (caught earlier) is an invalid action.
    """
    if not is_final_turn:
        return None
    return MAX_TURNS if action.kind in ("search", "open") else INVALID_ACTION


def stop_if_context_full(response_len: int, turn_budget: int, max_total_response_length: int | None) -> str | None:
    """A row that could not fit one more turn (policy + observation) stops before it."""
    if max_total_response_length is None:
        return None
    return CONTEXT_FULL if response_len + turn_budget > max_total_response_length else None
