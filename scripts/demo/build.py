"""Build (or reuse) every artefact of the offline demo under one data folder.

Each step writes its output atomically-enough (a marker or the final file last) and is
skipped when the output exists, so a second `run_demo` starts at RL within seconds.

    data/demo/corpus.jsonl                the evaluation world's passages
    data/demo/bm25/                       its BM25 index (the project's index builder)
    data/demo/flashrag/demo_{onehop,twohop}/{train,test}.jsonl   questions, FlashRAG layout
    data/demo/{train,test}.parquet        RL data, by the same code as scripts/data_process
    data/demo/sft/train.parquet           demonstrations from OTHER worlds (train.fingerprint: their sha256)
    data/demo/model_init/                 tokenizer (trained on yet another world) + random Qwen2
    data/demo/sft_phase{i}/huggingface/   a warm start built here (last phase: where RL starts), only
                                          when the settings differ from the shipped one's or
                                          demo.rebuild_warmstart=true
    example/demo_warmstart/               the shipped warm start (scripts/demo/warmstart.py), the default

`scripts.demo.run_demo.build_all` builds them all. The demo's modules import downwards only:
world <- demonstrations <- build <- warmstart <- run_demo (tests/test_import_cycles.py).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import pandas as pd

from scripts.data_process.common import build_merged, write_flashrag_jsonl, write_parquet
from scripts.demo import tool_demonstrations
from scripts.demo.browse_demonstrations import make_browse_demonstrations
from scripts.demo.demonstrations import make_demonstrations
from scripts.demo.world import (
    ONE_HOP_KINDS,
    TWO_HOP_KINDS,
    WORLDS,
    Question,
    all_questions,
    make_world,
    split_by_subject,
)
from search_r1.prompt import PROMPT_TEMPLATE, make_prefix

REPO_ROOT = Path(__file__).resolve().parents[2]
ONEHOP_SOURCE = "demo_onehop"
TWOHOP_SOURCE = "demo_twohop"


@dataclass
class DemoSettings:
    """Knobs of the demo's data and warm start (RL knobs are ordinary trainer keys)."""

    data_dir: str = "data/demo"
    output_dir: str = "outputs/demo"
    world_seed: int = 0               # the evaluation world
    tokenizer_world_seed: int = 999   # a different world, so names split into pieces
    sft_world_seeds: tuple[int, ...] = tuple(range(101, 111))
    n_demos: int = 14000
    vocab_size: int = 1000
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 512
    topk: int = 2
    n_val_per_kind: int = 30
    n_train: int = 3000
    # Cosine cycles with warm restarts, each phase starting from the previous one's
    # checkpoint. Measured (docs/demo.md): copying the question's name into the query
    # appears in the second cycle, copying the answer out of the passage later.
    sft_steps: tuple[int, ...] = (360, 400, 300, 400)
    sft_lr: float = 3e-3
    sft_batch_size: int = 32
    sft_context_weight: float = 0.5   # weight of prompt/retrieved tokens (copy practice)
    num_threads: int = 1   # SFT torch threads: one thread is one fixed reduction order, whatever the load
    sft_device: str = "cpu"   # where the warm start's SFT runs (cuda: minutes instead of an hour)
    # The warm start RL starts from: the shipped folder (relative paths are from the
    # repository root) when its manifest's settings match these, else built under data_dir.
    warmstart_dir: str = "example/demo_warmstart"
    rebuild_warmstart: bool = False   # build under data_dir even when the shipped one matches
    # demo.protocol=tool: veRL upstream's recipe (native tool calls, docs/demo.md "Tool
    # protocol"). Its warm start continues the tag warm start's SFT (the one the fields above
    # determine) on tool-call demonstrations, with the same tokenizer and a tool chat template.
    protocol: str = "tags"            # tags | tool
    tool_n_demos: int = 1600
    tool_sft_steps: tuple[int, ...] = (200,)
    tool_sft_lr: float = 2e-3
    tool_sft_batch_size: int = 16
    tool_warmstart_dir: str = "example/demo_warmstart_tool"
    # demo.agent=openai: the tool protocol's world and warm start, rolled out by an agent written with plain
    # `openai` calls (example/openai_agents/search_agent.py) through the trainer's OpenAI-compatible endpoint
    # (docs/demo.md "Your own agent"); outputs under outputs/demo_openai.
    agent: str = ""                   # "" | openai
    # demo.world=browse (docs/demo.md "Browse world"): search shows snippets without the answer,
    # which sits in the page `<open> doc_id </open>` returns (one-hop questions only). Its warm
    # start continues the tag warm start's SFT on browse demonstrations, a share of which open.
    world: str = "facts"              # facts | browse
    browse_n_demos: int = 1600
    browse_open_share: float = 0.2    # demonstrations that open the page; the others guess from the snippet
    browse_snippet_chars: int = 60    # the retrieval server's --snippet_chars in the browse world
    browse_sft_steps: tuple[int, ...] = (200,)
    browse_sft_lr: float = 2e-3
    browse_sft_batch_size: int = 16
    browse_warmstart_dir: str = "example/demo_warmstart_browse"

    @property
    def root(self) -> Path:
        return Path(self.data_dir)

    @property
    def warmstart_path(self) -> Path:
        return REPO_ROOT / self.warmstart_dir

    @property
    def tool_warmstart_path(self) -> Path:
        return REPO_ROOT / self.tool_warmstart_dir

    @property
    def browse_warmstart_path(self) -> Path:
        return REPO_ROOT / self.browse_warmstart_dir

    @property
    def variant(self) -> str:
        """Which demo: "tags", "tool" (demo.protocol) or "browse" (demo.world=browse)."""
        return "browse" if self.world == "browse" else self.protocol


