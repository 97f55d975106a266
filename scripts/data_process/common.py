"""Shared data processing: FlashRAG-layout QA rows -> Search-R1 training parquet.

A FlashRAG source is JSONL with `id`, `question` and `golden_answers: [str]`. It is read
either from the hub (`RUC-NLPIR/FlashRAG_datasets`, only when online) or from a local
folder laid out as `{local_dir}/{source}/{split}.jsonl`. With `--format tags` (the
default: the original Search-R1's `<search>` protocol) every row becomes

    {"data_source": source,
     "prompt": [{"role": "user", "content": make_prefix(question)}],
     "ability": "fact-reasoning",
     "reward_model": {"style": "rule", "ground_truth": {"target": [answers]}},
     "extra_info": {"split": split, "index": i}}

With `--format tool` (native tool calling) it becomes the row veRL upstream's
examples/data_preprocess/preprocess_search_r1_dataset.py writes:

    {"data_source": "searchR1_" + source,
     "prompt": [{"role": "system", "content": TOOL_SYSTEM_CONTENT},
                {"role": "user", "content": TOOL_USER_CONTENT_PREFIX + question}],
     "ability": "fact-reasoning",
     "reward_model": {"style": "rule", "ground_truth": {"target": [answers]}},
     "extra_info": {"index": i, "need_tools_kwargs": True, "question": question, "split": split,
                    "tools_kwargs": {"search": {"create_kwargs": {
                        "ground_truth": {"target": [answers]}, "question": question,
                        "data_source": "searchR1_" + source}}}},
     "metadata": the FlashRAG row's "metadata" (None when it has none)}

The question goes in as written in the source (veRL's script does not strip it or add
a "?"; the tag format does, as the original Search-R1 did).

The demo builds its parquet with these same functions, so the demo and the real data
can never drift apart.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa

from search_r1.prompt import make_prefix

HUB_REPO = "RUC-NLPIR/FlashRAG_datasets"
ABILITY = "fact-reasoning"

# Row layouts --format chooses: the original's <search> tags, or veRL's native tool calling.
FORMATS = ("tags", "tool")
# veRL upstream names tool-format sources "searchR1_<source>"; the reward registry keys on it
# (verl/utils/reward_score: SEARCH_R1_LIKE_PREFIX).
TOOL_DATA_SOURCE_PREFIX = "searchR1_"
# A data contract, like shared/fixtures/prompt_template.txt: checkpoints trained with veRL's
# Search-R1 reproduction saw exactly these strings, so they must stay byte-identical to
# DEFAULT_SYSTEM_CONTENT and DEFAULT_USER_CONTENT_PREFIX in veRL's
# examples/data_preprocess/preprocess_search_r1_dataset.py (volcengine/verl, checked at
# b178a3cd56f5; tests pin the prefix's sha256). The question follows the prefix directly.
TOOL_SYSTEM_CONTENT = "You are a helpful and harmless assistant."
TOOL_USER_CONTENT_PREFIX = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> "
    "first every time you get new information. After reasoning, if you find you lack "
    "some knowledge, you can call a search engine by <tool_call> query </tool_call> "
    "and it will return the top searched results between <tool_response> and "
    "</tool_response>. You can search as many times as your want. If you find no "
    "further external knowledge needed, you can directly provide the answer inside "
    "<answer> and </answer>, without detailed illustrations. For example, "
    "<answer> Beijing </answer>. Question: "
)


@dataclass(frozen=True)
class QARecord:
    """One FlashRAG question; `where` names its origin (file:line) for error messages."""

    id: str
    question: str
    golden_answers: tuple[str, ...]
    where: str
    # FlashRAG's optional per-row "metadata"; only the tool format writes it (as veRL's rows carry it).
    metadata: Any = field(default=None, compare=False)


def _record_from_dict(row: object, where: str) -> QARecord:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for key in ("question", "golden_answers"):
        if key not in row:
            raise ValueError(f"{where}: missing field {key!r}")
    question = row["question"]
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"{where}: field 'question' must be a non-empty string, got {question!r}")
    answers = row["golden_answers"]
    if isinstance(answers, str) or not isinstance(answers, Sequence) or not answers:
        raise ValueError(f"{where}: field 'golden_answers' must be a non-empty list of strings, got {answers!r}")
    if not all(isinstance(a, str) for a in answers):
        raise ValueError(f"{where}: field 'golden_answers' holds a non-string: {answers!r}")
    return QARecord(id=str(row.get("id", "")), question=question, golden_answers=tuple(answers), where=where,
                    metadata=row.get("metadata"))


def read_flashrag_jsonl(path: str | Path) -> list[QARecord]:
    """Read a local FlashRAG JSONL file; a bad row raises naming the file and line."""
    path = Path(path)
    records = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg})") from e
            records.append(_record_from_dict(row, where))
    return records


def write_flashrag_jsonl(records: Iterable[dict], path: str | Path) -> Path:
    """Write rows (dicts with id, question, golden_answers) in the FlashRAG layout."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in records:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def local_split_path(local_dir: str | Path, source: str, split: str) -> Path:
    return Path(local_dir) / source / f"{split}.jsonl"


