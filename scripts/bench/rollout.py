"""Rollout benchmark: multi-turn search rollouts with stop strings on and off.

What it measures, printed as one JSON object: for the same scripted trajectories,
run once with the engine's stop strings (`</search>`, `</answer>`) and once
without, the tokens the engine generated vs the tokens the manager kept, the wall
time, and the share of it spent in retrieval (a real BM25 server over HTTP).

The "model" is a scripted rollout engine (`ScriptedRollout`): a freshly built
tiny Qwen2 cannot search, so each row replays a realistic token stream in which
the model keeps writing after `</search>` (a hallucinated `<information>` block,
more thinking) unless the engine stops it. Every emitted token costs a real
forward step of the tiny model (teacher-forced, with a KV cache), so generation
time scales with generated tokens as it does in a real engine. The original
Search-R1 had no engine stop: it generated the whole tail and threw it away.

    python -m scripts.bench.rollout --rows 32 --max-turns 2     # from the repository root
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import re
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from search_r1.llm_agent import actions
from search_r1.llm_agent.tensor_helper import left_pad, position_ids_from_mask, real_tokens, right_pad
from verl.protocol import DataProto
from verl.utils import batch_keys as K

ASSISTANT_MARK = "<|im_start|>assistant\n"


def default_turn_index(context_text: str) -> int:
    """Turns already taken = observations after the assistant's opening (the prompt's own
    mentions of `<information>` come before it); in the tool protocol each tool answer opens a
    new assistant turn, so it is the number of assistant openings after the first."""
    if context_text.count(ASSISTANT_MARK) > 1:
        return context_text.count(ASSISTANT_MARK) - 1
    tail = context_text.rsplit(ASSISTANT_MARK, 1)[-1]
    notices = (actions.INVALID_ACTION_NOTICE, actions.INVALID_ACTION_NOTICE_WITH_OPEN, actions.OPEN_BUDGET_NOTICE)
    return tail.count("<information>") + sum(tail.count(notice.strip()) for notice in notices)


@dataclass
class ScriptedRollout:
    """A rollout engine that replays fixed token streams, keeping the hf_rollout contract.

    `scripts[key][turn]` is the stream row `key` would write at `turn`; the key is
    read from the prompt with `key_pattern` (first group) and the turn from the
    context (`default_turn_index`). The stream is cut like a real engine cuts it:
    after EOS, after the token that completes a stop string, at `response_length`.
    If `model` is given, each emitted position costs one teacher-forced forward
    step of it. `calls` records each call's meta_info and contexts (for tests).
    """

    tokenizer: Any
    scripts: dict[str, list[list[int]]]
    key_pattern: str = r"Question: (\S+?)\?"
    model: Any = None

    def __post_init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def _key(self, text: str) -> str:
        match = re.search(self.key_pattern, text)
        if match is None:
            raise KeyError(f"no script key matching {self.key_pattern!r} in context {text[:200]!r}")
        return match.group(1)

    def _stop_at(self, stream: list[int], stop: list[str]) -> int:
        """Length of the smallest prefix whose text contains a stop string (len(stream) if none)."""
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)  # noqa: E731,E501
        if not stop or not any(s in decode(stream) for s in stop):
            return len(stream)
        lo, hi = 1, len(stream)
        while lo < hi:
            mid = (lo + hi) // 2
            if any(s in decode(stream[:mid]) for s in stop):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def emit(self, context: list[int], meta: dict[str, Any]) -> list[int]:
        """The tokens this engine samples for one row's context."""
        text = self.tokenizer.decode(context, skip_special_tokens=False)
        key, turn = self._key(text), default_turn_index(text)
        turns = self.scripts[key]
        if turn >= len(turns):
            raise IndexError(f"script {key!r} has {len(turns)} turns; the manager asked for turn {turn}")
        stream = turns[turn][: int(meta[K.META_RESPONSE_LENGTH])]
        eos = meta[K.META_EOS_TOKEN_ID]
        eos_ids = {int(e) for e in eos} if isinstance(eos, list | tuple) else {int(eos)}
        first_eos = next((i for i, tok in enumerate(stream) if tok in eos_ids), None)
        if first_eos is not None:
            stream = stream[: first_eos + 1]
        return stream[: self._stop_at(stream, list(meta.get(K.META_STOP) or []))]

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Reads input_ids/attention_mask (left-padded) and meta_info eos/pad ids, response_length,
        stop; writes prompts, responses (right-padded to response_length), input_ids, attention_mask, position_ids."""
        meta = prompts.meta_info
        input_ids, attention_mask = prompts.batch[K.INPUT_IDS], prompts.batch[K.ATTENTION_MASK]
        contexts = real_tokens(input_ids, attention_mask)
        emitted = [self.emit(ctx, meta) for ctx in contexts]
        self.calls.append({"meta_info": dict(meta), "contexts": contexts, "emitted": emitted})
        if self.model is not None:
            _charge_forward_steps(self.model, input_ids, attention_mask, emitted, int(meta[K.META_PAD_TOKEN_ID]))
        pad = int(meta[K.META_PAD_TOKEN_ID])
        # Every engine pads to response_length, so worker outputs concatenate.
        width = int(meta[K.META_RESPONSE_LENGTH])
        responses = right_pad(emitted, pad, width)
        response_mask = right_pad([[1] * len(e) for e in emitted], 0, width)
        mask = torch.cat([attention_mask, response_mask], dim=1)
        return DataProto.from_dict(
            tensors={K.PROMPTS: input_ids, K.RESPONSES: responses,
                     K.INPUT_IDS: torch.cat([input_ids, responses], dim=1),
                     K.ATTENTION_MASK: mask, K.POSITION_IDS: position_ids_from_mask(mask)},
            meta_info=dict(meta),
        )


@torch.no_grad()
def _charge_forward_steps(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                          emitted: list[list[int]], pad_id: int) -> None:
    """Prefill + one decode step per emitted position, feeding the scripted tokens."""
    steps = max(len(e) for e in emitted)
    out = model(input_ids=input_ids, attention_mask=attention_mask,
                position_ids=position_ids_from_mask(attention_mask), use_cache=True)
    cache, mask = out.past_key_values, attention_mask
    for t in range(steps - 1):
        token = torch.tensor([[e[t] if t < len(e) else pad_id] for e in emitted], dtype=torch.long)
        mask = torch.cat([mask, torch.ones((mask.shape[0], 1), dtype=mask.dtype)], dim=1)
        position = (mask.sum(dim=1, keepdim=True) - 1).clamp(min=0)
        out = model(input_ids=token, attention_mask=mask, position_ids=position,
                    past_key_values=cache, use_cache=True)
        cache = out.past_key_values


# --- the benchmark's world ---------------------------------------------------------

_FIRST = ["Ala", "Bren", "Cora", "Dav", "Eli", "Fen", "Gra", "Hal", "Iva", "Jor", "Kel", "Lum"]
_LAST = ["mora", "tine", "vash", "lin", "dero", "quist", "bane", "holt"]
_CITY = ["Orvale", "Kestrel", "Marrow", "Tessin", "Lowmere", "Brackton", "Duneholm", "Fairpoint"]


def build_world(rows: int, seed: int = 0) -> tuple[list[dict[str, str]], list[tuple[str, str, str]]]:
    """A corpus of fictional people and (key, person, city) questions about `rows` of them."""
    rng = random.Random(seed)
    people = [f"{f}{last}" for f in _FIRST for last in _LAST]
    corpus, facts = [], []
    for i, person in enumerate(people):
        city = rng.choice(_CITY)
        corpus.append({"id": str(i), "contents": f'"{person}"\n{person} was born in {city} and works as a clerk.'})
        facts.append((person, city))
    questions = [(f"q{i}", *facts[i % len(facts)]) for i in range(rows)]
    return corpus, questions


def scripted_streams(tokenizer: Any, person: str, city: str, n_search_turns: int,
                     rambling_chars: int = 400) -> list[list[int]]:
    """Turn streams for one row: searches that ramble on past `</search>`, then an answer + EOS."""
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    ramble = (f"\n\n<information>Doc 1(Title: {person}) {person} is a person I am imagining here, "
              f"and this text was never retrieved. </information>\n\n<think> I keep writing. </think>" * 8)
    streams = []
    for t in range(n_search_turns):
        text = f"<think> I need where {person} was born (try {t + 1}). </think>\n<search> {person} born </search>"
        streams.append(enc(text + ramble[:rambling_chars]))
    answer = f"<think> The documents say {person} was born in {city}. </think>\n<answer> {city} </answer>"
    streams.append(enc(answer) + [tokenizer.eos_token_id])
    return streams


def run_benchmark(rows: int, max_turns: int, topk: int, model_hidden: int) -> dict[str, Any]:
    """Run the same scripted rollouts with stop strings on and off; return the measurements."""
    from search_r1.llm_agent.generation import GenerationConfig, LLMGenerationManager
    from verl.utils.tiny_model import DEFAULT_TEXTS, build_tiny_qwen2, train_bpe_tokenizer

    corpus, questions = build_world(rows)
    # The Search-R1 instructions as the tiny tokenizer's training text has them.
    instructions = DEFAULT_TEXTS[0].split("Question:")[0]
    tokenizer = train_bpe_tokenizer(list(DEFAULT_TEXTS) + [c["contents"] for c in corpus[:40]], vocab_size=800)
    model = build_tiny_qwen2(tokenizer, hidden_size=model_hidden, num_layers=2).eval()
    scripts = {key: scripted_streams(tokenizer, person, city, max_turns) for key, person, city in questions}
    prompts = [tokenizer.apply_chat_template(
        [{"role": "user", "content": instructions + f"Question: {key}?"}],
        add_generation_prompt=True, tokenize=False) for key, _, _ in questions]
    prompt_ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    input_ids, attention_mask = left_pad(prompt_ids, tokenizer.pad_token_id)
    gen_batch = DataProto.from_dict(
        tensors={K.INPUT_IDS: input_ids, K.ATTENTION_MASK: attention_mask,
                 K.POSITION_IDS: position_ids_from_mask(attention_mask)},
        meta_info={K.META_DO_SAMPLE: False})

    with tempfile.TemporaryDirectory() as tmp, serve_bm25(corpus, Path(tmp), topk) as url:
        result: dict[str, Any] = {"rows": rows, "max_turns": max_turns, "topk": topk,
                                  "device": "cpu", "torch_threads": torch.get_num_threads()}
        # The first pass warms up the model, the BM25 index and the HTTP pool; it is not reported.
        for label, stop in (("warmup", actions.STOP_STRINGS), ("stop_on", actions.STOP_STRINGS), ("stop_off", ())):
            config = GenerationConfig(max_turns=max_turns, max_start_length=input_ids.shape[1] + 8,
                                      max_prompt_length=4096, max_response_length=256, max_obs_length=256,
                                      search_url=url, topk=topk, stop=stop)
            engine = ScriptedRollout(tokenizer, scripts, model=model)
            manager = LLMGenerationManager(tokenizer, engine, config, is_validation=True)
            start = time.perf_counter()
            out = manager.run_llm_loop(gen_batch, input_ids)
            wall = time.perf_counter() - start
            info = out.meta_info
            generated, kept = info["generated_tokens"], info["kept_tokens"]
            result[label] = {
                "generated_tokens": generated, "kept_tokens": kept,
                "thrown_away_fraction": round(1 - kept / generated, 4),
                "wall_s": round(wall, 3),
                "generate_s": round(info["timing_s"]["generate"], 3),
                "generated_tokens_per_s": round(generated / max(info["timing_s"]["generate"], 1e-9), 1),
                "retrieval_s": round(info["timing_s"]["retrieval"], 3),
                "retrieval_share": round(info["timing_s"]["retrieval"] / wall, 4),
                "stop_reasons": info["stop_reasons"],
                "searches": sum(info["valid_search_stats"]),
                "search_failures": info["search_failures"],
                "response_width": int(out.batch[K.RESPONSES].shape[1]),
            }
        del result["warmup"]
        on, off = result["stop_on"], result["stop_off"]
        result["generated_tokens_saved_by_stop"] = off["generated_tokens"] - on["generated_tokens"]
        result["same_kept_tokens"] = on["kept_tokens"] == off["kept_tokens"]
    return result


@contextlib.contextmanager
def serve_bm25(corpus: list[dict[str, str]], folder: Path, topk: int = 3, cache_size: int = 0) -> Iterator[str]:
    """A real BM25 retrieval server (the project's own app) on a free local port; yields its /retrieve url.

    The server's hit cache is off by default, so a repeated run pays for its searches again.
    """
    from search_r1.search.corpus import Corpus
    from search_r1.search.index_builder import build_bm25_index
    from search_r1.search.retrieval_server import ServerConfig, create_app
    from search_r1.search.retrievers import BM25Retriever
    from search_r1.search.serving import serve_in_background

    corpus_path = folder / "corpus.jsonl"
    corpus_path.write_text("".join(json.dumps(c) + "\n" for c in corpus))
    opened = Corpus.open(corpus_path, cache_dir=folder)
    retriever = BM25Retriever(str(build_bm25_index(opened, folder)), opened)
    app = create_app(retriever, ServerConfig(default_topk=topk, cache_size=cache_size))
    with serve_in_background(app) as base_url:
        yield f"{base_url}/retrieve"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--max-turns", type=int, default=2)
    parser.add_argument("--topk", type=int, default=3)
    parser.add_argument("--model-hidden", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(json.dumps(run_benchmark(args.rows, args.max_turns, args.topk, args.model_hidden), indent=2))


if __name__ == "__main__":
    main()
