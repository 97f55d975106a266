"""Demonstration trajectories for the supervised warm start, with real search results.

Each demonstration is a question from a world that is NOT the evaluation world (each
world has its own BM25 index), so the model learns to search and copy, not to memorise.
A trajectory is a list of turns, each `policy` (trained on) or `observation` (the
retrieved `<information>` block, rendered exactly as the rollout renders it).

The strategy gap RL is meant to find: for some question kinds a large share of the
demonstrations answer WITHOUT searching, with a wrong but plausible entity of the right
type ("<think> I know it. </think>"). The warm-started greedy policy therefore often
guesses on those kinds, while sampled rollouts still search often enough for GRPO's
group-normalised EM reward to teach "always search".
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from scripts.demo.world import ONE_HOP_KINDS, TWO_HOP_KINDS, Question, World, all_questions
from search_r1.llm_agent.actions import render_observation
from search_r1.search.schema import Hit

# Share of demonstrations that guess instead of searching, per question kind.
DEFAULT_GUESS_SHARE = {
    "birthplace": 0.15, "employer": 0.15,
    "country": 0.7, "founder": 0.7,
    "birth_country": 0.7, "employer_founder": 0.7,
}
# Share of each kind among the demonstrations (two-hop needs more practice).
DEFAULT_KIND_WEIGHTS = {
    "birthplace": 1.0, "employer": 1.0, "country": 1.0, "founder": 1.0,
    "birth_country": 1.0, "employer_founder": 1.0,
}


@dataclass(frozen=True)
class Turn:
    role: str   # "policy" | "observation"
    text: str


class WorldSearch:
    """An in-process BM25 index over one world's passages, tokenized exactly as the
    project's BM25 retriever does, so demonstrations see what the server returns."""

    def __init__(self, passages: Sequence[dict]) -> None:
        import bm25s

        from search_r1.search.retrievers import bm25_tokenize, english_stemmer

        self._tokenize = bm25_tokenize
        self.passages = list(passages)
        self.stemmer = english_stemmer()
        self.index = bm25s.BM25()
        self.index.index(bm25_tokenize([p["contents"] for p in self.passages], self.stemmer), show_progress=False)

    def search(self, queries: Sequence[str], topk: int) -> list[list[Hit]]:
        ids, scores = self.index.retrieve(self._tokenize(list(queries), self.stemmer), k=topk, show_progress=False)
        return [
            [Hit.from_contents(self.passages[int(i)]["id"], self.passages[int(i)]["contents"], float(sc))
             for i, sc in zip(row_ids, row_scores, strict=True)]
            for row_ids, row_scores in zip(ids, scores, strict=True)
        ]


def search_turn(query: str) -> Turn:
    return Turn("policy", f"<think> I need to search {query}. </think>\n<search> {query} </search>")


def answer_turn(answer: str, searched: bool) -> Turn:
    thought = "I found it." if searched else "I know it."
    return Turn("policy", f"<think> {thought} </think>\n<answer> {answer} </answer>")


def searched_trajectory(question: Question, search: WorldSearch, topk: int) -> list[Turn]:
    turns = []
    for query in question.hops:
        turns.append(search_turn(query))
        turns.append(Turn("observation", render_observation(search.search([query], topk)[0])))
    turns.append(answer_turn(question.answer, searched=True))
    return turns


def guessed_trajectory(question: Question, world: World, rng: random.Random) -> list[Turn]:
    candidates = [e for e in world.entities_of_type(question.answer_type) if e != question.answer]
    return [answer_turn(rng.choice(candidates), searched=False)]


def make_demonstrations(
    worlds: Sequence[World],
    n_total: int,
    topk: int,
    seed: int,
    guess_share: Mapping[str, float] = DEFAULT_GUESS_SHARE,
    kind_weights: Mapping[str, float] = DEFAULT_KIND_WEIGHTS,
    searched: Callable[[Question, WorldSearch, int], list[Turn]] = searched_trajectory,
    guessed: Callable[[Question, World, random.Random], list[Turn]] = guessed_trajectory,
) -> list[tuple[Question, list[Turn]]]:
    """`n_total` (question, trajectory) pairs drawn over `worlds` and kinds; `searched` / `guessed`
    write a trajectory in one protocol (default: the tag protocol), the draws are the same for all."""
    rng = random.Random(seed)
    kinds = list(ONE_HOP_KINDS + TWO_HOP_KINDS)
    weights = [kind_weights[k] for k in kinds]
    per_world = -(-n_total // len(worlds))
    demos: list[tuple[Question, list[Turn]]] = []
    for world in worlds:
        search = WorldSearch(world.passages())
        by_kind = {k: all_questions(world, [k]) for k in kinds}
        for _ in range(per_world):
            kind = rng.choices(kinds, weights=weights)[0]
            question = rng.choice(by_kind[kind])
            if rng.random() < guess_share[kind]:
                demos.append((question, guessed(question, world, rng)))
            else:
                demos.append((question, searched(question, search, topk)))
    rng.shuffle(demos)
    return demos[:n_total]
