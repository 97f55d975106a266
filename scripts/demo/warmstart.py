"""The demo's supervised warm start, shipped as weights and rebuilt by one command.

    python -m scripts.demo.warmstart                     # rebuild example/demo_warmstart/ from scratch
    python -m scripts.demo.warmstart --check             # do the shipped files match their manifest?
    python -m scripts.demo.warmstart demo.protocol=tool  # rebuild example/demo_warmstart_tool/ (tool protocol)
    python -m scripts.demo.warmstart demo.world=browse   # rebuild example/demo_warmstart_browse/ (browse world)
    python -m scripts.demo.warmstart --out /tmp/ws demo.sft_steps=300,200   # any DemoSettings field

The warm start is a means, not what the demo shows: building it costs ~1,060 SFT steps
(~13 minutes on an idle 2-core CPU), so the repository ships its result
(`example/demo_warmstart/`: fp32 safetensors, config, the locally trained tokenizer, and
`manifest.json` with each file's sha256, the settings and the command that made it, the
versions of the libraries that shape the files and the sha256 of the text the tokenizer and
the SFT were trained on) and the demo spends its minutes on RL. The rebuild runs exactly
what the demo's own build does (`scripts.demo.build.build_warm_start`: tokenizer, random
Qwen2, the project's SFT trainer in phases) in a fresh folder. On the machine that made them
the files come out bit-identical. Another CPU gives a different model for two reasons: its
float kernels (AVX2 vs AVX-512) round differently, and numpy's top-k breaks the BM25 ties of
the demonstrations' second passage differently, so even the training text differs (the
manifest's `inputs` says whether it did). That is why the demo ships weights rather than a
promise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import shutil
import tempfile
from dataclasses import asdict, dataclass, field, fields, replace
from importlib import metadata
from pathlib import Path

import torch

from scripts.demo.build import (
    REPO_ROOT,
    DemoSettings,
    browse_sft_data_path,
    build_browse_warm_start,
    build_tool_warm_start,
    build_warm_start,
    fingerprint,
    sft_data_fingerprint_path,
    split_args,
    tokenizer_texts,
    tool_sft_data_path,
)
from scripts.demo.tool_demonstrations import tool_text_fingerprint

MANIFEST = "manifest.json"
REBUILD_COMMAND = "python -m scripts.demo.warmstart"
# The DemoSettings fields that determine the warm start's weights (data_dir, output_dir,
# RL question counts and num_threads do not change what is learned).
WARMSTART_FIELDS = (
    "world_seed", "tokenizer_world_seed", "sft_world_seeds", "n_demos", "vocab_size", "hidden_size",
    "num_layers", "num_heads", "intermediate_size", "topk", "sft_steps", "sft_lr", "sft_batch_size",
    "sft_context_weight",
)
# demo.protocol=tool: its warm start continues the tag warm start (WARMSTART_FIELDS) with these.
TOOL_WARMSTART_FIELDS = ("tool_n_demos", "tool_sft_steps", "tool_sft_lr", "tool_sft_batch_size")
# demo.world=browse: its warm start continues the tag warm start with these.
BROWSE_WARMSTART_FIELDS = ("browse_n_demos", "browse_open_share", "browse_snippet_chars", "browse_sft_steps",
                           "browse_sft_lr", "browse_sft_batch_size")
# The libraries whose version can change the files: the tokenizer's BPE trainer and its
# serialisation, the model code and kernels, the weights' format, and the demonstrations'
# BM25 search (its stemmer, and numpy's top-k, which breaks score ties).
LIBRARIES = ("tokenizers", "transformers", "torch", "safetensors", "numpy", "bm25s", "PyStemmer")


@dataclass
class WarmStartManifest:
    """What `example/demo_warmstart/manifest.json` records about the files beside it."""

    settings: dict                  # WARMSTART_FIELDS -> value (JSON types)
    files: dict[str, str]           # file name -> sha256
    command: str                    # the command that rebuilds the folder
    sft_phases: list[dict] = field(default_factory=list)   # per phase: steps, final_loss, wall_seconds
    built_with: dict = field(default_factory=dict)         # torch version, CPU, threads
    libraries: dict = field(default_factory=dict)          # LIBRARIES -> version that built the files
    inputs: dict = field(default_factory=dict)             # tokenizer_texts, sft_data -> their fingerprint


def library_versions() -> dict[str, str | None]:
    """The installed version of each of LIBRARIES (None when one is not installed)."""
    versions: dict[str, str | None] = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def text_protocol_fingerprint() -> str:
    """sha256 of the text the warm start was trained on that is not in DemoSettings: the prompt
    template and the rollout protocol (observation rendering, notices). Changing either makes the
    shipped weights stale (their SFT demonstrations used the old text), so it is a setting too."""
    from search_r1.llm_agent import actions
    from search_r1.prompt import PROMPT_TEMPLATE
    from search_r1.search.schema import Hit

    sample = [Hit.from_contents("0", '"Title"\nbody one\nbody two', 1.0), Hit.from_contents("1", "bare", 0.5)]
    text = "\x00".join([PROMPT_TEMPLATE, actions.render_observation(sample), actions.render_search_failure(),
                        actions.INVALID_ACTION_NOTICE, actions.SEARCH_BUDGET_NOTICE])
    return hashlib.sha256(text.encode()).hexdigest()


def warmstart_settings(s: DemoSettings) -> dict:
    """The fields of `s` that determine the warm start, as JSON would give them back, and the
    fingerprint of the text protocol its demonstrations were written in."""
    settings = {name: getattr(s, name) for name in WARMSTART_FIELDS}
    settings["text_protocol"] = text_protocol_fingerprint()
    return json.loads(json.dumps(settings))


def tool_warmstart_settings(s: DemoSettings) -> dict:
    """What determines the tool protocol's warm start: the tag warm start it continues (its
    settings and text protocol), the tool SFT's fields, and the tool protocol's text fingerprint."""
    settings = warmstart_settings(s)
    settings.update({name: getattr(s, name) for name in TOOL_WARMSTART_FIELDS})
    settings["protocol"] = "tool"
    settings["tool_text_protocol"] = tool_text_fingerprint()
    return json.loads(json.dumps(settings))


def browse_text_fingerprint() -> str:
    """sha256 of the browse demonstrations' text not in DemoSettings: the open template, the open
    tag's rendering (results with doc ids, a page), the snippet rule and the world's pages."""
    from scripts.demo.browse_demonstrations import PAGE_SIZE, guess_turn, open_turn
    from scripts.demo.world import make_world
    from search_r1.llm_agent import actions
    from search_r1.prompt import PROMPT_TEMPLATE_OPEN
    from search_r1.search.documents import paginate, snippet
    from search_r1.search.schema import Hit

    page = make_world(1, n_people=2, n_cities=2, n_companies=2, n_countries=2, n_founders=2).browse_passages()
    sample = [Hit.from_contents(p["id"], snippet(p["contents"], 20), 1.0) for p in page]
    text = "\x00".join([PROMPT_TEMPLATE_OPEN, actions.render_observation(sample, show_doc_ids=True),
                        actions.render_open_page("T", paginate("a\nb", 1, PAGE_SIZE), "7"), open_turn("7").text, guess_turn("G").text,
                        *(p["contents"] for p in page)])
    return hashlib.sha256(text.encode()).hexdigest()


def browse_warmstart_settings(s: DemoSettings) -> dict:
    """What determines the browse world's warm start: the tag warm start it continues, the browse
    SFT's fields, and the browse text's fingerprint."""
    settings = warmstart_settings(s)
    settings.update({name: getattr(s, name) for name in BROWSE_WARMSTART_FIELDS})
    settings["world"] = "browse"
    settings["browse_text_protocol"] = browse_text_fingerprint()
    return json.loads(json.dumps(settings))


def settings_for(s: DemoSettings) -> dict:
    """The manifest settings of this demo's warm start (`s.variant`)."""
    return {"tool": tool_warmstart_settings, "browse": browse_warmstart_settings}.get(s.variant, warmstart_settings)(s)