PROTOCOLS = ("tags", "tool")
AGENTS = ("", "openai")
AGENT_OUTPUT_DIR = "outputs/demo_openai"   # demo.agent=openai (the tool demo's data and warm start)
# Where each protocol's demo keeps its data and outputs unless demo.data_dir / demo.output_dir
# are given: the two demos never read each other's cached parquet or checkpoints.
PROTOCOL_DIRS = {"tags": ("data/demo", "outputs/demo"), "tool": ("data/demo_tool", "outputs/demo_tool"),
                 "browse": ("data/demo_browse", "outputs/demo_browse")}


def split_args(argv: list[str]) -> tuple[DemoSettings, list[str]]:
    """`demo.<field>=v` arguments set DemoSettings; everything else is a trainer override."""
    settings = DemoSettings()
    known = {f.name: f for f in fields(DemoSettings)}
    overrides = []
    given: set[str] = set()
    for arg in argv:
        key, sep, value = arg.partition("=")
        if key.startswith("demo."):
            name = key[len("demo."):]
            if name not in known or not sep:
                raise SystemExit(f"unknown demo setting {arg!r}; known: demo.{{{', '.join(sorted(known))}}}")
            current = getattr(settings, name)
            try:
                if isinstance(current, tuple):  # comma-separated ints: demo.sft_steps=300,200
                    parsed: object = tuple(int(v) for v in value.strip("[]()").split(",") if v.strip())
                elif isinstance(current, bool):  # bool("false") would be True
                    if value.lower() not in ("true", "false", "1", "0"):
                        raise SystemExit(f"demo.{name} takes true or false, got {value!r}")
                    parsed = value.lower() in ("true", "1")
                else:
                    parsed = type(current)(value)
            except ValueError:
                kind = "comma-separated integers" if isinstance(current, tuple) else \
                    {int: "an integer", float: "a number"}.get(type(current), type(current).__name__)
                raise SystemExit(f"demo.{name} takes {kind} (default {current!r}), got {value!r}") from None
            setattr(settings, name, parsed)
            given.add(name)
        else:
            overrides.append(arg)
    if settings.protocol not in PROTOCOLS:
        raise SystemExit(f"demo.protocol takes {' or '.join(PROTOCOLS)}, got {settings.protocol!r}")
    if settings.world not in WORLDS:
        raise SystemExit(f"demo.world takes {' or '.join(WORLDS)}, got {settings.world!r}")
    if settings.world == "browse" and settings.protocol != "tags":
        raise SystemExit("demo.world=browse runs in the tag protocol (its open tag); drop demo.protocol="
                         f"{settings.protocol}")
    if settings.agent not in AGENTS:
        raise SystemExit(f"demo.agent takes {' or '.join(a for a in AGENTS if a)}, got {settings.agent!r}")
    if settings.agent:
        if "protocol" in given and settings.protocol != "tool":
            raise SystemExit(f"demo.agent={settings.agent} runs on the tool protocol's world; drop demo.protocol="
                             f"{settings.protocol}")
        settings.protocol = "tool"
    data_dir, output_dir = PROTOCOL_DIRS[settings.variant]
    if settings.agent:
        output_dir = AGENT_OUTPUT_DIR
    if "data_dir" not in given:
        settings.data_dir = data_dir
    if "output_dir" not in given:
        settings.output_dir = output_dir
    return settings, overrides


