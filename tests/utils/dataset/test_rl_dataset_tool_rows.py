"""RLHFDataset with veRL's keys: rows of preprocess_search_r1_dataset.py, the tool protocol's prompt,
data.truncation, data.filter_overlong_prompts counted, data.return_raw_chat."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from transformers import AutoTokenizer

from verl.utils.dataset.rl_dataset import RAW_PROMPT, RLHFDataset, build_dataloader, truncate_ids
from verl.utils.tiny_model import TOOL_CHAT_TEMPLATE

SEARCH_SCHEMA = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Searches the web for relevant information based on the given query.",
        "parameters": {"type": "object", "properties": {"query_list": {"type": "array", "item": {"type": "string"},
                                                                       "description": "queries"}},
                       "required": ["query_list"]},
    },
}
SYSTEM = "You are a helpful and harmless assistant."


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: str):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = TOOL_CHAT_TEMPLATE
    return tok


def _verl_row(i: int, question: str, source: str = "nq") -> dict:
    """A row as veRL's examples/data_preprocess/preprocess_search_r1_dataset.py writes it."""
    golden = {"target": [f"answer{i}"]}
    return {
        "data_source": f"searchR1_{source}",
        "prompt": [{"role": "system", "content": SYSTEM},
                   {"role": "user", "content": f"Answer the given question. Question: {question}"}],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": golden},
        "extra_info": {"index": 100 + i, "need_tools_kwargs": True, "question": question, "split": "train",
                       "tools_kwargs": {"search": {"create_kwargs": {"ground_truth": golden, "question": question,
                                                                     "data_source": f"searchR1_{source}"}}}},
        "metadata": None,
    }


def _write(path: Path, questions: list[str], source: str = "nq") -> str:
    pd.DataFrame([_verl_row(i, q, source) for i, q in enumerate(questions)]).to_parquet(path)
    return str(path)


def _length(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> int:
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _text(tokenizer, item: dict) -> str:
    return tokenizer.decode(item["input_ids"][item["attention_mask"].bool()])


def test_verls_search_r1_rows_load_with_their_fields(tmp_path: Path, tokenizer) -> None:
    path = _write(tmp_path / "train.parquet", ["who wrote it?", "where?"], source="hotpotqa")
    ds = RLHFDataset(path, tokenizer, max_prompt_length=2048, tools=[SEARCH_SCHEMA])
    assert len(ds) == 2 and ds.stats.rows_dropped_overlong == 0
    item = ds[0]
    assert item["data_source"] == "searchR1_hotpotqa"
    assert item["reward_model"]["ground_truth"]["target"] == ["answer0"]
    assert item["index"] == 100                                  # extra_info.index, as veRL's loader takes it
    kwargs = item["extra_info"]["tools_kwargs"]["search"]["create_kwargs"]
    assert kwargs == {"ground_truth": {"target": ["answer0"]}, "question": "who wrote it?",
                      "data_source": "searchR1_hotpotqa"}
    assert item["extra_info"]["need_tools_kwargs"] is True


def test_the_tool_protocol_renders_the_tool_schema_into_the_prompt(tmp_path: Path, tokenizer) -> None:
    path = _write(tmp_path / "train.parquet", ["who wrote it?"])
    text = _text(tokenizer, RLHFDataset(path, tokenizer, max_prompt_length=2048, tools=[SEARCH_SCHEMA])[0])
    expected = tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Answer the given question. Question: who wrote it?"}],
        tools=[SEARCH_SCHEMA], add_generation_prompt=True, tokenize=False)
    assert text == expected
    assert text.startswith(f"<|im_start|>system\n{SYSTEM}\n\n# Tools") and '"name": "search"' in text
    assert text.endswith("<|im_start|>user\nAnswer the given question. Question: who wrote it?<|im_end|>\n"
                         "<|im_start|>assistant\n")
    # Without tools (the tag protocol) the same row has no schema.
    plain = _text(tokenizer, RLHFDataset(path, tokenizer, max_prompt_length=2048)[0])
    assert "# Tools" not in plain and plain.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>")