def available_splits(source: str, local_dir: str | Path | None) -> list[str]:
    """Splits a source has: from the local folder, or (online) from the hub."""
    if local_dir is not None:
        folder = Path(local_dir) / source
        return sorted(p.stem for p in folder.glob("*.jsonl"))
    import datasets

    return list(datasets.get_dataset_split_names(HUB_REPO, source))


def load_source_split(source: str, split: str, local_dir: str | Path | None = None) -> list[QARecord]:
    """Rows of `source`/`split`: local JSONL when `local_dir` is given, else the hub (online only)."""
    if local_dir is not None:
        path = local_split_path(local_dir, source, split)
        if not path.exists():
            raise FileNotFoundError(f"no {split!r} split for source {source!r}: {path} does not exist")
        return read_flashrag_jsonl(path)
    import datasets

    ds = datasets.load_dataset(HUB_REPO, source, split=split)
    return [_record_from_dict(dict(row), f"{HUB_REPO}/{source}[{split}] row {i}") for i, row in enumerate(ds)]


def pick_split(source: str, preferred: Sequence[str], local_dir: str | Path | None) -> str:
    """The first of `preferred` that the source has (e.g. test, else dev)."""
    have = available_splits(source, local_dir)
    for split in preferred:
        if split in have:
            return split
    raise FileNotFoundError(f"source {source!r} has none of the splits {list(preferred)} (found {have})")


def make_row(record: QARecord, data_source: str, split: str, index: int, template_type: str = "base") -> dict:
    """One training/validation parquet row, exactly per DESIGN §3.2 (`template_type` open: the
    prompt with the open tag's sentence, search_r1/prompt.py)."""
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": make_prefix(record.question, template_type)}],
        "ability": ABILITY,
        "reward_model": {"style": "rule", "ground_truth": {"target": list(record.golden_answers)}},
        "extra_info": {"split": split, "index": index},
    }


def tool_data_source(source: str) -> str:
    """The tool format's name for a FlashRAG source (`nq` -> `searchR1_nq`)."""
    return source if source.startswith(TOOL_DATA_SOURCE_PREFIX) else TOOL_DATA_SOURCE_PREFIX + source


def make_tool_row(record: QARecord, data_source: str, split: str, index: int) -> dict:
    """One row in veRL's tool format (see the module docstring); `data_source` is the FlashRAG name."""
    tagged = tool_data_source(data_source)
    question = record.question  # as is: veRL's script neither strips it nor adds a "?"
    ground_truth = {"target": list(record.golden_answers)}
    return {
        "data_source": tagged,
        "prompt": [{"role": "system", "content": TOOL_SYSTEM_CONTENT},
                   {"role": "user", "content": TOOL_USER_CONTENT_PREFIX + question}],
        "ability": ABILITY,
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {
            "index": index,
            "need_tools_kwargs": True,
            "question": question,
            "split": split,
            "tools_kwargs": {"search": {"create_kwargs": {
                "ground_truth": {"target": list(record.golden_answers)}, "question": question,
                "data_source": tagged}}},
        },
        "metadata": record.metadata,
    }


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"unknown data format {fmt!r}; choose one of {list(FORMATS)} (--format)")
    return fmt


def records_to_rows(records: Sequence[QARecord], data_source: str, split: str, start_index: int = 0,
                    fmt: str = "tags", template_type: str = "base") -> list[dict]:
    """Rows (in format `fmt`) with indices start_index, start_index+1, ... so merged sources never collide."""
    if check_format(fmt) == "tool":
        if template_type != "base":
            raise ValueError(f"--template_type {template_type} is for --format tags (the tool format's prompt is "
                             "veRL's; declare an open tool in the tool config instead)")
        return [make_tool_row(r, data_source, split, start_index + i) for i, r in enumerate(records)]
    return [make_row(r, data_source, split, start_index + i, template_type) for i, r in enumerate(records)]


