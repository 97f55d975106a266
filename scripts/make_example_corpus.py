"""Generate the example retrieval corpus (example/corpus.jsonl) and synthetic corpora.

Passages are written for this project: a fictional world (towns, rivers, engineers,
companies) built from templates with a fixed seed, plus a few general-knowledge
paragraphs written by hand. The same generator makes the large synthetic corpora that
the retrieval benchmark and the RAM measurement use.

    python scripts/make_example_corpus.py --out example/corpus.jsonl --num 300
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterator
from pathlib import Path

_SYLLABLES = (
    "ka ro mi ta len dor vi sa bel nor ga thi mu ran ek lo sen fa ur iv pel ost "
    "ma quin tes bra ho zel cal den"
).split()
_PRODUCTS = "wool, glassware, copper bells, river salt, paper lanterns, barley beer, clay tiles, honey".split(", ")
_FESTIVALS = "lantern festival, harvest fair, boat race, music week, kite day, bread market".split(", ")
_SEASONS = ["spring", "summer", "autumn", "winter"]
_SEAS = ["Grey Sea", "Amber Bay", "Northern Gulf", "Quiet Ocean"]
_DEVICES = (
    "water clock, steam loom, folding bridge, glass kiln, signal tower, rope railway, "
    "wind pump, printing drum"
).split(", ")
_INDUSTRIES = "shipbuilding, textiles, mining, printing, brewing, glassmaking, railways".split(", ")

HANDWRITTEN = [
    ("Photosynthesis", "Photosynthesis is the process by which green plants use light to turn water and "
     "carbon dioxide into sugar, releasing oxygen as a by-product."),
    ("Water cycle", "Water evaporates from oceans and lakes, condenses into clouds, and returns to the ground "
     "as rain or snow, which then flows back to the sea through rivers."),
    ("Prime number", "A prime number is a whole number greater than one whose only divisors are one and "
     "itself; two, three, five and seven are the first four primes."),
    ("Moon", "The Moon is the natural satellite of the Earth. It shows phases because we see different "
     "parts of its sunlit half as it orbits the Earth about once a month."),
    ("Volcano", "A volcano is an opening in a planet's crust through which molten rock, ash and gases "
     "escape; lava that cools quickly forms fine-grained rock."),
    ("Compass", "A magnetic compass has a needle that lines up with the Earth's magnetic field, so it "
     "points roughly north and helps travellers find their direction."),
    ("Bread", "Bread is made by mixing flour, water and usually yeast; the yeast produces gas that makes "
     "the dough rise before it is baked."),
    ("Honeybee", "Honeybees live in colonies with one queen, many workers and some drones; workers gather "
     "nectar and pollen and turn nectar into honey."),
    ("Lighthouse", "A lighthouse is a tower with a bright lamp that warns ships of rocks and coasts and "
     "marks the entrance to harbours at night."),
    ("Chess", "Chess is a board game for two players on a board of sixty-four squares; the aim is to "
     "checkmate the opposing king."),
    ("Glacier", "A glacier is a slow river of ice formed from snow that builds up over many years and "
     "moves downhill under its own weight."),
    ("Telescope", "A telescope gathers light with lenses or mirrors so that distant objects such as planets "
     "and stars appear brighter and larger."),
]


def _name(rng: random.Random, parts: int) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(parts)).capitalize()


class _Names:
    """Unique capitalised names; a repeat gets a numeric suffix so titles stay unique."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.seen: set[str] = set()

    def new(self, parts: int) -> str:
        name = _name(self.rng, parts)
        base, n = name, 2
        while name in self.seen:
            name, n = f"{base} {n}", n + 1
        self.seen.add(name)
        return name


def world_passages(num: int, seed: int = 0) -> Iterator[tuple[str, str]]:
    """(title, text) pairs of a fictional world; deterministic for a seed."""
    rng = random.Random(seed)
    names = _Names(rng)
    provinces = [names.new(2) for _ in range(8)]
    rivers: list[str] = []
    towns: list[str] = []
    made = 0
    while made < num:
        kind = made % 4
        if kind == 0 or not rivers:
            river = names.new(2)
            rivers.append(river)
            text = (
                f"The {river} river rises in the {names.new(2)} hills and flows "
                f"{rng.choice(['north', 'south', 'east', 'west'])} for {rng.randint(40, 900)} kilometres "
                f"before it reaches the {rng.choice(_SEAS)}."
            )
            title = f"{river} river"
        elif kind == 1 or not towns:
            town = names.new(3)
            towns.append(town)
            title = town
            text = (
                f"{town} is a {rng.choice(['small', 'busy', 'market', 'hill'])} town on the "
                f"{rng.choice(rivers)} river in the province of {rng.choice(provinces)}. It is known for its "
                f"{rng.choice(_PRODUCTS)} and its {rng.choice(_FESTIVALS)}, held every "
                f"{rng.choice(_SEASONS)}. About {rng.randint(2, 90) * 1000} people live there."
            )
        elif kind == 2:
            person = f"{names.new(2)} {names.new(3)}"
            title = person
            text = (
                f"{person} was an engineer born in {rng.choice(towns)} in {rng.randint(1700, 1950)}, "
                f"who built the first {rng.choice(_DEVICES)}. Later in life {person.split()[0]} taught "
                f"at the academy of {rng.choice(towns)}."
            )
        else:
            company = f"{names.new(2)} Works"
            title = company
            text = (
                f"{company} is a {rng.choice(_INDUSTRIES)} company founded in {rng.randint(1800, 2000)} "
                f"with its head office in {rng.choice(towns)}. It employs about {rng.randint(50, 5000)} people."
            )
        yield title, text
        made += 1


def corpus_rows(num: int, seed: int = 0, handwritten: bool = True) -> Iterator[dict[str, str]]:
    """Corpus lines ``{"id", "contents"}`` with contents ``"\\"Title\\"\\ntext"``."""
    pairs: list[tuple[str, str]] = list(HANDWRITTEN) if handwritten else []
    rows = iter(pairs)
    generated = world_passages(max(0, num - len(pairs)), seed)
    for i, (title, text) in enumerate(_chain(rows, generated)):
        yield {"id": str(i), "contents": f'"{title}"\n{text}'}


def _chain(*iters: Iterator[tuple[str, str]]) -> Iterator[tuple[str, str]]:
    for it in iters:
        yield from it


def write_corpus(path: str | Path, num: int, seed: int = 0, handwritten: bool = True) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in corpus_rows(num, seed, handwritten):
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="example/corpus.jsonl")
    p.add_argument("--num", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    print(write_corpus(args.out, args.num, args.seed))


if __name__ == "__main__":
    main()