def fingerprint(data: object) -> str:
    """sha256 of `data` as canonical JSON: how a build's inputs (texts, demonstrations) are compared.

    The demonstrations are not a function of the settings alone: a searched demonstration's
    second passage is often a BM25 score-0 tie, and bm25s breaks ties with numpy's top-k,
    whose order depends on the CPU's SIMD kernels (AVX2 vs AVX-512)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def _question_row(q: Question, i: int) -> dict:
    return {"id": f"{q.kind}-{i}", "question": q.text, "golden_answers": [q.answer]}


def build_questions(s: DemoSettings) -> tuple[Path, Path]:
    """FlashRAG JSONL for the evaluation world, then train/test parquet from it."""
    train_pq, test_pq = s.root / "train.parquet", s.root / "test.parquet"
    if train_pq.exists() and test_pq.exists():
        return train_pq, test_pq
    world = make_world(s.world_seed)
    rng = random.Random(s.world_seed)
    flashrag = s.root / "flashrag"
    # The browse world asks one-hop questions only (search, open, answer).
    sources = [ONEHOP_SOURCE] if s.world == "browse" else [ONEHOP_SOURCE, TWOHOP_SOURCE]
    for source, kinds in ((ONEHOP_SOURCE, ONE_HOP_KINDS), (TWOHOP_SOURCE, TWO_HOP_KINDS))[: len(sources)]:
        train_q, test_q = [], []
        for kind in kinds:
            tr, te = split_by_subject(all_questions(world, [kind]), held_out_fraction=0.3, seed=s.world_seed)
            train_q += tr
            test_q += rng.sample(te, min(s.n_val_per_kind, len(te)))
        rng.shuffle(train_q)
        write_flashrag_jsonl([_question_row(q, i) for i, q in enumerate(train_q)], flashrag / source / "train.jsonl")
        write_flashrag_jsonl([_question_row(q, i) for i, q in enumerate(test_q)], flashrag / source / "test.jsonl")
    # demo.protocol=tool: the rows of veRL's preprocess_search_r1_dataset.py (scripts/data_process
    # --format tool): system + user prompt, data_source searchR1_demo_onehop / searchR1_demo_twohop.
    # demo.world=browse: the tag template with the open tag's sentence (--template_type open).
    template = "open" if s.world == "browse" else "base"
    train_rows = build_merged(sources, ("train",), "train", flashrag, fmt=s.protocol, template_type=template)
    random.Random(s.world_seed + 1).shuffle(train_rows)
    write_parquet(train_rows[: s.n_train], train_pq)
    write_parquet(build_merged(sources, ("test",), "test", flashrag, fmt=s.protocol, template_type=template), test_pq)
    return train_pq, test_pq


def claim_data_dir(s: DemoSettings) -> None:
    """Mark `demo.data_dir` as holding this demo's data (`s.variant`: tags, tool or browse); refuse
    a folder of another one (its cached parquet and warm start are in another text or world)."""
    marker = s.root / "PROTOCOL"
    if marker.exists():
        found: str | None = marker.read_text().strip()
    elif (s.root / "train.parquet").exists():
        found = "tags"   # built before the marker existed
    else:
        found = None
    if found is not None and found != s.variant:
        given = "demo.world=browse" if s.variant == "browse" else f"demo.protocol={s.protocol}"
        raise SystemExit(f"demo.data_dir={s.data_dir} holds the {found!r} protocol's demo data; give "
                         f"{given} its own folder (default {PROTOCOL_DIRS[s.variant][0]})")
    s.root.mkdir(parents=True, exist_ok=True)
    marker.write_text(s.variant + "\n")


def build_corpus_and_index(s: DemoSettings) -> tuple[Path, Path]:
    corpus = s.root / "corpus.jsonl"
    index_dir = s.root / "bm25"
    if not corpus.exists():
        write_flashrag_jsonl(make_world(s.world_seed).pages(s.world), corpus)
    if not index_dir.exists():
        from search_r1.search.index_builder import build_index

        index_dir = build_index("bm25", str(corpus), str(s.root))
    return corpus, index_dir


def tokenizer_texts(s: DemoSettings) -> list[str]:
    """Text of a world the demo never evaluates on, in every shape the model will see."""
    world = make_world(s.tokenizer_world_seed)
    demos = make_demonstrations([world], 400, s.topk, seed=s.tokenizer_world_seed)
    texts = [PROMPT_TEMPLATE] + [p["contents"] for p in world.passages()]
    # As the chat template renders them, so "user"/"assistant" become single tokens too.
    texts += [f"<|im_start|>user\n{make_prefix(q.text)}<|im_end|>\n<|im_start|>assistant\n"
              + "".join(t.text for t in turns) for q, turns in demos]
    return texts


def build_model_init(s: DemoSettings) -> Path:
    from verl.utils.tiny_model import build_tiny_qwen2, save_model_and_tokenizer, train_bpe_tokenizer

    out = s.root / "model_init"
    if (out / "config.json").exists():
        return out
    tok = train_bpe_tokenizer(tokenizer_texts(s), vocab_size=s.vocab_size)
    model = build_tiny_qwen2(tok, hidden_size=s.hidden_size, num_layers=s.num_layers, num_heads=s.num_heads,
                             num_kv_heads=s.num_heads, intermediate_size=s.intermediate_size,
                             max_position_embeddings=2048, seed=s.world_seed)
    return save_model_and_tokenizer(model, tok, out)


def sft_data_fingerprint_path(s: DemoSettings) -> Path:
    """Where build_sft_data records the fingerprint of the rows it wrote."""
    return s.root / "sft" / "train.fingerprint"


def build_sft_data(s: DemoSettings) -> Path:
    out = s.root / "sft" / "train.parquet"
    if out.exists():
        return out
    worlds = [make_world(seed) for seed in s.sft_world_seeds]
    demos = make_demonstrations(worlds, s.n_demos, s.topk, seed=s.world_seed)
    rows = [{"prompt": [{"role": "user", "content": make_prefix(q.text)}],
             "turns": [asdict(t) for t in turns], "kind": q.kind} for q, turns in demos]
    out.parent.mkdir(parents=True, exist_ok=True)
    sft_data_fingerprint_path(s).write_text(fingerprint(rows) + "\n")
    pd.DataFrame(rows).to_parquet(out, index=False)
    return out


def tool_sft_data_path(s: DemoSettings) -> Path:
    return s.root / "sft_tool" / "train.parquet"


def build_tool_sft_data(s: DemoSettings, tokenizer) -> Path:
    """Tool-protocol demonstrations from the SFT worlds, with the prompt already rendered by the
    tool chat template (tools=the search schema), as the rollout renders it; the fingerprint of
    the rows goes beside them (…/train.fingerprint)."""
    out = tool_sft_data_path(s)
    if out.exists():
        return out
    framing = tool_demonstrations.framing_for(tokenizer)
    worlds = [make_world(seed) for seed in s.sft_world_seeds]
    demos = tool_demonstrations.make_tool_demonstrations(worlds, s.tool_n_demos, s.topk, seed=s.world_seed + 7,
                                                         framing=framing)
    rows = [{"prompt": tool_demonstrations.render_prompt(tokenizer, q.text),
             "turns": [asdict(t) for t in turns], "kind": q.kind} for q, turns in demos]
    out.parent.mkdir(parents=True, exist_ok=True)
    (out.parent / "train.fingerprint").write_text(fingerprint(rows) + "\n")
    pd.DataFrame(rows).to_parquet(out, index=False)
    return out


def sft_overrides(s: DemoSettings, sft_data: Path, model_init: Path, steps: int, phase: int,
                  tool: bool = False, browse: bool = False) -> list[str]:
    w = s.sft_context_weight
    lr, batch = (s.tool_sft_lr, s.tool_sft_batch_size) if tool else (s.sft_lr, s.sft_batch_size)
    if browse:
        lr, batch = s.browse_sft_lr, s.browse_sft_batch_size
    out_dir = s.root / (f"tool_sft_phase{phase}" if tool else f"browse_sft_phase{phase}" if browse else f"sft_phase{phase}")
    return [
        f"data.train_files={sft_data}", "data.max_length=1024", "data.truncation=skip",
        f"data.train_batch_size={batch}", f"data.micro_batch_size_per_gpu={batch}",
        f"data.loss_weights.prompt={w}", "data.loss_weights.policy=1.0", f"data.loss_weights.observation={w}",
        f"model.partial_pretrain={model_init}", f"optim.lr={lr}",
        f"optim.warmup_steps_ratio={0.05 if phase == 0 else 0.02}", "optim.weight_decay=0.0",
        f"trainer.total_training_steps={steps}", f"trainer.seed={1 + phase + (100 if tool else 200 if browse else 0)}",
        f"trainer.default_local_dir={out_dir}", "trainer.logger=[jsonl]",
        "trainer.progress_bar=true", "trainer.log_freq=25", f"trainer.device={s.sft_device}", f"trainer.num_threads={s.num_threads}",
    ]


def build_warm_start(s: DemoSettings) -> Path:
    """Run the project's SFT trainer on the demonstrations, one phase per entry of
    `sft_steps`, each starting from the previous one's HF checkpoint (skipped when done)."""
    if not s.sft_steps:
        raise ValueError("demo.sft_steps is empty: at least one SFT phase is needed")
    return _sft_phases(s, build_sft_data(s), build_model_init(s), s.sft_steps, "tag")


