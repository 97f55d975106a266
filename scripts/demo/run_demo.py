"""The offline CPU demo: a small model learns, with GRPO and a real search engine, to search.

    python -m scripts.demo.run_demo                                  # everything, defaults
    python -m scripts.demo.run_demo trainer.total_training_steps=20 demo.data_dir=/tmp/demo
    bash train_grpo.sh                                               # same, on a machine with no GPU
    python -m scripts.demo.run_demo demo.algorithm=ppo               # PPO (GAE + critic) instead of GRPO
    python -m scripts.demo.run_demo demo.recipe=dapo                 # dapo|gspo|drgrpo|reinforce_plus_plus_baseline|rloo
    python -m scripts.demo.run_demo demo.world=browse                # snippets only: learn to <open> a page
    bash train_ppo.sh                                                # same, on a machine with no GPU

Steps (each cached under demo.data_dir, so a second run goes straight to RL). It prints
one line saying what it will do and about how long, then progress bars with an ETA.
1. a fictional world (fixed seed): corpus, BM25 index, one-hop and two-hop questions in
   the FlashRAG layout, turned into parquet by scripts/data_process (demo_onehop /
   demo_twohop);
2. the warm start: a byte-level BPE tokenizer and a ~1.2M-parameter Qwen2, trained with
   the project's SFT trainer on demonstrations from OTHER worlds, many of which answer
   without searching (the habit RL must unlearn). Shipped in example/demo_warmstart/
   (scripts/demo/warmstart.py rebuilds it); built here only when demo.* settings that
   determine it differ from the shipped one's, or with demo.rebuild_warmstart=true;
3. the retrieval server (`search_r1.search.retrieval_server`, BM25) on a free
   127.0.0.1 port, unless one already answers at `retriever.url`;
4. `verl.trainer.main_ppo.run_ppo`: greedy validation, GRPO with search, validation; every step's
   trajectories and every validation's go to outputs/demo/dumps/{rollout,validation}/<step>.jsonl;
5. a summary (outputs/demo/summary.json), a PNG of the training curves and the command that
   draws the dumps as one HTML page (`python -m scripts.viewer outputs/demo/dumps`).

Arguments are Hydra overrides of ppo_trainer.yaml, plus `demo.<field>=value` for the
fields of `scripts.demo.build.DemoSettings`. Differs from the paper's setup only in
scale: a tiny model trained from scratch, a synthetic corpus, CPU workers.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm import tqdm

from scripts.demo.browse_demonstrations import BROWSE_RL_OVERRIDES
from scripts.demo.build import (
    ONEHOP_SOURCE,
    REPO_ROOT,
    TWOHOP_SOURCE,
    DemoSettings,
    build_corpus_and_index,
    build_questions,
    claim_data_dir,
    split_args,
)
from scripts.demo.recipes import RECIPES, with_recipe
from scripts.demo.server import retrieval_server
from scripts.demo.tool_demonstrations import MAX_TOOL_RESPONSE_LENGTH, write_tool_config
from scripts.demo.warmstart import MANIFEST, read_manifest, resolve_warmstart, settings_for, shipped_path
from scripts.demo.world import ONE_HOP_KINDS, TWO_HOP_KINDS

# RL settings found to work for the demo (see docs/demo.md); any can be overridden.
DEFAULT_RL_OVERRIDES = (
    "algorithm.adv_estimator=grpo",
    "data.train_batch_size=32",
    "data.val_batch_size=256",
    "data.max_prompt_length=768",
    "data.max_start_length=256",
    "data.max_response_length=40",
    "data.max_obs_length=128",
    "actor_rollout_ref.rollout.name=hf",
    "actor_rollout_ref.rollout.n_agent=5",          # Search-R1's GRPO group size
    "actor_rollout_ref.rollout.temperature=0.8",
    "actor_rollout_ref.rollout.micro_batch_size=256",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size=128",
    "actor_rollout_ref.ref.log_prob_micro_batch_size=128",
    "actor_rollout_ref.actor.optim.lr=1e-4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=160",   # 32 prompts x 5 rollouts: one optimizer step per RL step
    "actor_rollout_ref.actor.ppo_micro_batch_size=40",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.actor.kl_loss_coef=0.01",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.actor.state_masking=true",
    "trainer.device=cpu",
    "trainer.n_gpus_per_node=2",
    "trainer.total_training_steps=12",
    "trainer.save_freq=-1",
    "trainer.logger=[jsonl]",
    "trainer.project_name=search-r1-demo",
    "trainer.experiment_name=demo-grpo",
    "trainer.resume_mode=disable",
    "trainer.progress_bar=true",
    "max_turns=2",
    "retriever.topk=2",
    "reward_model.num_examine=0",
    "+trainer.val_before_train=true",
)

# `demo.algorithm=ppo` (what `bash train_ppo.sh` passes): PPO with GAE and a critic (the warm
# start plus a value head) on the same demo; these replace the GRPO keys above. One rollout a
# prompt, so 160 prompts a step give GRPO's 160 rollouts (32 x 5). With GRPO's lr and one actor
# step a batch, validation EM had not moved after 8 steps (the critic's baseline is noisier than a
# group's mean); twice the lr and two mini-batches learn by step 4. docs/demo.md "GRPO and PPO".
PPO_RL_OVERRIDES = (
    "algorithm.adv_estimator=gae",
    "algorithm.gamma=1.0",
    "algorithm.lam=1.0",
    "algorithm.kl_ctrl.kl_coef=0.01",                 # KL to the reference in the reward, as PPO does
    "data.train_batch_size=160",
    "actor_rollout_ref.rollout.n_agent=1",
    "actor_rollout_ref.actor.use_kl_loss=false",
    "actor_rollout_ref.actor.optim.lr=2e-4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=80",   # two actor (and critic) optimizer steps a batch
    "critic.optim.lr=1e-3",
    "critic.ppo_micro_batch_size=80",                 # one micro-batch per worker: the critic's update is fewer, larger matmuls
    "trainer.critic_warmup=0",
    "trainer.experiment_name=demo-ppo",
)
ALGORITHMS = ("grpo", "ppo")

# `demo.protocol=tool`: veRL upstream's recipe (native tool calls through the chat template),
# added to the keys above; its warm start and parquet are the tool protocol's own
# (docs/demo.md "Tool protocol"). The tool config file (the demo's server URL) is written by
# run_demo and passed as multi_turn.tool_config_path.
TOOL_RL_OVERRIDES = (
    "actor_rollout_ref.rollout.multi_turn.enable=true",
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",   # two searches and the answer (max_turns=2)
    f"actor_rollout_ref.rollout.multi_turn.max_tool_response_length={MAX_TOOL_RESPONSE_LENGTH}",
    "data.max_prompt_length=640",       # the initial prompt: tool schema, veRL's user prefix, the question
    "data.max_response_length=512",     # all turns and tool messages of a row together (veRL's meaning)
    "data.max_obs_length=192",          # one tool message with its framing (two passages: ~125 tokens)
    "actor_rollout_ref.actor.optim.lr=2e-4",
)
TOOL_CONFIG_FILE = "search_tool_config.yaml"   # under demo.output_dir
# `demo.agent=openai`: the tool demo's keys, rolled out by example/openai_agents/search_agent.py through the
# trainer's OpenAI-compatible endpoint (openai_agent.*); the agent gets the row's chat messages
# (data.return_raw_chat) and finds the demo's retrieval server in SEARCH_R1_RETRIEVAL_URL.
OPENAI_AGENT_FILE = REPO_ROOT / "example" / "openai_agents" / "search_agent.py"
AGENT_RL_OVERRIDES = (
    f"openai_agent.path={OPENAI_AGENT_FILE}",
    "data.return_raw_chat=true",
)



# Measured on an idle 2-core CPU (docs/demo.md), for the start line's estimate only.
SECONDS_PER_RL_STEP = 30.0
# PPO's step adds the critic's forward and update: 1.4x GRPO's step time, measured side by side.
PPO_STEP_TIME_FACTOR = 1.4
SECONDS_PER_VALIDATION = 8.0
SECONDS_START = 45.0          # world, index, retrieval server, Ray and workers, final save and plot
SECONDS_PER_SFT_STEP = 1.0    # only when the warm start is (re)built here
# demo.protocol=tool (prompts of ~513 tokens, calls of ~73): 70-130 s/step and 44-114 s a
# validation were measured at load 5-28 on 2 cores, not idle; these are guesses for idle.
TOOL_SECONDS_PER_RL_STEP = 60.0
TOOL_SECONDS_PER_VALIDATION = 30.0


@dataclass
class DemoSummary:
    algorithm: str
    val_em_before: float
    val_em_after: float
    val_em_before_by_source: dict
    val_em_after_by_source: dict
    rl_steps: int
    wall_seconds: float
    rl_seconds: float
    checkpoint_dir: str
    hf_model_dir: str
    metrics_path: str
    plot_path: str
    data_dir: str = "data/demo"
    try_command: str = ""
    protocol: str = "tags"
    world: str = "facts"
    # Validation's opens per question (val/env/number_of_valid_open; the browse world only).
    opens_before: float | None = None
    opens_after: float | None = None
    # How the model was trained to open pages (the browse world): open_tag.{enable, max_opens, page_size}
    # and the server's snippet_chars, so `infer.py --demo` asks and serves as training did.
    open_tag: dict | None = None
    # The trajectory dumps (trainer.rollout_data_dir / validation_data_dir under it) and the command
    # that draws them (scripts/viewer).
    dumps_dir: str = ""
    viewer_command: str = ""


def build_all(s: DemoSettings) -> dict[str, Path]:
    """Corpus and BM25 index, RL questions, and the warm start (shipped, or built here)."""
    claim_data_dir(s)
    with tqdm(total=3, desc="build (world, index, questions, warm start)", unit="part") as bar:
        corpus, index_dir = build_corpus_and_index(s)
        bar.update(1)
        train_pq, test_pq = build_questions(s)
        bar.update(1)
        model = resolve_warmstart(s)
        bar.update(1)
    return {"corpus": corpus, "index": index_dir, "train": train_pq, "test": test_pq, "model": model}


def _given(overrides: list[str], key: str) -> str | None:
    for arg in overrides:
        k, _, v = arg.lstrip("+").partition("=")
        if k == key:
            return v.strip("\"'")
    return None


def overall_em(metrics: dict, source_counts: dict[str, int]) -> tuple[float, dict[str, float]]:
    """EM over all validation rows, from the per-source means the trainer reports."""
    by_source = {s: float(metrics[f"val/test_score/{s}"]) for s in source_counts if f"val/test_score/{s}" in metrics}
    if set(by_source) != set(source_counts):
        raise KeyError(f"validation metrics lack sources {sorted(set(source_counts) - set(by_source))}; "
                       f"got keys {sorted(k for k in metrics if k.startswith('val/'))}")
    total = sum(source_counts.values())
    return sum(by_source[s] * n for s, n in source_counts.items()) / total, by_source


def split_algorithm(argv: list[str]) -> tuple[str, list[str]]:
    """(`demo.algorithm`, the other arguments): grpo unless `demo.algorithm=ppo` is given; a
    `demo.recipe=<name>` (scripts/demo/recipes.py) is the algorithm `<name>`, on GRPO's settings."""
    algorithm, recipe, rest = "grpo", None, []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key == "demo.algorithm":
            if value not in ALGORITHMS:
                raise SystemExit(f"demo.algorithm takes {' or '.join(ALGORITHMS)}, got {value!r}")
            algorithm = value
        elif key == "demo.recipe":
            if value not in RECIPES:
                raise SystemExit(f"demo.recipe takes one of {', '.join(RECIPES)}, got {value!r}")
            recipe = value
        else:
            rest.append(arg)
    if recipe is not None:
        if algorithm != "grpo":
            raise SystemExit(f"demo.recipe={recipe} runs on the GRPO demo's settings; drop demo.algorithm={algorithm}")
        algorithm = recipe
    return algorithm, rest


