"""The rollout's text protocol (DESIGN §3.3): pure functions on text, no tokens.

A policy turn is parsed into an `Action`; retrieved hits are rendered into the
`<information>` observation; the notices the environment inserts (invalid action,
search budget spent, search failed) are fixed strings. The generation manager is the
only place where these strings become token ids.

Each way a trajectory can end is a small named function returning its reason, so
the manager can count why rows stopped (STYLE §6).
"""

from __future__ import annotations

import re
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

# Matches the first complete action; a tag name must close with the same name.
_ACTION_RE = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
_ACTION_WITH_OPEN_RE = re.compile(r"<(search|answer|open)>(.*?)</\1>", re.DOTALL)
# An open's content: the doc id, optionally followed by `page N` (the server refuses a page out of range).
_OPEN_PAGE_RE = re.compile(r"^(.*?)(?:[\s,;]+page\s*(\d+))?$", re.DOTALL | re.IGNORECASE)

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
    """
    match = (_ACTION_WITH_OPEN_RE if open_tag else _ACTION_RE).search(text)
    if match is None:
        return Action(kind="invalid", content="")
    kind = match.group(1)
    content = match.group(2).strip()
    if kind in ("search", "open") and not content:
        return Action(kind="invalid", content="")
    if kind == "open" and not parse_open(content)[0]:
        return Action(kind="invalid", content="")
    return Action(kind=kind, content=content, end=match.end())  # type: ignore[arg-type]


def parse_open(content: str) -> tuple[str, int]:
    """(doc_id, page) of an open's content: `doc_id` (page 1) or `doc_id page N`. The id is
    taken as written (stripped); one the server does not know is answered as unknown, not refused here."""
    match = _OPEN_PAGE_RE.match(content.strip())
    assert match is not None  # the pattern matches every string
    doc_id, page = match.group(1).strip(), match.group(2)
    return doc_id, 1 if page is None else int(page)


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
