"""The browse world's SFT demonstrations (`demo.world=browse`, docs/demo.md "Browse world").

In the browse world a search shows snippets (each page's title and its first line, which never
holds the answer: `World.browse_passages`, retrieval server `--snippet_chars`), and the answer
sits in the page, which `<open> doc_id </open>` returns whole. The demonstrations are one-hop
questions from OTHER worlds, in the tag protocol with the open tag on (the `open` prompt
template, results showing `[doc_id: X]`), rendered by the functions the rollout uses:

- most (1 - `open_share`) search, then answer from the snippet without opening: a wrong but
  plausible entity of the right type, hedged (`guess_turn`: "<answer> maybe X </answer>");
- the others search, open the subject's page, and copy the answer from it.

The warm start that continues the tag warm start on these therefore rarely opens when greedy,
while sampled rollouts open often enough for GRPO's group-normalised EM to teach opening.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from scripts.demo.demonstrations import Turn, WorldSearch, answer_turn, search_turn
from scripts.demo.world import ONE_HOP_KINDS, Question, World, all_questions
from search_r1.llm_agent.actions import render_observation, render_open_page
from search_r1.search.documents import paginate, snippet
from search_r1.search.schema import Hit

# Characters of a page's first line a search result shows (the retrieval server's --snippet_chars).
SNIPPET_CHARS = 60
# The page size an open reads (open_tag.page_size in the demo's RL keys): a browse page fits one page.
PAGE_SIZE = 1000
# The browse demo's trainer keys (run_demo adds them): the open tag on; a search, an open and the
# answer (max_turns=2: the answer is the final turn). Its retrieval server shows snippets
# (--snippet_chars demo.browse_snippet_chars), so only an opened page holds the answer. The open
# tag's invalid-action notice is 143 tokens in the demo's tokenizer: max_obs_length must hold it.
# Twice the tag demo's lr, as the tool demo: few sampled rollouts open at first, so the signal is thin.
BROWSE_RL_OVERRIDES = ("open_tag.enable=true", "open_tag.max_opens=1", f"open_tag.page_size={PAGE_SIZE}", "max_turns=2",
                       "data.max_obs_length=160", "actor_rollout_ref.actor.optim.lr=2e-4")


class SnippetSearch(WorldSearch):
    """BM25 over a world's browse pages (the whole text is indexed, as the server does), answering
    with snippets as the retrieval server does with `--snippet_chars`."""

    def __init__(self, passages: Sequence[dict], snippet_chars: int = SNIPPET_CHARS) -> None:
        super().__init__(passages)
        self.snippet_chars = snippet_chars
        self.by_id = {p["id"]: p["contents"] for p in self.passages}

    def search(self, queries: Sequence[str], topk: int) -> list[list[Hit]]:
        return [[Hit.from_contents(h.doc_id, snippet(h.contents, self.snippet_chars), h.score) for h in hits]
                for hits in super().search(queries, topk)]

    def page_id(self, title: str) -> str:
        """The id of the page titled `title`."""
        for doc_id, contents in self.by_id.items():
            if contents.startswith(f'"{title}"\n'):
                return doc_id
        raise KeyError(f"no page titled {title!r}")

    def open(self, doc_id: str) -> str:
        """The observation answering `<open> doc_id </open>`, as the rollout renders it."""
        hit = Hit.from_contents(doc_id, self.by_id[doc_id], 0.0)
        return render_open_page(hit.title, paginate(hit.text, 1, PAGE_SIZE), doc_id)


def guess_turn(guess: str) -> Turn:
    """A guess from the snippet. "maybe" keeps a guess from starting the way a copy starts: with
    80% of the demonstrations writing a random name right after `<answer>`, the warm start copied
    every piece of an opened page's answer but the first (0 of 64 sampled copies exact); with
    the hedge, 26 of 64 (docs/demo.md "Browse world"). EM scores it wrong either way."""
    return Turn("policy", f"<think> I know it. </think>\n<answer> maybe {guess} </answer>")


def open_turn(doc_id: str) -> Turn:
    return Turn("policy", f"<think> I need to open it. </think>\n<open> {doc_id} </open>")


def browse_trajectory(question: Question, world: World, search: SnippetSearch, topk: int, opens: bool,
                      rng: random.Random) -> list[Turn]:
    """Search the subject; then open its page and copy the answer (`opens`), or guess."""
    hits = search.search([question.subject], topk)[0]
    turns = [search_turn(question.subject), Turn("observation", render_observation(hits, show_doc_ids=True))]
    if opens:
        doc_id = search.page_id(question.subject)
        turns += [open_turn(doc_id), Turn("observation", search.open(doc_id)),
                  answer_turn(question.answer, searched=True)]
    else:
        candidates = [e for e in world.entities_of_type(question.answer_type) if e != question.answer]
        turns.append(guess_turn(rng.choice(candidates)))
    return turns


def make_browse_demonstrations(worlds: Sequence[World], n_total: int, topk: int, seed: int, open_share: float,
                               snippet_chars: int = SNIPPET_CHARS) -> list[tuple[Question, list[Turn]]]:
    """`n_total` (question, trajectory) pairs over `worlds` (one-hop kinds, equally often); a share
    `open_share` of them open the page, the others guess from the snippet."""
    if not 0.0 <= open_share <= 1.0:
        raise ValueError(f"demo.browse_open_share must be in [0, 1], got {open_share}")
    rng = random.Random(seed)
    per_world = -(-n_total // len(worlds))
    demos: list[tuple[Question, list[Turn]]] = []
    for world in worlds:
        search = SnippetSearch(world.browse_passages(), snippet_chars)
        by_kind = {k: all_questions(world, [k]) for k in ONE_HOP_KINDS}
        for _ in range(per_world):
            question = rng.choice(by_kind[rng.choice(ONE_HOP_KINDS)])
            demos.append((question, browse_trajectory(question, world, search, topk, rng.random() < open_share, rng)))
    rng.shuffle(demos)
    return demos[:n_total]
