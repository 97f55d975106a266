"""FlashRAG JSONL -> Search-R1 parquet, through the processing scripts' own functions."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from scripts.data_process import nq_search, qa_search_test_merge, qa_search_train_merge
from scripts.data_process.common import read_flashrag_jsonl
from search_r1.prompt import PROMPT_TEMPLATE

FIXTURE_TEMPLATE = Path("/work/shared/fixtures/prompt_template.txt")


def _write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture()
def flashrag_dir(tmp_path: Path) -> Path:
    root = tmp_path / "flashrag"
    _write(root / "nq" / "train.jsonl", [
        {"id": "train_0", "question": "  who wrote hamlet ", "golden_answers": ["Shakespeare", "William Shakespeare"]},
        {"id": "train_1", "question": "capital of france?", "golden_answers": ["Paris"]},
    ])
    _write(root / "nq" / "test.jsonl", [{"id": "test_0", "question": "who is x", "golden_answers": ["Y"]}])
    _write(root / "hotpotqa" / "train.jsonl", [{"id": "h0", "question": "q1", "golden_answers": ["a1"]}])
    _write(root / "hotpotqa" / "dev.jsonl", [{"id": "h1", "question": "q2", "golden_answers": ["a2"]},
                                             {"id": "h2", "question": "q3", "golden_answers": ["a3"]}])
    return root


def test_prompt_template_is_byte_identical_to_the_released_one() -> None:
    if FIXTURE_TEMPLATE.exists():
        assert PROMPT_TEMPLATE == FIXTURE_TEMPLATE.read_text()
    assert PROMPT_TEMPLATE.endswith("Question: {question}\n")


def test_nq_rows_follow_the_design_contract(flashrag_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    written = nq_search.main(["--local_dir", str(out), "--input_dir", str(flashrag_dir)])
    assert set(written) == {"train", "test"}
    table = pq.read_table(out / "train.parquet")
    assert set(table.column_names) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    rows = pd.read_parquet(out / "train.parquet").to_dict("records")
    first = rows[0]
    assert first["data_source"] == "nq"
    assert first["ability"] == "fact-reasoning"
    assert list(first["prompt"]) == [{"role": "user",
                                      "content": PROMPT_TEMPLATE.replace("{question}", "who wrote hamlet?")}]
    assert first["reward_model"]["style"] == "rule"
    assert list(first["reward_model"]["ground_truth"]["target"]) == ["Shakespeare", "William Shakespeare"]
    assert first["extra_info"] == {"split": "train", "index": 0}
    # A question that already ends with "?" does not get a second one.
    assert rows[1]["prompt"][0]["content"].endswith("Question: capital of france?\n")
    assert pd.read_parquet(out / "test.parquet")["extra_info"][0]["split"] == "test"


def test_merged_sources_get_unique_indices_and_fall_back_to_dev(flashrag_dir: Path, tmp_path: Path) -> None:
    train = qa_search_train_merge.main(["--local_dir", str(tmp_path), "--input_dir", str(flashrag_dir)])
    test = qa_search_test_merge.main(["--local_dir", str(tmp_path), "--input_dir", str(flashrag_dir),
                                      "--data_sources", "nq,hotpotqa"])
    train_df, test_df = pd.read_parquet(train), pd.read_parquet(test)
    assert list(train_df.data_source) == ["nq", "nq", "hotpotqa"]
    assert [e["index"] for e in train_df.extra_info] == [0, 1, 2]
    # hotpotqa has no test split here, so its dev split is used.
    assert list(test_df.data_source) == ["nq", "hotpotqa", "hotpotqa"]
    assert len({e["index"] for e in test_df.extra_info}) == 3
    assert {e["split"] for e in test_df.extra_info} == {"test"}


def test_a_bad_row_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "ok", "golden_answers": ["a"]}\n{"question": "no answers"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: missing field 'golden_answers'"):
        read_flashrag_jsonl(path)
    path.write_text('{"question": "ok", "golden_answers": "not a list"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: .*golden_answers"):
        read_flashrag_jsonl(path)
    path.write_text('{"question": "ok", "golden_answers": ["a"]}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: invalid JSON"):
        read_flashrag_jsonl(path)


def test_a_missing_split_is_reported_with_its_source(flashrag_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="hotpotqa"):
        nq_search.process_source("hotpotqa", tmp_path, flashrag_dir, splits=("test",))


def test_parquet_loads_in_the_rl_dataset(flashrag_dir: Path, tmp_path: Path, tiny_model_dir: str) -> None:
    from transformers import AutoTokenizer

    from verl.utils.dataset import rl_dataset

    nq_search.main(["--local_dir", str(tmp_path), "--input_dir", str(flashrag_dir)])
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ds = rl_dataset.RLHFDataset(str(tmp_path / "train.parquet"), tok, prompt_key="prompt", max_prompt_length=512)
    assert len(ds) == 2
    item = ds[0]
    assert item["input_ids"].shape[-1] <= 512
    assert "Shakespeare" in list(item["reward_model"]["ground_truth"]["target"])
