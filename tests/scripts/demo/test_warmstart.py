"""The shipped warm start: its files match the manifest, and the rebuild command reproduces it."""

from __future__ import annotations

import json
import math
import warnings
from importlib import metadata
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from scripts.demo.build import DemoSettings, fingerprint, split_args, tokenizer_texts
from scripts.demo.warmstart import (
    LIBRARIES,
    MANIFEST,
    REBUILD_COMMAND,
    WarmStartManifest,
    library_versions,
    main,
    read_manifest,
    resolve_warmstart,
    verify,
    warmstart_settings,
)
from verl.utils.tiny_model import ACTION_TAGS, SPECIAL_TOKENS, train_bpe_tokenizer

SHIPPED = DemoSettings().warmstart_path
TINY = ["demo.n_demos=64", "demo.sft_world_seeds=101,102", "demo.sft_steps=12,4", "demo.sft_batch_size=8",
        "demo.hidden_size=32", "demo.num_layers=1", "demo.num_heads=2", "demo.intermediate_size=64",
        "demo.vocab_size=600", "demo.tokenizer_world_seed=998"]


def test_shipped_warmstart_matches_its_manifest_and_the_default_settings() -> None:
    manifest = verify(SHIPPED)
    assert manifest.settings == warmstart_settings(DemoSettings()), "DemoSettings changed: rebuild the warm start"
    assert manifest.command.startswith(REBUILD_COMMAND)
    assert [p["steps"] for p in manifest.sft_phases] == list(DemoSettings().sft_steps)
    tok = AutoTokenizer.from_pretrained(SHIPPED)
    model = AutoModelForCausalLM.from_pretrained(SHIPPED)
    assert model.config.hidden_size == DemoSettings().hidden_size
    ids = tok("<search> Tupemi Wenvios </search><answer> Stovi </answer><|im_end|>")["input_ids"]
    assert max(ids) < model.config.vocab_size   # every id the demo's text produces has an embedding
    assert sum(p.numel() for p in model.parameters()) * 4 < 8_000_000   # a few MB in fp32


def test_default_settings_use_the_shipped_warmstart_without_building(tmp_path: Path) -> None:
    s = DemoSettings(data_dir=str(tmp_path))
    assert resolve_warmstart(s) == SHIPPED
    assert list(tmp_path.iterdir()) == []


def exact_tokenizer_comparison(manifest: WarmStartManifest, texts: list[str]) -> tuple[bool, str]:
    """Whether a tokenizer trained here on `texts` must equal the shipped one token for token,
    and what decides it: the same training text (its fingerprint) and the same tokenizers release
    (the BPE trainer). The text differs on a CPU whose numpy breaks the demonstrations' BM25
    score ties differently from the machine that built the shipped folder."""
    installed = metadata.version("tokenizers")
    here, shipped = fingerprint(texts), manifest.inputs.get("tokenizer_texts")
    reasons = []
    if here != shipped:
        reasons.append(f"the build's tokenizer text here has sha256 {here[:12]}, the shipped tokenizer's "
                       f"{(shipped or 'unrecorded')[:12]} (demonstrations' BM25 ties broken by this CPU's numpy)")
    if manifest.libraries.get("tokenizers") != installed:
        reasons.append(f"tokenizers {installed} is installed, the shipped tokenizer was built with "
                       f"{manifest.libraries.get('tokenizers')}")
    if reasons:
        return False, "; ".join(reasons)
    return True, f"same text (sha256 {here[:12]}) and tokenizers {installed}"