def _sft_phases(s: DemoSettings, sft_data: Path, model: Path, phase_steps: tuple[int, ...], kind: str) -> Path:
    """The project's SFT trainer on `sft_data`, one phase per entry of `phase_steps`, each from the
    previous one's HF checkpoint (the first from `model`; a phase already done is skipped); kind: tag,
    tool or browse (its folders, learning rate and seeds: sft_overrides). The last phase's HF folder."""
    from verl.trainer.fsdp_sft_trainer import compose_sft_config, run_sft

    prefix = {"tag": "sft_phase", "tool": "tool_sft_phase", "browse": "browse_sft_phase"}[kind]
    for phase, steps in enumerate(phase_steps):
        hf_dir = s.root / f"{prefix}{phase}" / "huggingface"
        if not (hf_dir / "config.json").exists():
            overrides = sft_overrides(s, sft_data, model, steps, phase, tool=kind == "tool", browse=kind == "browse")
            result = run_sft(compose_sft_config(overrides))
            (hf_dir.parent / "sft_result.json").write_text(json.dumps(
                {"steps": result.steps, "final_loss": result.final_loss, "wall_seconds": result.wall_seconds}))
        model = hf_dir
    return model


def build_tool_warm_start(s: DemoSettings, base: Path) -> Path:
    """The tool protocol's warm start: the tag warm start `base` (its weights and tokenizer) with
    the tool chat template, then the project's SFT trainer on tool-call demonstrations, one phase
    per entry of `tool_sft_steps` (each from the previous one; skipped when done)."""
    import shutil

    from transformers import AutoTokenizer

    if not s.tool_sft_steps:
        raise ValueError("demo.tool_sft_steps is empty: at least one SFT phase is needed")
    init = s.root / "tool_model_init"
    if not (init / "config.json").exists():
        tmp = init.with_name(init.name + ".tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        shutil.copytree(base, tmp, ignore=shutil.ignore_patterns("manifest.json"))
        tok = tool_demonstrations.with_tool_template(AutoTokenizer.from_pretrained(tmp))
        (tmp / "chat_template.jinja").unlink(missing_ok=True)
        tok.save_pretrained(tmp)
        tmp.rename(init)
    sft_data = build_tool_sft_data(s, AutoTokenizer.from_pretrained(init))
    return _sft_phases(s, sft_data, init, s.tool_sft_steps, "tool")



def browse_sft_data_path(s: DemoSettings) -> Path:
    return s.root / "sft_browse" / "train.parquet"


def build_browse_sft_data(s: DemoSettings) -> Path:
    """Browse demonstrations from the SFT worlds (scripts/demo/browse_demonstrations.py) in the
    `open` prompt template; the fingerprint of the rows goes beside them (…/train.fingerprint)."""
    out = browse_sft_data_path(s)
    if out.exists():
        return out
    worlds = [make_world(seed) for seed in s.sft_world_seeds]
    demos = make_browse_demonstrations(worlds, s.browse_n_demos, s.topk, seed=s.world_seed + 11,
                                       open_share=s.browse_open_share, snippet_chars=s.browse_snippet_chars)
    rows = [{"prompt": [{"role": "user", "content": make_prefix(q.text, "open")}],
             "turns": [asdict(t) for t in turns], "kind": q.kind} for q, turns in demos]
    out.parent.mkdir(parents=True, exist_ok=True)
    (out.parent / "train.fingerprint").write_text(fingerprint(rows) + "\n")
    pd.DataFrame(rows).to_parquet(out, index=False)
    return out


def build_browse_warm_start(s: DemoSettings, base: Path) -> Path:
    """The browse world's warm start: the tag warm start `base` (weights, tokenizer, chat template)
    continued by the project's SFT trainer on browse demonstrations, one phase per entry of
    `browse_sft_steps` (each from the previous one; skipped when done)."""
    if not s.browse_sft_steps:
        raise ValueError("demo.browse_sft_steps is empty: at least one SFT phase is needed")
    return _sft_phases(s, build_browse_sft_data(s), base, s.browse_sft_steps, "browse")