def test_a_chat_template_that_ignores_tools_is_refused(tmp_path: Path, tiny_model_dir: str) -> None:
    plain = AutoTokenizer.from_pretrained(tiny_model_dir)       # ChatML without tools
    path = _write(tmp_path / "train.parquet", ["who?"])
    with pytest.raises(ValueError, match="ignores tools="):
        RLHFDataset(path, plain, max_prompt_length=2048, tools=[SEARCH_SCHEMA])


def test_overlong_tool_prompts_are_filtered_at_the_bound_and_counted(tmp_path: Path, tokenizer) -> None:
    path = _write(tmp_path / "train.parquet", ["who?", "where was the author born? " * 40, "when?"])
    lengths = [_length(tokenizer, _verl_row(i, q)["prompt"], [SEARCH_SCHEMA])
               for i, q in enumerate(["who?", "where was the author born? " * 40])]
    bound = lengths[0] + 10
    assert lengths[1] > bound
    ds = RLHFDataset(path, tokenizer, max_prompt_length=bound, tools=[SEARCH_SCHEMA], filter_overlong_prompts=True)
    assert (ds.stats.rows_read, ds.stats.rows_dropped_overlong, ds.stats.rows_kept) == (3, 1, 2)
    assert [ds[i]["index"] for i in range(len(ds))] == [100, 102]


@pytest.mark.parametrize("side", ["left", "right", "middle"])
def test_truncation_cuts_the_rendered_prompts_token_ids(tmp_path: Path, tokenizer, side: str) -> None:
    path = _write(tmp_path / "train.parquet", ["where was the author born? " * 10])
    text = tokenizer.apply_chat_template(_verl_row(0, "where was the author born? " * 10)["prompt"],
                                         add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bound = len(ids) - 7
    ds = RLHFDataset(path, tokenizer, max_prompt_length=bound, filter_overlong_prompts=False, truncation=side)
    kept = ds[0]["input_ids"][ds[0]["attention_mask"].bool()].tolist()
    assert (ds.stats.rows_truncated, ds.stats.rows_dropped_overlong, len(ds)) == (1, 0, 1)
    expected = {"left": ids[7:], "right": ids[:bound],
                "middle": ids[:bound // 2] + ids[len(ids) - (bound - bound // 2):]}[side]
    assert kept == expected and len(kept) == bound


def test_truncation_error_names_the_file_and_row(tmp_path: Path, tokenizer) -> None:
    path = _write(tmp_path / "train.parquet", ["who?", "where was the author born? " * 10])
    bound = _length(tokenizer, _verl_row(0, "who?")["prompt"]) + 2
    with pytest.raises(ValueError, match=rf"train.parquet row 1 has \d+ tokens > max_prompt_length={bound} "
                                         r".*data.truncation=left\|right\|middle"):
        RLHFDataset(path, tokenizer, max_prompt_length=bound, filter_overlong_prompts=False, truncation="error")
    with pytest.raises(ValueError, match="data.truncation='top' is unknown"):
        RLHFDataset(path, tokenizer, max_prompt_length=bound, truncation="top")


def test_truncate_ids_keeps_the_sides_verl_keeps() -> None:
    ids = list(range(10))
    assert truncate_ids(ids, 4, "left") == [6, 7, 8, 9]
    assert truncate_ids(ids, 4, "right") == [0, 1, 2, 3]
    assert truncate_ids(ids, 5, "middle") == [0, 1, 7, 8, 9]
    assert truncate_ids(ids, 12, "middle") == ids


def test_return_raw_chat_keeps_the_messages_in_the_batch(tmp_path: Path, tokenizer) -> None:
    path = _write(tmp_path / "train.parquet", ["who?", "where?"])
    ds = RLHFDataset(path, tokenizer, max_prompt_length=2048, tools=[SEARCH_SCHEMA], return_raw_chat=True)
    batch = next(iter(build_dataloader(ds, batch_size=2, train=False)))
    raw = batch.non_tensor_batch[RAW_PROMPT]
    assert raw.shape == (2,)                        # one object per row, not a (2, 2) array of messages
    assert raw[1] == [{"role": "system", "content": SYSTEM},
                      {"role": "user", "content": "Answer the given question. Question: where?"}]
    without = RLHFDataset(path, tokenizer, max_prompt_length=2048)
    assert RAW_PROMPT not in without[0]
