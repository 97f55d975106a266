"""`--template_type open`: the released prompt plus one sentence on the open tag; the default unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from scripts.data_process import nq_search, qa_search_train_merge
from search_r1.prompt import OPEN_SENTENCE, PROMPT_TEMPLATE, PROMPT_TEMPLATE_OPEN, make_prefix

FIXTURE_TEMPLATE = Path("/work/shared/fixtures/prompt_template.txt")


@pytest.fixture()
def flashrag_dir(tmp_path: Path) -> Path:
    root = tmp_path / "flashrag"
    for source, split in (("nq", "train"), ("nq", "test"), ("hotpotqa", "train")):
        (root / source).mkdir(parents=True, exist_ok=True)
        (root / source / f"{split}.jsonl").write_text(
            json.dumps({"id": "0", "question": "who wrote hamlet", "golden_answers": ["Shakespeare"]}) + "\n")
    return root


def test_the_open_template_is_the_released_one_plus_one_sentence():
    if FIXTURE_TEMPLATE.exists():
        assert PROMPT_TEMPLATE == FIXTURE_TEMPLATE.read_text()        # the default untouched
    assert PROMPT_TEMPLATE_OPEN.count(OPEN_SENTENCE) == 1
    assert PROMPT_TEMPLATE_OPEN.replace(OPEN_SENTENCE, "") == PROMPT_TEMPLATE
    assert "<open> doc_id </open>" in PROMPT_TEMPLATE_OPEN and "<open>" not in PROMPT_TEMPLATE
    # the sentence follows the search sentence
    assert "between <information> and </information>. Each result shows its doc_id" in PROMPT_TEMPLATE_OPEN
    assert make_prefix("q") == PROMPT_TEMPLATE.replace("{question}", "q?")
    assert make_prefix("q", "open") == PROMPT_TEMPLATE_OPEN.replace("{question}", "q?")
    with pytest.raises(ValueError, match="unknown template_type 'fancy'"):
        make_prefix("q", "fancy")


def test_template_type_open_writes_the_open_prompt_and_base_the_released_one(flashrag_dir: Path, tmp_path: Path):
    nq_search.main(["--local_dir", str(tmp_path / "open"), "--input_dir", str(flashrag_dir), "--template_type", "open"])
    nq_search.main(["--local_dir", str(tmp_path / "base"), "--input_dir", str(flashrag_dir)])
    opened = pd.read_parquet(tmp_path / "open" / "train.parquet")["prompt"][0][0]["content"]
    base = pd.read_parquet(tmp_path / "base" / "train.parquet")["prompt"][0][0]["content"]
    assert opened == PROMPT_TEMPLATE_OPEN.replace("{question}", "who wrote hamlet?")
    assert base == PROMPT_TEMPLATE.replace("{question}", "who wrote hamlet?")
    merged = qa_search_train_merge.main(["--local_dir", str(tmp_path / "merged"), "--input_dir", str(flashrag_dir),
                                         "--data_sources", "nq,hotpotqa", "--template_type", "open"])
    assert all(OPEN_SENTENCE in p[0]["content"] for p in pd.read_parquet(merged)["prompt"])


def test_template_type_open_is_refused_with_the_tool_format(flashrag_dir: Path, tmp_path: Path):
    with pytest.raises(ValueError, match="--template_type open is for --format tags"):
        nq_search.main(["--local_dir", str(tmp_path), "--input_dir", str(flashrag_dir), "--template_type", "open",
                        "--format", "tool"])