def shipped_path(s: DemoSettings) -> Path:
    """The shipped warm start of this demo (demo.warmstart_dir / tool_warmstart_dir / browse_warmstart_dir)."""
    return {"tool": s.tool_warmstart_path, "browse": s.browse_warmstart_path}.get(s.variant, s.warmstart_path)


def file_hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}


def read_manifest(folder: Path) -> WarmStartManifest:
    if not (folder / MANIFEST).exists():
        raise FileNotFoundError(f"no warm start at {folder} ({MANIFEST} missing); build it with `{REBUILD_COMMAND}`")
    data = json.loads((folder / MANIFEST).read_text())
    unknown = sorted(set(data) - {f.name for f in fields(WarmStartManifest)})
    if unknown:
        raise ValueError(f"{folder / MANIFEST}: unknown keys {unknown}; known: "
                         f"{[f.name for f in fields(WarmStartManifest)]}")
    return WarmStartManifest(**data)


def verify(folder: Path) -> WarmStartManifest:
    """The folder's manifest, after checking every file against its sha256 (raises on a mismatch)."""
    manifest = read_manifest(folder)
    actual = file_hashes(folder)
    bad = sorted(name for name in set(manifest.files) | set(actual) if manifest.files.get(name) != actual.get(name))
    if bad:
        raise ValueError(f"{folder}: files differ from {MANIFEST}: {bad}; rebuild with `{manifest.command}`")
    return manifest


