"""Demo data building: parquet through the shared processing code, cached on disk."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from transformers import AutoTokenizer

from scripts.demo.build import (
    DemoSettings,
    build_corpus_and_index,
    build_model_init,
    build_questions,
    split_args,
)
from scripts.demo.run_demo import overall_em, validations
from verl.utils.dataset.rl_dataset import RLHFDataset


def test_demo_questions_become_rl_parquet_with_both_sources(tmp_path: Path, tiny_model_dir: str) -> None:
    s = DemoSettings(data_dir=str(tmp_path), n_val_per_kind=5, n_train=100)
    train, test = build_questions(s)
    test_df = pd.read_parquet(test)
    assert test_df.data_source.value_counts().to_dict() == {"demo_onehop": 20, "demo_twohop": 10}
    assert len(pd.read_parquet(train)) == 100
    assert (tmp_path / "flashrag" / "demo_onehop" / "train.jsonl").exists()
    ds = RLHFDataset(str(test), AutoTokenizer.from_pretrained(tiny_model_dir), max_prompt_length=512)
    assert len(ds) == 30
    # Cached: a second call leaves the files alone.
    mtime = test.stat().st_mtime_ns
    build_questions(s)
    assert test.stat().st_mtime_ns == mtime


def test_corpus_index_and_tokenizer_are_built_once(tmp_path: Path) -> None:
    s = DemoSettings(data_dir=str(tmp_path), vocab_size=500, hidden_size=32, num_layers=1, num_heads=2,
                     intermediate_size=64)
    corpus, index = build_corpus_and_index(s)
    assert sum(1 for _ in corpus.open()) == 500 and index.is_dir()
    model_dir = build_model_init(s)
    tok = AutoTokenizer.from_pretrained(model_dir)
    # Names split into syllable pieces, not single tokens (the tokenizer saw another world).
    assert len(tok.tokenize(" Tupemi Wenvios")) >= 3
    assert tok.pad_token != tok.eos_token
    assert build_model_init(s) == model_dir


def test_demo_arguments_split_into_settings_and_trainer_overrides() -> None:
    settings, overrides = split_args(["demo.sft_steps=7,3", "demo.sft_world_seeds=5,6",
                                      "trainer.total_training_steps=3", "+trainer.val_only=true"])
    assert settings.sft_steps == (7, 3) and settings.sft_world_seeds == (5, 6)
    assert overrides == ["trainer.total_training_steps=3", "+trainer.val_only=true"]


def test_overall_em_weights_sources_by_their_row_counts() -> None:
    em, by_source = overall_em({"val/test_score/a": 1.0, "val/test_score/b": 0.0}, {"a": 3, "b": 1})
    assert em == 0.75 and by_source == {"a": 1.0, "b": 0.0}


def test_boolean_demo_settings_parse_true_and_false() -> None:
    assert split_args(["demo.rebuild_warmstart=false"])[0].rebuild_warmstart is False
    assert split_args(["demo.rebuild_warmstart=true"])[0].rebuild_warmstart is True
    with pytest.raises(SystemExit, match="true or false"):
        split_args(["demo.rebuild_warmstart=maybe"])


def test_validation_count_is_before_every_test_freq_and_at_the_end() -> None:
    assert validations(12, 4) == 4      # before, 4, 8, 12
    assert validations(10, 3) == 5      # before, 3, 6, 9, 10
    assert validations(5, -1) == 1      # only before


def test_each_warm_start_chains_its_sft_phases_into_its_own_folders(tmp_path: Path, monkeypatch) -> None:
    """The tag and browse warm starts (the tool one too, through the same _sft_phases): one SFT run per
    phase, each from the previous phase's HF folder, in the kind's folders with its learning rate and
    seeds; a phase already done is not run again. The SFT trainer is replaced by a recorder that writes
    the HF folder as it would."""
    import verl.trainer.fsdp_sft_trainer as sft
    from scripts.demo import build

    runs: list[dict[str, str]] = []

    def fake_run_sft(config: dict[str, str]):
        runs.append(config)
        hf = Path(config["trainer.default_local_dir"]) / "huggingface"
        hf.mkdir(parents=True)
        (hf / "config.json").write_text("{}")
        return type("Result", (), {"steps": 1, "final_loss": 0.5, "wall_seconds": 0.1})()

    monkeypatch.setattr(sft, "compose_sft_config", lambda overrides: dict(o.split("=", 1) for o in overrides))
    monkeypatch.setattr(sft, "run_sft", fake_run_sft)
    monkeypatch.setattr(build, "build_sft_data", lambda s: tmp_path / "tag.parquet")
    monkeypatch.setattr(build, "build_browse_sft_data", lambda s: tmp_path / "browse.parquet")
    monkeypatch.setattr(build, "build_model_init", lambda s: tmp_path / "init")
    s = DemoSettings(data_dir=str(tmp_path), sft_steps=(3, 4), browse_sft_steps=(5,), sft_lr=1e-3, browse_sft_lr=2e-4)
    tag = build.build_warm_start(s)
    assert tag == s.root / "sft_phase1" / "huggingface"
    assert [(r["model.partial_pretrain"], r["trainer.total_training_steps"], r["optim.lr"], r["trainer.seed"])
            for r in runs] == [(str(tmp_path / "init"), "3", "0.001", "1"),
                               (str(s.root / "sft_phase0" / "huggingface"), "4", "0.001", "2")]
    assert all(r["data.train_files"] == str(tmp_path / "tag.parquet") for r in runs)
    assert (s.root / "sft_phase1" / "sft_result.json").is_file()
    browse = build.build_browse_warm_start(s, tag)
    assert browse == s.root / "browse_sft_phase0" / "huggingface" and len(runs) == 3
    assert (runs[2]["model.partial_pretrain"], runs[2]["optim.lr"], runs[2]["trainer.seed"],
            runs[2]["data.train_files"]) == (str(tag), "0.0002", "201", str(tmp_path / "browse.parquet"))
    assert build.build_warm_start(s) == tag and len(runs) == 3      # done phases are skipped