def algorithm_overrides(algorithm: str) -> list[str]:
    """DEFAULT_RL_OVERRIDES, with PPO_RL_OVERRIDES in place of the keys they set for ppo (a recipe's
    overrides for a demo.recipe)."""
    if algorithm == "grpo":
        return list(DEFAULT_RL_OVERRIDES)
    if algorithm in RECIPES:
        return with_recipe(list(DEFAULT_RL_OVERRIDES), algorithm)
    ppo_keys = {o.lstrip("+").partition("=")[0] for o in PPO_RL_OVERRIDES}
    return [o for o in DEFAULT_RL_OVERRIDES if o.lstrip("+").partition("=")[0] not in ppo_keys] + \
        list(PPO_RL_OVERRIDES)


def rl_overrides(s: DemoSettings, paths: dict[str, Path], user: list[str], url: str,
                 algorithm: str = "grpo") -> list[str]:
    out_dir = Path(s.output_dir)
    base = [
        f"data.train_files={paths['train']}", f"data.val_files={paths['test']}",
        f"actor_rollout_ref.model.path={paths['model']}", f"critic.model.path={paths['model']}",
        f"trainer.default_local_dir={out_dir / 'checkpoints'}", f"retriever.url={url}",
        f"trainer.rollout_data_dir={dumps_dir(s) / 'rollout'}", f"trainer.validation_data_dir={dumps_dir(s) / 'validation'}",
    ]
    overrides = [*algorithm_overrides(algorithm), *base]
    if s.protocol == "tool":
        tool_keys = {o.partition("=")[0] for o in TOOL_RL_OVERRIDES}
        overrides = [o for o in overrides if o.lstrip("+").partition("=")[0] not in tool_keys]
        overrides += [*TOOL_RL_OVERRIDES, f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tool_config_path(s)}",
                      f"trainer.experiment_name=demo-{algorithm}-tool"]
    if s.agent == "openai":
        overrides = [o for o in overrides if not o.startswith("trainer.experiment_name=")]
        overrides += [*AGENT_RL_OVERRIDES, f"trainer.experiment_name=demo-{algorithm}-openai"]
    if s.world == "browse":
        browse_keys = {o.partition("=")[0] for o in BROWSE_RL_OVERRIDES}
        overrides = [o for o in overrides if o.lstrip("+").partition("=")[0] not in browse_keys]
        overrides += [*BROWSE_RL_OVERRIDES, f"trainer.experiment_name=demo-{algorithm}-browse"]
    # Later overrides win in Hydra, but a "+key" given twice is an error: drop ours.
    user_keys = {a.lstrip("+").partition("=")[0] for a in user}
    overrides = [o for o in overrides if o.lstrip("+").partition("=")[0] not in user_keys]
    steps = int(_given(user, "trainer.total_training_steps") or _given(overrides, "trainer.total_training_steps"))
    # Save and validate at the last step (the trainer always does both there when the
    # frequency is positive); validate twice more on the way for the curve.
    if "trainer.save_freq" not in user_keys:
        overrides.append(f"trainer.save_freq={steps}")
    if "trainer.test_freq" not in user_keys:
        overrides.append(f"trainer.test_freq={max(1, steps // 3)}")
    return overrides + user


