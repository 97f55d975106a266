"""`--format tool`: FlashRAG JSONL -> the rows veRL's preprocess_search_r1_dataset.py writes."""

from __future__ import annotations

import ast
import hashlib
import json
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from scripts.data_process import nq_search, qa_search_test_merge, qa_search_train_merge
from scripts.data_process.common import (
    TOOL_SYSTEM_CONTENT,
    TOOL_USER_CONTENT_PREFIX,
    build_merged,
    read_flashrag_jsonl,
    records_to_rows,
)
from search_r1.prompt import PROMPT_TEMPLATE
from verl.utils.reward_score import get_scorer, search_r1_like_qa_em

VERL_REPO = Path("/work/.mirror/volcengine+verl/repo")
VERL_SCRIPT = "examples/data_preprocess/preprocess_search_r1_dataset.py"
# sha256 of veRL's DEFAULT_USER_CONTENT_PREFIX (574 characters), taken from its source at b178a3cd56f5.
VERL_PREFIX_SHA256 = "9f2852f83c23cafe951d8bc47df7cd677a1dfac1da37d16f9dfff35e98cf9228"
TOOL_COLUMNS = {"data_source", "prompt", "ability", "reward_model", "extra_info", "metadata"}


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
    _write(root / "hotpotqa" / "train.jsonl", [
        {"id": "h0", "question": "q1", "golden_answers": ["a1"], "metadata": {"type": "bridge", "level": "hard"}}])
    _write(root / "hotpotqa" / "dev.jsonl", [{"id": "h1", "question": "q2", "golden_answers": ["a2"]},
                                             {"id": "h2", "question": "q3", "golden_answers": ["a3"]}])
    return root