def write_parquet(rows: Sequence[dict], path: str | Path) -> Path:
    """Write rows as parquet; refuses an empty set or duplicate extra_info.index values."""
    path = Path(path)
    if not rows:
        raise ValueError(f"refusing to write an empty data set to {path}")
    indices = [r["extra_info"]["index"] for r in rows]
    if len(set(indices)) != len(indices):
        raise ValueError(f"{path}: extra_info.index values are not unique")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        pd.DataFrame(list(rows)).to_parquet(path, index=False)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        # Only free-form fields (the tool format's FlashRAG `metadata`) can disagree across rows.
        raise ValueError(f"{path}: rows cannot be stored as one parquet table ({e}); if the sources' "
                         "'metadata' fields differ in type, write the sources to separate files") from e
    return path


def build_merged(
    sources: Sequence[str],
    preferred_splits: Sequence[str],
    out_split: str,
    local_dir: str | Path | None,
    fmt: str = "tags",
    template_type: str = "base",
) -> list[dict]:
    """Rows (in format `fmt`) of several sources concatenated, with indices unique across sources.

    A source with a `{local_dir}/{source}/` folder is read locally, any other from the hub.
    """
    check_format(fmt)
    rows: list[dict] = []
    for source in sources:
        source_dir = local_dir_for(source, local_dir)
        split = pick_split(source, preferred_splits, source_dir)
        records = load_source_split(source, split, source_dir)
        rows.extend(records_to_rows(records, source, out_split, start_index=len(rows), fmt=fmt,
                                    template_type=template_type))
    return rows


def local_dir_for(source: str, input_dir: str | Path | None) -> Path | None:
    """`input_dir` when it holds a `{source}/` folder of JSONL files; None means "use the hub"."""
    if input_dir is not None and (Path(input_dir) / source).is_dir():
        return Path(input_dir)
    return None


def add_common_args(parser, default_local_dir: str) -> None:
    """Arguments every processing script shares (the original's names kept)."""
    parser.add_argument("--local_dir", default=default_local_dir,
                        help="output folder for the parquet files; also searched for {source}/{split}.jsonl")
    parser.add_argument("--input_dir", default=None,
                        help="folder with FlashRAG JSONL files {source}/{split}.jsonl (default: --local_dir); "
                             "sources not found there are read from the hub")
    parser.add_argument("--hdfs_dir", default=None, help="accepted for compatibility; copying to HDFS is not supported")
    parser.add_argument("--template_type", default="base", choices=["base", "open"],
                        help="'base': the released template; 'open': it plus one sentence on the open tag "
                             "(<open> doc_id </open>, for open_tag.enable=true; --format tags only)")
    parser.add_argument("--format", dest="fmt", default="tags", choices=list(FORMATS),
                        help="row layout: 'tags' (the original's <search> prompt, data_source = source) or "
                             "'tool' (veRL's native tool-calling rows, data_source = searchR1_<source>)")


def parse_sources(text: str) -> list[str]:
    sources = [s.strip() for s in text.split(",") if s.strip()]
    if not sources:
        raise ValueError(f"--data_sources is empty: {text!r}")
    return sources


def merge_split(sources: Sequence[str], splits: Sequence[str], out_split: str, local_dir: str | Path,
                input_dir: str | Path | None = None, fmt: str = "tags", template_type: str = "base") -> Path:
    """Merge `splits` (first one found per source) of `sources` into `{local_dir}/{out_split}.parquet`."""
    rows = build_merged(sources, tuple(splits), out_split, input_dir if input_dir is not None else local_dir, fmt,
                        template_type)
    return write_parquet(rows, Path(local_dir) / f"{out_split}.parquet")


def merge_cli(argv: list[str] | None, doc: str | None, default_sources: str, splits: Sequence[str],
              out_split: str) -> Path:
    """The command line shared by qa_search_train_merge.py and qa_search_test_merge.py."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, default_local_dir="./data/nq_hotpotqa_train")
    parser.add_argument("--data_sources", default=default_sources)
    args = parser.parse_args(argv)
    path = merge_split(parse_sources(args.data_sources), splits, out_split, args.local_dir, args.input_dir,
                       args.fmt, args.template_type)
    print(f"{out_split}: {path}")
    return path