def test_shipped_tokenizer_is_the_one_the_build_trains(tmp_path: Path) -> None:
    import shutil

    s = DemoSettings()
    texts = tokenizer_texts(s)
    rebuilt = train_bpe_tokenizer(texts, vocab_size=s.vocab_size)
    rebuilt.save_pretrained(tmp_path)
    # Loaded as every consumer loads it: from a folder whose config.json names the model type.
    shutil.copy(SHIPPED / "config.json", tmp_path / "config.json")
    rebuilt, shipped = AutoTokenizer.from_pretrained(tmp_path), AutoTokenizer.from_pretrained(SHIPPED)
    exact, why = exact_tokenizer_comparison(read_manifest(SHIPPED), texts)
    if exact:
        print(f"shipped tokenizer compared token for token: {why}")
        assert rebuilt.get_vocab() == shipped.get_vocab()
        text = "<search> Tupemi Wenvios </search><information>Doc 1(Title: Stovi)</information>"
        assert rebuilt(text)["input_ids"] == shipped(text)["input_ids"]
    else:
        warnings.warn(f"shipped tokenizer compared by structure, not token for token: {why}", stacklevel=1)
    # Whatever the CPU and the versions: the same size and the same ids for every special token
    # and action tag, the shipped tokenizer encodes the build's text losslessly, and the two
    # vocabularies are mostly the same tokens (a rebuild on another CPU shares 95-100% of them;
    # a tokenizer of another world's text shares 73%).
    assert rebuilt.vocab_size == shipped.vocab_size == s.vocab_size and len(rebuilt) == len(shipped)
    fixed = [*SPECIAL_TOKENS, *ACTION_TAGS]
    assert [rebuilt.convert_tokens_to_ids(t) for t in fixed] == [shipped.convert_tokens_to_ids(t) for t in fixed]
    for text in texts[:: max(1, len(texts) // 200)]:
        assert shipped.decode(shipped(text)["input_ids"]) == text
    shared = set(rebuilt.get_vocab()) & set(shipped.get_vocab())
    assert len(shared) >= 0.9 * len(shipped), f"only {len(shared)} of {len(shipped)} tokens shared ({why})"


def test_a_tampered_file_fails_verification(tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "ws"
    shutil.copytree(SHIPPED, copy)
    (copy / "config.json").write_text((copy / "config.json").read_text() + " ")
    with pytest.raises(ValueError, match="config.json"):
        verify(copy)


def test_small_rebuild_is_identical_twice_learns_and_loads(tmp_path: Path) -> None:
    main(["--out", str(tmp_path / "a"), *TINY])
    main(["--out", str(tmp_path / "b"), *TINY])
    a, b = verify(tmp_path / "a"), verify(tmp_path / "b")
    # One machine, one thread, same seeds: the same bits (other CPUs may differ in the last bits).
    assert a.files == b.files and "model.safetensors" in a.files
    assert a.command == f"{REBUILD_COMMAND} --out {tmp_path / 'a'} {' '.join(TINY)}"
    assert [p["steps"] for p in a.sft_phases] == [12, 4]
    # A random 600-token model starts at ~ln(600) = 6.4 nats; 16 steps at lr 3e-3 reach ~5.7 here,
    # so a bound 0.5 nat below the start fails only if training does not learn.
    assert a.sft_phases[-1]["final_loss"] < math.log(600) - 0.5, a.sft_phases
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    assert model.config.hidden_size == 32
    assert json.loads((tmp_path / "a" / MANIFEST).read_text())["settings"]["sft_steps"] == [12, 4]
    assert read_manifest(tmp_path / "a").settings["tokenizer_world_seed"] == 998
    # It records what shaped the files: library versions and the fingerprints of the training text.
    assert a.libraries == library_versions() and list(a.libraries) == list(LIBRARIES)
    assert a.inputs == b.inputs and set(a.inputs) == {"tokenizer_texts", "sft_data"}
    assert a.inputs["tokenizer_texts"] == fingerprint(tokenizer_texts(split_args(TINY)[0]))


def test_shipped_manifest_records_the_libraries_and_the_text_that_shaped_it() -> None:
    manifest = read_manifest(SHIPPED)
    assert list(manifest.libraries) == list(LIBRARIES)
    config = json.loads((SHIPPED / "config.json").read_text())
    assert manifest.libraries["transformers"] == config["transformers_version"]
    assert manifest.libraries["torch"] == manifest.built_with["torch"]
    assert set(manifest.inputs) == {"tokenizer_texts", "sft_data"}
    assert all(len(v) == 64 and int(v, 16) >= 0 for v in manifest.inputs.values())


def test_a_manifest_with_an_unknown_key_names_the_file_and_key(tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "ws"
    shutil.copytree(SHIPPED, copy)
    data = json.loads((copy / MANIFEST).read_text())
    data["librarys"] = {}
    (copy / MANIFEST).write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"manifest.json: unknown keys \['librarys'\]"):
        read_manifest(copy)
