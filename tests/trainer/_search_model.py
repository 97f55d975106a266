"""A tiny world for end-to-end search tests: a corpus, questions about it, and a tiny
Qwen2 warmed up (a few seconds of supervised training) to search before it answers.

A randomly initialised model almost never writes a well-formed `<search> q </search>`,
so a run with a real retrieval server would never call it. The warm-up teaches the
model one fixed trajectory per question, in the exact token layout the generation
manager builds (prompt, first turn, `<information>` observation, answering turn), with
the loss on policy tokens only, as RL trains it.

    corpus = write_corpus(tmp / "corpus.jsonl")
    retriever = build_bm25_retriever(corpus, tmp / "index")
    model_dir = warm_up_searching_model(tiny_model_dir, retriever, tmp / "model")
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from scripts.bench.toy_task import ToyPaths
from search_r1.llm_agent.actions import render_observation
from search_r1.prompt import make_prefix
from verl.utils.dataset.rl_dataset import prompt_to_text

DATA_SOURCE = "nq"        # a source the rule reward manager scores with exact match
TOPK = 1                  # one passage per search keeps observations short


@dataclass(frozen=True)
class Question:
    question: str
    query: str
    answer: str


# Fictional facts, so nothing can be answered without retrieving them.
PASSAGES = (
    ("Glass Lighthouse", "The Glass Lighthouse was built by Mira Tolvane in 1881."),
    ("Copper Bridge", "The Copper Bridge crosses the river Eskel near Varn."),
    ("Orla Fenwick", "Orla Fenwick was born in Dunmere and paints harbours."),
    ("Salt Library", "The Salt Library keeps maps of the northern coast."),
    ("Dunmere", "Dunmere is a fishing town on the Pale Sea."),
)
QUESTIONS = (
    Question("Who built the Glass Lighthouse", "Glass Lighthouse builder", "Mira Tolvane"),
    Question("Where was Orla Fenwick born", "Orla Fenwick born", "Dunmere"),
)


def write_corpus(path: str | Path) -> Path:
    """The passages as a Search-R1 corpus file (`{"id", "contents": "\\"Title\\"\\ntext"}` per line)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"id": str(i), "contents": f'"{title}"\n{text}'}) for i, (title, text) in enumerate(PASSAGES)]
    path.write_text("\n".join(lines) + "\n")
    return path


def build_bm25_retriever(corpus_path: str | Path, index_dir: str | Path) -> Any:
    from search_r1.search.index_builder import build_index
    from search_r1.search.retrievers import build_retriever

    index_path = build_index("bm25", str(corpus_path), str(index_dir))
    return build_retriever("bm25", str(index_path), str(corpus_path))


def write_question_parquets(folder: str | Path) -> ToyPaths:
    """Train and validation parquet rows (DESIGN §3.2 layout) for every question."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)

    def rows(split: str) -> list[dict[str, Any]]:
        return [{
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": make_prefix(q.question)}],
            "ability": "fact-reasoning",
            "reward_model": {"style": "rule", "ground_truth": {"target": [q.answer]}},
            "extra_info": {"split": split, "index": i},
        } for i, q in enumerate(QUESTIONS)]

    paths = ToyPaths(str(folder / "train.parquet"), str(folder / "val.parquet"))
    pd.DataFrame(rows("train")).to_parquet(paths.train)
    pd.DataFrame(rows("test")).to_parquet(paths.val)
    return paths


def demonstration(tokenizer: Any, retriever: Any, q: Question) -> tuple[list[int], list[int]]:
    """(ids, loss weights) of one search-then-answer trajectory; weight 1 on policy tokens.

    Each piece is tokenized on its own, as the rollout does: the prompt by the dataset,
    the observation by the generation manager, the turns by the sampler.
    """
    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    prompt = encode(prompt_to_text([{"role": "user", "content": make_prefix(q.question)}], tokenizer))
    search_turn = encode(f"<think> I need to search. </think><search> {q.query} </search>")
    observation = encode(render_observation(retriever.search(q.query, TOPK)))
    answer_turn = encode(f"<think> I found it. </think><answer> {q.answer} </answer>") + [tokenizer.eos_token_id]
    pieces = ((prompt, 0), (search_turn, 1), (observation, 0), (answer_turn, 1))
    ids = [tok for piece, _ in pieces for tok in piece]
    weights = [w for piece, w in pieces for _ in piece]
    return ids, weights


def warm_up_searching_model(base_dir: str, retriever: Any, out_dir: str | Path, steps: int = 60,
                            lr: float = 3e-3, seed: int = 0) -> Path:
    """Fit the tiny model at `base_dir` to every question's demonstration; save it to `out_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl.utils.tiny_model import save_model_and_tokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    demos = [demonstration(tokenizer, retriever, q) for q in QUESTIONS]
    width = max(len(ids) for ids, _ in demos)
    # Right-padded batch (batch, seq); padded positions carry weight 0 and attention 0.
    input_ids = torch.full((len(demos), width), tokenizer.pad_token_id, dtype=torch.long)
    weights = torch.zeros((len(demos), width))
    attention = torch.zeros((len(demos), width), dtype=torch.long)
    for row, (ids, w) in enumerate(demos):
        input_ids[row, :len(ids)] = torch.tensor(ids)
        weights[row, :len(w)] = torch.tensor(w, dtype=torch.float32)
        attention[row, :len(ids)] = 1

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        logits = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), input_ids[:, 1:], reduction="none")
        loss = (nll * weights[:, 1:]).sum() / weights[:, 1:].sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    return save_model_and_tokenizer(model, tokenizer, out_dir)