def _sft_phases(s: DemoSettings) -> list[dict]:
    if s.protocol == "tool":
        return [json.loads((s.root / f"tool_sft_phase{i}" / "sft_result.json").read_text())
                for i in range(len(s.tool_sft_steps))]
    if s.variant == "browse":
        return [json.loads((s.root / f"browse_sft_phase{i}" / "sft_result.json").read_text())
                for i in range(len(s.browse_sft_steps))]
    return [json.loads((s.root / f"sft_phase{i}" / "sft_result.json").read_text()) for i in range(len(s.sft_steps))]


def _inputs(s: DemoSettings, base: Path | None) -> dict:
    if s.variant in ("tool", "browse"):
        # The tag warm start the SFT continued from (its weights' sha256) and the demonstrations.
        where = base.resolve()
        shown = where.relative_to(REPO_ROOT) if where.is_relative_to(REPO_ROOT) else where
        data = tool_sft_data_path(s) if s.variant == "tool" else browse_sft_data_path(s)
        return {"base_warmstart": str(shown), "base_model_sha256": file_hashes(base)["model.safetensors"],
                "sft_data": (data.parent / "train.fingerprint").read_text().strip()}
    return {"tokenizer_texts": fingerprint(tokenizer_texts(s)),
            "sft_data": sft_data_fingerprint_path(s).read_text().strip()}


def export_warmstart(s: DemoSettings, model_dir: Path, out: Path, command: str,
                     base: Path | None = None) -> WarmStartManifest:
    """Copy the HF folder `model_dir` (built by `build_warm_start(s)`, or for the tool protocol by
    `build_tool_warm_start(s, base)`) to `out` with its manifest."""
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(model_dir, tmp)
    manifest = WarmStartManifest(
        settings=settings_for(s), files=file_hashes(tmp), command=command, sft_phases=_sft_phases(s),
        built_with={"torch": torch.__version__, "machine": platform.machine(), "processor": platform.processor(),
                    "num_threads": s.num_threads, "sft_device": s.sft_device},
        libraries=library_versions(), inputs=_inputs(s, base))
    (tmp / MANIFEST).write_text(json.dumps(asdict(manifest), indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return manifest


def rebuild(s: DemoSettings, out: Path, command: str = REBUILD_COMMAND) -> WarmStartManifest:
    """Build the warm start from nothing (a fresh temporary data folder) and export it to `out`."""
    with tempfile.TemporaryDirectory(prefix="demo_warmstart_") as tmp:
        fresh = replace(s, data_dir=tmp)
        if s.variant in ("tool", "browse"):
            # The tag warm start it continues: the shipped one when it matches the settings.
            base = resolve_warmstart(replace(fresh, protocol="tags", world="facts"))
            build = build_tool_warm_start if s.variant == "tool" else build_browse_warm_start
            return export_warmstart(fresh, build(fresh, base), out, command, base=base)
        return export_warmstart(fresh, build_warm_start(fresh), out, command)


def resolve_warmstart(s: DemoSettings) -> Path:
    """The model RL starts from: the shipped warm start when it was made with these settings,
    else (or with demo.rebuild_warmstart=true) one built and cached under demo.data_dir."""
    shipped = shipped_path(s)
    wanted = settings_for(s)
    if not s.rebuild_warmstart and (shipped / MANIFEST).exists():
        manifest = verify(shipped)
        if manifest.settings == wanted:
            return shipped
        changed = sorted(k for k in {*manifest.settings, *wanted} if manifest.settings.get(k) != wanted.get(k))
        print(f"[demo] settings {changed} differ from the shipped warm start's ({shipped}): building one under "
              f"{s.data_dir}", flush=True)
    if s.variant in ("tool", "browse"):
        # demo.rebuild_warmstart=true rebuilds the tool (browse) SFT; the tag warm start under it is
        # the shipped one whenever the tag settings match it.
        base = resolve_warmstart(replace(s, protocol="tags", world="facts", rebuild_warmstart=False))
        return (build_tool_warm_start if s.variant == "tool" else build_browse_warm_start)(s, base)
    return build_warm_start(s)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="folder to write (default: demo.warmstart_dir)")
    parser.add_argument("--check", action="store_true", help="only verify the folder against its manifest")
    args, rest = parser.parse_known_args(argv)
    settings, extra = split_args(rest)
    if extra:
        parser.error(f"only demo.<field>=value arguments are accepted, got {extra}")
    out = args.out or shipped_path(settings)
    if args.check:
        manifest = verify(out)
        print(f"{out}: {len(manifest.files)} files match {MANIFEST}; settings match the defaults: "
              f"{manifest.settings == settings_for(settings)}")
        return
    command = " ".join([REBUILD_COMMAND, *(["--out", str(args.out)] if args.out else []), *rest])
    manifest = rebuild(settings, out, command)
    print(f"warm start written to {out} (model.safetensors sha256 {manifest.files['model.safetensors'][:16]}…)")


if __name__ == "__main__":
    main()
