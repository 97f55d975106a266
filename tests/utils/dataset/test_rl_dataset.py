"""RLHFDataset: left padding, length filter, seeded subsample, chat template, resumable loader."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch
from transformers import AutoTokenizer

from verl.utils.dataset.rl_dataset import RLHFDataset, build_dataloader, prompt_to_text


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: str):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _row(i: int, question: str) -> dict:
    return {
        "data_source": "nq",
        "prompt": [{"role": "user", "content": question}],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": [f"answer{i}"]}},
        "extra_info": {"split": "train", "index": i},
    }


def _write(path: Path, questions: list[str]) -> str:
    pd.DataFrame([_row(i, q) for i, q in enumerate(questions)]).to_parquet(path)
    return str(path)


def test_prompts_are_left_padded_with_positions_from_the_mask(tmp_path: Path, tokenizer) -> None:
    path = _write(tmp_path / "d.parquet", ["who?", "where was the author born? " * 3])
    ds = RLHFDataset(path, tokenizer, max_prompt_length=64)
    short, long = ds[0], ds[1]
    n_short = int(short["attention_mask"].sum())
    assert n_short < int(long["attention_mask"].sum()) <= 64
    assert short["input_ids"].shape == (64,)
    assert torch.all(short["attention_mask"][: 64 - n_short] == 0) and torch.all(short["attention_mask"][64 - n_short:] == 1)
    assert torch.all(short["input_ids"][: 64 - n_short] == tokenizer.pad_token_id)
    assert short["position_ids"][64 - n_short].item() == 0
    assert short["position_ids"][-1].item() == n_short - 1
    assert short["reward_model"]["ground_truth"]["target"] == ["answer0"]
    assert short["index"] == 0 and short["data_source"] == "nq"


def test_chat_template_is_applied_with_the_assistant_turn_opened(tmp_path: Path, tokenizer) -> None:
    path = _write(tmp_path / "d.parquet", ["who?"])
    ds = RLHFDataset(path, tokenizer, max_prompt_length=64)
    text = tokenizer.decode(ds[0]["input_ids"][ds[0]["attention_mask"].bool()])
    assert text == "<|im_start|>user\nwho?<|im_end|>\n<|im_start|>assistant\n"


def test_raw_content_is_used_when_the_tokenizer_has_no_chat_template(tokenizer) -> None:
    class NoTemplate:
        chat_template = None

    assert prompt_to_text([{"role": "user", "content": "who?"}], NoTemplate()) == "who?"


def test_overlong_prompts_are_dropped_and_counted(tmp_path: Path, tokenizer) -> None:
    path = _write(tmp_path / "d.parquet", ["short", "long " * 200, "short again"])
    ds = RLHFDataset(path, tokenizer, max_prompt_length=48)
    assert len(ds) == 2
    assert ds.stats.rows_dropped_overlong == 1 and ds.stats.rows_kept == 2
    assert [ds[i]["index"] for i in range(2)] == [0, 2]


def test_overlong_prompt_without_filter_raises_naming_file_and_row(tmp_path: Path, tokenizer) -> None:
    path = _write(tmp_path / "d.parquet", ["short", "long " * 200])
    with pytest.raises(ValueError, match=r"d\.parquet row 1 .*max_prompt_length=48"):
        RLHFDataset(path, tokenizer, max_prompt_length=48, filter_overlong_prompts=False)


def test_missing_column_names_file_and_column(tmp_path: Path, tokenizer) -> None:
    path = tmp_path / "bad.parquet"
    pd.DataFrame([{"prompt": [{"role": "user", "content": "q"}], "data_source": "nq"}]).to_parquet(path)
    with pytest.raises(KeyError, match=r"bad\.parquet has no column 'reward_model'"):
        RLHFDataset(str(path), tokenizer)


def test_subsample_is_fixed_by_the_seed(tmp_path: Path, tokenizer) -> None:
    path = _write(tmp_path / "d.parquet", [f"question {i}" for i in range(20)])
    pick = lambda seed: [RLHFDataset(path, tokenizer, data_num=5, seed=seed)[i]["index"] for i in range(5)]  # noqa: E731
    assert pick(3) == pick(3)
    assert pick(3) != pick(4)
    assert len(set(pick(3))) == 5


def _take(loader, n_batches: int) -> list[list[int]]:
    """The first n_batches batch indices, crossing epochs; stops mid-epoch like a training loop."""
    taken: list[list[int]] = []
    while len(taken) < n_batches:
        for batch in loader:
            taken.append(batch.non_tensor_batch["index"].tolist())
            if len(taken) == n_batches:
                break
    return taken


@pytest.mark.parametrize("stop_after", [1, 2, 3, 4])
def test_train_loader_resumes_at_the_same_position(tmp_path: Path, tokenizer, stop_after: int) -> None:
    path = _write(tmp_path / "d.parquet", [f"question {i}" for i in range(10)])
    ds = RLHFDataset(path, tokenizer, max_prompt_length=32)
    uninterrupted = _take(build_dataloader(ds, 3, train=True, seed=7), 6)
    # 3 batches an epoch (drop_last drops one row), a new order each epoch
    assert all(len(b) == 3 for b in uninterrupted)
    assert uninterrupted[:3] != uninterrupted[3:]

    loader = build_dataloader(ds, 3, train=True, seed=7)
    seen = _take(loader, stop_after)
    resumed = build_dataloader(ds, 3, train=True, seed=7)
    resumed.load_state_dict(loader.state_dict())
    assert seen + _take(resumed, 6 - stop_after) == uninterrupted


def test_val_loader_keeps_every_row_in_order(tmp_path: Path, tokenizer) -> None:
    path = _write(tmp_path / "d.parquet", [f"question {i}" for i in range(7)])
    ds = RLHFDataset(path, tokenizer, max_prompt_length=32)
    batches = list(build_dataloader(ds, 3, train=False))
    assert [b.non_tensor_batch["index"].tolist() for b in batches] == [[0, 1, 2], [3, 4, 5], [6]]
    assert batches[0].batch["input_ids"].shape == (3, 32)