def dumps_dir(s: DemoSettings) -> Path:
    """Where the demo's trajectory dumps go (one folder each for rollouts and validations)."""
    return Path(s.output_dir) / "dumps"


def viewer_command(config: Any, output_dir: Path) -> str:
    """`python -m scripts.viewer <dump folders> -o <output_dir>/trajectories.html` for the run's dumps."""
    folders = [str(f) for f in (config.trainer.rollout_data_dir, config.trainer.validation_data_dir) if f]
    if not folders:
        return ""
    parents = {str(Path(f).parent) for f in folders}
    named = [parents.pop()] if len(parents) == 1 and len(folders) == 2 else folders
    return shlex.join(["python", "-m", "scripts.viewer", *named, "-o", str(Path(output_dir) / "trajectories.html")])


def tool_config_path(s: DemoSettings) -> Path:
    """Where the tool protocol's demo writes its tool config (pointing at its retrieval server)."""
    return (Path(s.output_dir) / TOOL_CONFIG_FILE).resolve()


def validations(steps: int, test_freq: int) -> int:
    """How many validation passes a run makes: before training, every test_freq steps, and at the end."""
    return 1 + len({*range(test_freq, steps + 1, test_freq), steps}) if test_freq > 0 else 1


def start_line(s: DemoSettings, steps: int, test_freq: int, n_val: int, algorithm: str = "grpo") -> str:
    """One line saying what the demo will do and about how long it takes."""
    tool = s.protocol == "tool"
    shipped_dir = shipped_path(s)
    shipped = (shipped_dir / MANIFEST).exists() and not s.rebuild_warmstart and \
        read_manifest(shipped_dir).settings == settings_for(s)
    steps_of = {"tool": ("tool_sft_phase", s.tool_sft_steps), "browse": ("browse_sft_phase", s.browse_sft_steps)}
    prefix, phases = steps_of.get(s.variant, ("sft_phase", s.sft_steps))
    cached = (s.root / f"{prefix}{len(phases) - 1}" / "huggingface" / "config.json").exists()
    sft_steps = sum(phases)
    n_checks = validations(steps, test_freq)
    per_step, per_val = (TOOL_SECONDS_PER_RL_STEP, TOOL_SECONDS_PER_VALIDATION) if tool else \
        (SECONDS_PER_RL_STEP, SECONDS_PER_VALIDATION)
    if algorithm == "ppo":
        per_step *= PPO_STEP_TIME_FACTOR
    seconds = SECONDS_START + steps * per_step + n_checks * per_val
    if shipped:
        warm = f"start from the shipped warm start ({shipped_dir.relative_to(REPO_ROOT)}, {sft_steps:,} SFT steps)" \
            if shipped_dir.is_relative_to(REPO_ROOT) else f"start from the shipped warm start ({shipped_dir})"
    elif cached:
        warm = f"start from the warm start cached under {s.root}"
    else:
        warm = f"build the warm start ({sft_steps:,} SFT steps)"
        seconds += sft_steps * SECONDS_PER_SFT_STEP
    minutes = max(1, round(seconds / 60))
    return (f"[demo] This will build a small fictional world and its BM25 search server, {warm}, then run "
            f"{steps} {algorithm.upper()} steps with search{' (tool calls)' if tool else ''}{' and open' if s.variant == 'browse' else ''} on CPU, validating on {n_val} held-out questions {n_checks} times: "
            f"about {minutes} min on an idle 2-core machine (up to {2 * minutes} on a slower or busy one).")