def _plain(value):
    """Parquet read-back (numpy arrays inside dicts) as plain Python lists/dicts."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def test_user_prefix_is_byte_identical_to_verls():
    assert hashlib.sha256(TOOL_USER_CONTENT_PREFIX.encode()).hexdigest() == VERL_PREFIX_SHA256
    assert TOOL_SYSTEM_CONTENT == "You are a helpful and harmless assistant."
    # Where the veRL mirror is on disk, compare with its source text directly.
    if (VERL_REPO / "HEAD").exists():
        source = subprocess.run(["git", "-C", str(VERL_REPO), "show", f"HEAD:{VERL_SCRIPT}"],
                                capture_output=True, text=True, check=True).stdout
        constants = {node.targets[0].id: ast.literal_eval(node.value) for node in ast.parse(source).body
                     if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
                     and node.targets[0].id.startswith("DEFAULT_")}
        assert constants["DEFAULT_USER_CONTENT_PREFIX"] == TOOL_USER_CONTENT_PREFIX
        assert constants["DEFAULT_SYSTEM_CONTENT"] == TOOL_SYSTEM_CONTENT
    # It is the tag template with the tool protocol's tags, and the question follows directly.
    assert PROMPT_TEMPLATE.replace("<search> query </search>", "<tool_call> query </tool_call>").replace(
        "<information> and </information>", "<tool_response> and </tool_response>") \
        == TOOL_USER_CONTENT_PREFIX + "{question}\n"


def test_nq_tool_rows_are_verls_rows(flashrag_dir: Path, tmp_path: Path):
    out = tmp_path / "out"
    written = nq_search.main(["--local_dir", str(out), "--input_dir", str(flashrag_dir), "--format", "tool"])
    assert set(written) == {"train", "test"}
    assert set(pq.read_table(out / "train.parquet").column_names) == TOOL_COLUMNS
    rows = [_plain(r) for r in pd.read_parquet(out / "train.parquet").to_dict("records")]
    question = "  who wrote hamlet "  # as written in the source: veRL does not normalise it
    target = ["Shakespeare", "William Shakespeare"]
    assert rows[0] == {
        "data_source": "searchR1_nq",
        "prompt": [{"role": "system", "content": "You are a helpful and harmless assistant."},
                   {"role": "user", "content": TOOL_USER_CONTENT_PREFIX + question}],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": target}},
        "extra_info": {"index": 0, "need_tools_kwargs": True, "question": question, "split": "train",
                       "tools_kwargs": {"search": {"create_kwargs": {
                           "ground_truth": {"target": target}, "question": question,
                           "data_source": "searchR1_nq"}}}},
        "metadata": None,
    }
    assert rows[1]["prompt"][1]["content"].endswith("Question: capital of france?")
    assert rows[1]["extra_info"]["index"] == 1
    test_row = _plain(pd.read_parquet(out / "test.parquet").to_dict("records")[0])
    assert test_row["extra_info"]["split"] == "test" and test_row["data_source"] == "searchR1_nq"


def test_merged_tool_rows_keep_unique_indices_metadata_and_dev_fallback(flashrag_dir: Path, tmp_path: Path):
    train = qa_search_train_merge.main(["--local_dir", str(tmp_path), "--input_dir", str(flashrag_dir),
                                        "--format", "tool"])
    test = qa_search_test_merge.main(["--local_dir", str(tmp_path), "--input_dir", str(flashrag_dir),
                                      "--data_sources", "nq,hotpotqa", "--format", "tool"])
    train_df, test_df = pd.read_parquet(train), pd.read_parquet(test)
    assert list(train_df.data_source) == ["searchR1_nq", "searchR1_nq", "searchR1_hotpotqa"]
    assert [e["index"] for e in train_df.extra_info] == [0, 1, 2]
    assert [e["tools_kwargs"]["search"]["create_kwargs"]["data_source"] for e in train_df.extra_info] \
        == list(train_df.data_source)
    # FlashRAG's per-row metadata is carried, as veRL's rows carry the source parquet's.
    assert train_df.metadata[2] == {"type": "bridge", "level": "hard"}
    assert train_df.metadata[0] is None
    assert list(test_df.data_source) == ["searchR1_nq", "searchR1_hotpotqa", "searchR1_hotpotqa"]
    assert {e["split"] for e in test_df.extra_info} == {"test"}


def test_tool_rows_read_back_score_with_the_search_r1_like_reward(flashrag_dir: Path, tmp_path: Path):
    nq_search.main(["--local_dir", str(tmp_path), "--input_dir", str(flashrag_dir), "--format", "tool"])
    row = pd.read_parquet(tmp_path / "train.parquet").to_dict("records")[0]
    scorer = get_scorer(row["data_source"])
    assert scorer is search_r1_like_qa_em.compute_score
    assert isinstance(row["reward_model"]["ground_truth"]["target"], np.ndarray)
    assert scorer("<answer> william shakespeare </answer>", row["reward_model"]["ground_truth"]) == 1.0


def test_tags_format_is_unchanged_and_the_default(flashrag_dir: Path, tmp_path: Path):
    default = tmp_path / "default"
    tags = tmp_path / "tags"
    nq_search.main(["--local_dir", str(default), "--input_dir", str(flashrag_dir)])
    nq_search.main(["--local_dir", str(tags), "--input_dir", str(flashrag_dir), "--format", "tags"])
    for out in (default, tags):
        assert set(pq.read_table(out / "train.parquet").column_names) == \
            {"data_source", "prompt", "ability", "reward_model", "extra_info"}
        first = _plain(pd.read_parquet(out / "train.parquet").to_dict("records")[0])
        assert first == {"data_source": "nq",
                         "prompt": [{"role": "user",
                                     "content": PROMPT_TEMPLATE.replace("{question}", "who wrote hamlet?")}],
                         "ability": "fact-reasoning",
                         "reward_model": {"style": "rule",
                                          "ground_truth": {"target": ["Shakespeare", "William Shakespeare"]}},
                         "extra_info": {"split": "train", "index": 0}}
    # The demo's call (no format argument) still builds tag rows.
    rows = build_merged(["nq"], ("train",), "train", flashrag_dir)
    assert rows[0]["data_source"] == "nq" and "metadata" not in rows[0]


def test_an_unknown_format_is_refused_naming_the_choices(flashrag_dir: Path, tmp_path: Path):
    records = read_flashrag_jsonl(flashrag_dir / "nq" / "train.jsonl")
    with pytest.raises(ValueError, match=r"'chatml'.*\['tags', 'tool'\].*--format"):
        records_to_rows(records, "nq", "train", fmt="chatml")
    with pytest.raises(SystemExit):
        nq_search.main(["--local_dir", str(tmp_path), "--input_dir", str(flashrag_dir), "--format", "chatml"])
