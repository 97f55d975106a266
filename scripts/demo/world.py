"""A synthetic, fictional world: the demo's knowledge base and its questions.

Everything is generated from a seed, so a world can be rebuilt exactly. Names are made
of random syllables, so no answer can be guessed and a model must search and copy.

    world = make_world(seed=0)
    world.passages()            # corpus rows {"id", "contents": "\"Title\"\ntext"}
    world.questions(rng)        # Question objects (one-hop and two-hop)

Passages:
    "Name"     Name was born in City and works at Company.
    "City"     City is a city in Country.
    "Company"  Company was founded by Founder.

The browse world (`demo.world=browse`, `world.browse_passages()`) holds the same facts in pages
whose text's first line only says what the page is about ("Name is a person."); the fact is on
the next line. Its search server shows snippets (the title and that first line, retrieval
server `--snippet_chars`), so an agent must open a result (`<open> doc_id </open>`) to answer.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

SYLLABLES = (
    "ka", "lo", "mi", "ra", "ven", "dor", "sil", "tha", "bru", "nel", "qui", "zar", "fen", "mo",
    "pal", "ri", "sto", "vak", "el", "gan", "hu", "jor", "lis", "mer", "nor", "os", "pe", "rin",
    "sa", "tor", "ul", "vi", "wen", "ya", "zu", "bel", "cor", "dri", "fa", "gil", "ha", "ik",
    "lum", "na", "ob", "pra", "ru", "sen", "tu", "var",
)
COMPANY_SUFFIXES = ("Labs", "Works", "Systems", "Group", "Foods", "Motors", "Media", "Energy")

# One-hop kinds need one search; two-hop kinds need two (the second on the first's answer).
ONE_HOP_KINDS = ("birthplace", "employer", "country", "founder")
TWO_HOP_KINDS = ("birth_country", "employer_founder")
# demo.world: "facts" (search results hold the answer) or "browse" (they are snippets without it:
# the agent must open a page). The browse world asks one-hop questions only (search, open, answer).
WORLDS = ("facts", "browse")
QUESTION_TEMPLATES = {
    "birthplace": "Where was {x} born?",
    "employer": "Which company does {x} work at?",
    "country": "In which country is {x}?",
    "founder": "Who founded {x}?",
    "birth_country": "In which country was {x} born?",
    "employer_founder": "Who founded the company that {x} works at?",
}


@dataclass(frozen=True)
class Question:
    """A question with its answer and the search path a perfect agent would take."""

    kind: str
    subject: str                   # the entity the question is about
    text: str
    answer: str
    hops: tuple[str, ...]          # the search queries, in order (one per hop)
    answer_type: str               # "city" | "company" | "country" | "person": for plausible guesses


@dataclass
class World:
    seed: int
    people: list[str]
    cities: list[str]
    companies: list[str]
    countries: list[str]
    founders: list[str]
    birthplace: dict[str, str] = field(default_factory=dict)
    employer: dict[str, str] = field(default_factory=dict)
    country_of: dict[str, str] = field(default_factory=dict)
    founder_of: dict[str, str] = field(default_factory=dict)

    def passages(self) -> list[dict]:
        """Corpus rows in the Search-R1 layout; ids are unique strings."""
        texts = [f'"{p}"\n{p} was born in {self.birthplace[p]} and works at {self.employer[p]}.' for p in self.people]
        texts += [f'"{c}"\n{c} is a city in {self.country_of[c]}.' for c in self.cities]
        texts += [f'"{c}"\n{c} was founded by {self.founder_of[c]}.' for c in self.companies]
        return [{"id": str(i), "contents": t} for i, t in enumerate(texts)]

    def browse_passages(self) -> list[dict]:
        """The browse world's pages (the facts of `passages()`): a one-line summary that does not
        hold the answer, then the fact. A page's id is its title (names are unique in a world), so
        `<open> id </open>` copies a name, as a search does, not a number the model cannot copy."""
        texts = [f'"{p}"\n{p} is a person.\n{p} was born in {self.birthplace[p]} and works at {self.employer[p]}.'
                 for p in self.people]
        texts += [f'"{c}"\n{c} is a city.\n{c} is a city in {self.country_of[c]}.' for c in self.cities]
        texts += [f'"{c}"\n{c} is a company.\n{c} was founded by {self.founder_of[c]}.' for c in self.companies]
        return [{"id": t.split("\n", 1)[0].strip('"'), "contents": t} for t in texts]

    def pages(self, world: str) -> list[dict]:
        """The corpus of `world` ("facts": passages(); "browse": browse_passages())."""
        if world not in WORLDS:
            raise ValueError(f"demo.world takes one of {', '.join(WORLDS)}, got {world!r}")
        return self.browse_passages() if world == "browse" else self.passages()

    def entities_of_type(self, answer_type: str) -> Sequence[str]:
        return {"city": self.cities, "company": self.companies, "country": self.countries,
                "person": self.founders}[answer_type]

    def question(self, kind: str, subject: str) -> Question:
        text = QUESTION_TEMPLATES[kind].format(x=subject)
        if kind == "birthplace":
            return Question(kind, subject, text, self.birthplace[subject], (subject,), "city")
        if kind == "employer":
            return Question(kind, subject, text, self.employer[subject], (subject,), "company")
        if kind == "country":
            return Question(kind, subject, text, self.country_of[subject], (subject,), "country")
        if kind == "founder":
            return Question(kind, subject, text, self.founder_of[subject], (subject,), "person")
        if kind == "birth_country":
            city = self.birthplace[subject]
            return Question(kind, subject, text, self.country_of[city], (subject, city), "country")
        if kind == "employer_founder":
            company = self.employer[subject]
            return Question(kind, subject, text, self.founder_of[company], (subject, company), "person")
        raise KeyError(f"unknown question kind {kind!r}; known: {sorted(QUESTION_TEMPLATES)}")

    def subjects(self, kind: str) -> Sequence[str]:
        if kind in ("birthplace", "employer", "birth_country", "employer_founder"):
            return self.people
        if kind == "country":
            return self.cities
        if kind == "founder":
            return self.companies
        raise KeyError(f"unknown question kind {kind!r}")


class _NameMaker:
    """Unique names from syllables; `taken` is shared so no two entities share a name."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.taken: set[str] = set()

    def word(self, min_syl: int = 2, max_syl: int = 3) -> str:
        n = self.rng.randint(min_syl, max_syl)
        return "".join(self.rng.choice(SYLLABLES) for _ in range(n)).capitalize()

    def unique(self, make) -> str:
        for _ in range(1000):
            name = make()
            # A name whose words are already names would make retrieval ambiguous.
            words = [w for w in name.split() if w not in COMPANY_SUFFIXES]
            if name not in self.taken and not any(w in self.taken for w in words):
                self.taken.add(name)
                self.taken.update(words)
                return name
        raise RuntimeError("could not draw a unique name; enlarge SYLLABLES")