def run_demo(argv: list[str] | None = None) -> DemoSummary:
    from verl.trainer.main_ppo import compose_config, run_ppo

    start = time.time()
    algorithm, rest = split_algorithm(list(sys.argv[1:] if argv is None else argv))
    settings, user_overrides = split_args(rest)
    planned = planned_config(algorithm, settings, user_overrides)
    n_val = settings.n_val_per_kind * len(ONE_HOP_KINDS if settings.world == "browse" else ONE_HOP_KINDS + TWO_HOP_KINDS)
    print(start_line(settings, int(planned.trainer.total_training_steps), int(planned.trainer.test_freq), n_val,
                     algorithm), flush=True)
    paths = build_all(settings)
    out_dir = Path(settings.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    source_counts = pd.read_parquet(paths["test"])["data_source"].value_counts().to_dict()

    overrides = rl_overrides(settings, paths, user_overrides, "http://placeholder/retrieve", algorithm)
    ckpt_root = Path(compose_config(overrides).trainer.default_local_dir)
    if _given(user_overrides, "trainer.resume_mode") in (None, "disable") and ckpt_root.exists():
        # A fresh run: old checkpoints and an appended-to metrics log would mix two runs.
        shutil.rmtree(ckpt_root)

    snippets = ["--snippet_chars", str(settings.browse_snippet_chars)] if settings.world == "browse" else []
    with retrieval_server(_given(user_overrides, "retriever.url"), paths["index"], paths["corpus"],
                          settings.topk, out_dir / "retrieval_server.log", snippets) as url:
        if settings.protocol == "tool":
            write_tool_config(tool_config_path(settings), url, settings.topk)
        if settings.agent:
            os.environ["SEARCH_R1_RETRIEVAL_URL"] = url    # where the demo's agent searches
        config = compose_config(rl_overrides(settings, paths, user_overrides, url, algorithm))
        rl_start = time.time()
        history = run_ppo(config)
        rl_seconds = time.time() - rl_start

    val_records = [h for h in history if any(k.startswith("val/test_score/") for k in h)]
    if len(val_records) < 2:
        raise RuntimeError(f"expected validation before and after training, got {len(val_records)} records")
    em_before, by_before = overall_em(val_records[0], source_counts)
    em_after, by_after = overall_em(val_records[-1], source_counts)
    step = int(val_records[-1]["step"])
    metrics_path = Path(config.trainer.log_dir or ckpt_root / "logs") / "metrics.jsonl"
    from scripts.plot_metrics import PANELS, plot_metrics

    panels = PANELS + CRITIC_PANELS if algorithm == "ppo" else PANELS
    shown = _shown(algorithm, settings.protocol, settings.world, settings.agent)
    plot_path = plot_metrics(metrics_path, out_dir / "training_curves.png",
                             title=f"Search-R1 offline demo ({shown})", panels=panels)
    hf_model_dir = str(ckpt_root / f"global_step_{step}" / "hf")
    summary = DemoSummary(
        algorithm=algorithm, val_em_before=em_before, val_em_after=em_after, val_em_before_by_source=by_before,
        val_em_after_by_source=by_after, rl_steps=step, wall_seconds=time.time() - start, rl_seconds=rl_seconds,
        checkpoint_dir=str(ckpt_root / f"global_step_{step}"),
        hf_model_dir=hf_model_dir, metrics_path=str(metrics_path), plot_path=str(plot_path),
        data_dir=str(settings.root), protocol=settings.protocol, world=settings.world,
        opens_before=_opens(val_records[0]), opens_after=_opens(val_records[-1]),
        open_tag=({"enable": True, "max_opens": int(config.open_tag.max_opens),
                   "page_size": int(config.open_tag.page_size), "snippet_chars": int(settings.browse_snippet_chars)}
                  if settings.world == "browse" else None),
        # infer.py --demo asks a held-out question in the tag protocol (with the open tag in the browse
        # world); the tool-protocol model is shown by its validation.
        try_command=try_command(paths["test"], out_dir) if settings.variant in ("tags", "browse") else "",
        dumps_dir=str(dumps_dir(settings)), viewer_command=viewer_command(config, out_dir))
    (out_dir / "summary.json").write_text(json.dumps(summary.__dict__, indent=2))
    print_summary(summary, out_dir / "summary.json")
    return summary


def _opens(metrics: dict) -> float | None:
    """Opens per validation question (None without the open tag)."""
    value = metrics.get("val/env/number_of_valid_open")
    return None if value is None else float(value)


def _shown(algorithm: str, protocol: str, world: str, agent: str = "") -> str:
    if agent:
        return f"{algorithm.upper()}, {agent} agent"
    if world == "browse":
        return f"{algorithm.upper()}, browse world"
    return f"{algorithm.upper()}, tool calls" if protocol == "tool" else algorithm.upper()


def planned_config(algorithm: str, settings: DemoSettings, user_overrides: list[str]):
    """The trainer config the demo will run (placeholder paths and retriever URL)."""
    from verl.trainer.main_ppo import compose_config

    return compose_config(rl_overrides(settings, {k: Path(k) for k in ("train", "test", "model")},
                                       user_overrides, "http://placeholder/retrieve", algorithm))


def held_out_questions(test_parquet: str | Path, source: str = TWOHOP_SOURCE) -> list[tuple[str, list[str]]]:
    """(question, golden answers) of one source's rows in the demo's validation parquet, in file order."""
    from search_r1.prompt import TEMPLATES

    frame = pd.read_parquet(test_parquet)
    heads = [template.split("{question}")[0] for template in TEMPLATES.values()]   # base, open (browse world)
    out = []
    for i, row in frame[frame["data_source"] == source].iterrows():
        content = row["prompt"][0]["content"]
        head = next((h for h in heads if content.startswith(h)), None)
        if head is None:
            raise ValueError(f"{test_parquet}: row {i} ({source}) does not use the Search-R1 prompt template")
        out.append((content[len(head):].strip(), [str(a) for a in row["reward_model"]["ground_truth"]["target"]]))
    return out


def demo_question(test_parquet: str | Path) -> str:
    """The first held-out two-hop question of the demo's validation parquet (what `infer.py --demo` asks);
    one-hop where it has none (the browse world)."""
    questions = held_out_questions(test_parquet) or held_out_questions(test_parquet, ONEHOP_SOURCE)
    if not questions:
        raise ValueError(f"{test_parquet}: no {TWOHOP_SOURCE} or {ONEHOP_SOURCE} rows; delete the demo's data "
                         "folder to rebuild it")
    return questions[0][0]


def try_command(test_parquet: str | Path, output_dir: Path) -> str:
    """`python infer.py --demo --question "..."`: the trained model on a held-out two-hop question."""
    question = demo_question(test_parquet)
    # Double quotes as a user would type them, unless the shell would read something inside.
    quoted = f'"{question}"' if not any(c in question for c in '"$`\\!') else shlex.quote(question)
    cmd = f"python infer.py --demo --question {quoted}"
    if Path(output_dir) != Path(DemoSettings.output_dir):
        cmd += f" --demo_output_dir {shlex.quote(str(output_dir))}"
    return cmd


# The critic's curves, beside the four of scripts/plot_metrics.py, for demo.algorithm=ppo.
CRITIC_PANELS = (
    ("Critic value loss", ("critic/vf_loss",)),
    ("Critic values and explained variance", ("critic/values/mean", "critic/vf_explained_var")),
)


def print_summary(s: DemoSummary, path: Path) -> None:
    shown = _shown(s.algorithm, s.protocol, s.world)
    print(f"\n========== Search-R1 offline demo ({shown}) ==========")
    print(f"validation EM before RL: {s.val_em_before:.3f}  {s.val_em_before_by_source}")
    print(f"validation EM after RL:  {s.val_em_after:.3f}  {s.val_em_after_by_source}")
    if s.opens_before is not None and s.opens_after is not None:
        print(f"opens per question:      {s.opens_before:.3f} before RL -> {s.opens_after:.3f} after")
    print(f"RL steps: {s.rl_steps}   RL time: {s.rl_seconds:.0f}s   total: {s.wall_seconds:.0f}s")
    print(f"checkpoint: {s.checkpoint_dir}\nHF model:   {s.hf_model_dir}")
    print(f"metrics:    {s.metrics_path}\nplot:       {s.plot_path}\nsummary:    {path}")
    if s.viewer_command:
        print(f"trajectories: {s.viewer_command}  (then open the page in a browser)")
    if s.try_command:
        print(f"try it:     {s.try_command}", flush=True)


def main() -> None:
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(__doc__)
        return
    # The demo's own bars are the ones to watch: no per-file "Loading weights" bars, here or in
    # the Ray workers and the retrieval server (they inherit this environment).
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    from hydra.errors import HydraException

    from verl.trainer.config_schema import ConfigError

    try:
        run_demo()
    except (ConfigError, HydraException) as exc:
        # A config mistake is the user's to fix from the message (it names the key), as in main_ppo:
        # no traceback in front of it.
        print(f"[demo] config error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
