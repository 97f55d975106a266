"""scripts/download.py's offline part: assembling index parts and unpacking the corpus."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from scripts.download import concat_parts, gunzip


def test_index_parts_are_concatenated_in_order_and_not_redone(tmp_path: Path) -> None:
    (tmp_path / "part_aa").write_bytes(b"A" * 1000)
    (tmp_path / "part_ab").write_bytes(b"B" * 10)
    out = concat_parts([tmp_path / "part_aa", tmp_path / "part_ab"], tmp_path / "e5_Flat.index")
    assert out.read_bytes() == b"A" * 1000 + b"B" * 10
    mtime = out.stat().st_mtime_ns
    concat_parts([tmp_path / "part_aa", tmp_path / "part_ab"], out)
    assert out.stat().st_mtime_ns == mtime
    assert not (tmp_path / "e5_Flat.index.tmp").exists()


def test_a_truncated_index_is_rebuilt(tmp_path: Path) -> None:
    (tmp_path / "part_aa").write_bytes(b"xyz")
    (tmp_path / "part_ab").write_bytes(b"123")
    (tmp_path / "e5_Flat.index").write_bytes(b"xy")
    out = concat_parts([tmp_path / "part_aa", tmp_path / "part_ab"], tmp_path / "e5_Flat.index")
    assert out.read_bytes() == b"xyz123"


def test_corpus_is_gunzipped(tmp_path: Path) -> None:
    lines = b'{"id": "0", "contents": "\\"T\\"\\ntext"}\n'
    with gzip.open(tmp_path / "wiki-18.jsonl.gz", "wb") as f:
        f.write(lines)
    out = gunzip(tmp_path / "wiki-18.jsonl.gz", tmp_path / "wiki-18.jsonl")
    assert out.read_bytes() == lines


def test_a_missing_part_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="part_ab"):
        concat_parts([tmp_path / "part_ab"], tmp_path / "out.index")