def make_world(seed: int, n_people: int = 300, n_cities: int = 100, n_companies: int = 100,
               n_countries: int = 15, n_founders: int = 100) -> World:
    """A world with the given sizes; identical for identical arguments."""
    rng = random.Random(seed)
    names = _NameMaker(rng)
    people = [names.unique(lambda: f"{names.word()} {names.word()}") for _ in range(n_people)]
    founders = [names.unique(lambda: f"{names.word()} {names.word()}") for _ in range(n_founders)]
    cities = [names.unique(lambda: names.word(2, 3)) for _ in range(n_cities)]
    countries = [names.unique(lambda: names.word(2, 3) + "ia") for _ in range(n_countries)]
    companies = [names.unique(lambda: f"{names.word(2, 2)} {rng.choice(COMPANY_SUFFIXES)}")
                 for _ in range(n_companies)]
    world = World(seed, people, cities, companies, countries, founders)
    for p in people:
        world.birthplace[p] = rng.choice(cities)
        world.employer[p] = rng.choice(companies)
    for c in cities:
        world.country_of[c] = rng.choice(countries)
    for c in companies:
        world.founder_of[c] = rng.choice(founders)
    return world


def all_questions(world: World, kinds: Sequence[str]) -> list[Question]:
    """Every question of the given kinds, in a fixed order."""
    return [world.question(kind, s) for kind in kinds for s in world.subjects(kind)]


def split_by_subject(questions: Sequence[Question], held_out_fraction: float, seed: int
                     ) -> tuple[list[Question], list[Question]]:
    """Split so that no subject (nor the person behind a two-hop question) is on both sides.

    Entities are split, not questions: otherwise RL could memorise "X was born in Y" from a
    training question and answer a validation question about X without searching.
    """
    subjects = sorted({q.subject for q in questions})
    rng = random.Random(seed)
    rng.shuffle(subjects)
    held = set(subjects[: int(len(subjects) * held_out_fraction)])
    train = [q for q in questions if q.subject not in held]
    test = [q for q in questions if q.subject in held]
    return train, test
