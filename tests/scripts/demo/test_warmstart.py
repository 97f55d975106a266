"""The shipped warm start: its files match the manifest, and the rebuild command reproduces it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from scripts.demo.build import DemoSettings, tokenizer_texts
from scripts.demo.warmstart import (
    MANIFEST,
    REBUILD_COMMAND,
    main,
    read_manifest,
    resolve_warmstart,
    verify,
    warmstart_settings,
)
from verl.utils.tiny_model import train_bpe_tokenizer

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


def test_shipped_tokenizer_is_the_one_the_build_trains(tmp_path: Path) -> None:
    import shutil

    rebuilt = train_bpe_tokenizer(tokenizer_texts(DemoSettings()), vocab_size=DemoSettings().vocab_size)
    rebuilt.save_pretrained(tmp_path)
    # Loaded as every consumer loads it: from a folder whose config.json names the model type.
    shutil.copy(SHIPPED / "config.json", tmp_path / "config.json")
    rebuilt, shipped = AutoTokenizer.from_pretrained(tmp_path), AutoTokenizer.from_pretrained(SHIPPED)
    assert rebuilt.get_vocab() == shipped.get_vocab()
    text = "<search> Tupemi Wenvios </search><information>Doc 1(Title: Stovi)</information>"
    assert rebuilt(text)["input_ids"] == shipped(text)["input_ids"]


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
