"""Passage corpus backed by a memory-mapped Arrow file, fetched by row.

The wiki-18 corpus has 21M passages; one Python object per passage would cost tens of
GiB. Instead the JSONL is converted once into an Arrow IPC file (``id``, ``contents``
columns) and memory-mapped: opening is instant, RAM grows only with the pages that
lookups touch, and several server processes share the OS page cache.

Row ``i`` of the store is line ``i`` of the JSONL (blank lines skipped), which is the
row order FAISS and BM25 indexes are built in.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from search_r1.search.schema import Document

ARROW_SCHEMA = pa.schema([("id", pa.string()), ("contents", pa.string())])
_SOURCE_KEY = b"search_r1.source"
_BATCH_ROWS = 8192


class CorpusFormatError(ValueError):
    """A corpus line that is not a passage; the message names the file and line."""


@dataclass(frozen=True)
class Passage:
    """One parsed corpus line."""

    doc_id: str
    contents: str


def parse_line(line: str, path: str, line_no: int, row: int) -> Passage:
    """Parse one JSONL line; accepts ``contents`` or ``title`` + ``text`` (FlashRAG style)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise CorpusFormatError(f"{path}:{line_no}: not valid JSON ({err.msg} at column {err.colno})") from err
    if not isinstance(obj, dict):
        raise CorpusFormatError(f"{path}:{line_no}: expected a JSON object, got {type(obj).__name__}")
    if "contents" in obj:
        contents = obj["contents"]
    elif "title" in obj and "text" in obj:
        contents = f'"{obj["title"]}"\n{obj["text"]}'
    else:
        raise CorpusFormatError(
            f"{path}:{line_no}: passage has no 'contents' field (nor 'title' + 'text'); keys: {sorted(obj)}"
        )
    if not isinstance(contents, str):
        raise CorpusFormatError(f"{path}:{line_no}: 'contents' must be a string, got {type(contents).__name__}")
    # Corpora without ids are addressed by row, which is what the indexes store anyway.
    doc_id = obj.get("id", row)
    return Passage(doc_id=str(doc_id), contents=contents)


def iter_jsonl(path: str | os.PathLike) -> Iterator[Passage]:
    """Stream passages from a JSONL corpus, validating every line."""
    path = str(path)
    row = 0
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            yield parse_line(line, path, line_no, row)
            row += 1


def _source_stamp(path: Path) -> str:
    stat = path.stat()
    return f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"


def default_arrow_path(jsonl_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the Arrow store of ``jsonl_path`` lives: ``cache_dir``, else ``$SEARCH_R1_CACHE``,
    else ``~/.cache/search_r1`` (never beside the corpus: data folders are often read-only
    or inside a git checkout). The file name carries a hash of the corpus's absolute path.
    """
    jsonl_path = Path(jsonl_path)
    root = Path(cache_dir or os.environ.get("SEARCH_R1_CACHE") or Path.home() / ".cache" / "search_r1")
    digest = hashlib.sha1(str(jsonl_path.resolve()).encode()).hexdigest()[:16]
    return root / "corpus" / f"{jsonl_path.stem}-{digest}.arrow"


def convert_jsonl_to_arrow(jsonl_path: str | os.PathLike, arrow_path: str | os.PathLike) -> int:
    """Write the Arrow store for ``jsonl_path``; returns the number of passages.

    Written to a temporary name and renamed, so a crash never leaves a half store
    that a later open would trust.
    """
    jsonl_path, arrow_path = Path(jsonl_path), Path(arrow_path)
    arrow_path.parent.mkdir(parents=True, exist_ok=True)
    schema = ARROW_SCHEMA.with_metadata({_SOURCE_KEY: _source_stamp(jsonl_path).encode()})
    tmp = arrow_path.with_name(arrow_path.name + f".tmp{os.getpid()}")
    n = 0
    try:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
            ids: list[str] = []
            contents: list[str] = []
            for passage in iter_jsonl(jsonl_path):
                ids.append(passage.doc_id)
                contents.append(passage.contents)
                if len(ids) == _BATCH_ROWS:
                    writer.write_batch(pa.record_batch([ids, contents], schema=schema))
                    n += len(ids)
                    ids, contents = [], []
            if ids:
                writer.write_batch(pa.record_batch([ids, contents], schema=schema))
                n += len(ids)
        os.replace(tmp, arrow_path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return n


def _is_fresh(arrow_path: Path, jsonl_path: Path) -> bool:
    try:
        with pa.memory_map(str(arrow_path), "r") as source:
            metadata = pa.ipc.open_file(source).schema.metadata or {}
    except (OSError, pa.ArrowInvalid):
        return False
    return metadata.get(_SOURCE_KEY, b"").decode() == _source_stamp(jsonl_path)


class Corpus:
    """Read-only passage store; ``get(rows)`` fetches passages by row number."""

    def __init__(self, table: pa.Table, path: str) -> None:
        self._table = table
        # Per-chunk arrays + row offsets: ChunkedArray.take would first concatenate the
        # whole column (copying the mapped file into RAM); scalar access touches only
        # the pages of the rows asked for.
        self._id_chunks = table.column("id").chunks
        self._contents_chunks = table.column("contents").chunks
        self._chunk_starts = np.cumsum([0] + [len(c) for c in self._id_chunks])[:-1]
        self.path = path

    @classmethod
    def open(cls, path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Corpus:
        """Open a ``.jsonl`` corpus (converting it once) or an ``.arrow`` store directly."""
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"corpus file not found: {path}")
        if path.suffix == ".arrow":
            arrow_path = path
        else:
            arrow_path = default_arrow_path(path, cache_dir)
            if not _is_fresh(arrow_path, path):
                convert_jsonl_to_arrow(path, arrow_path)
        source = pa.memory_map(str(arrow_path), "r")
        table = pa.ipc.open_file(source).read_all()  # zero-copy over the mapping
        missing = {"id", "contents"} - set(table.column_names)
        if missing:
            raise CorpusFormatError(f"{arrow_path}: Arrow store lacks columns {sorted(missing)}")
        return cls(table, str(path))

    def __len__(self) -> int:
        return self._table.num_rows

    def _check_rows(self, rows: Sequence[int]) -> None:
        n = len(self)
        for row in rows:
            if not 0 <= row < n:
                raise IndexError(f"row {row} out of range for corpus {self.path} with {n} passages")

    def get_fields(self, rows: Sequence[int]) -> tuple[list[str], list[str]]:
        """(ids, contents) of ``rows``, in the order given."""
        rows = [int(r) for r in rows]
        if not rows:
            return [], []
        self._check_rows(rows)
        chunk_of_row = np.searchsorted(self._chunk_starts, rows, side="right") - 1
        ids, contents = [], []
        for row, chunk in zip(rows, chunk_of_row.tolist(), strict=True):
            local = row - int(self._chunk_starts[chunk])
            ids.append(self._id_chunks[chunk][local].as_py())
            contents.append(self._contents_chunks[chunk][local].as_py())
        return ids, contents

    def get(self, rows: Sequence[int]) -> list[Document]:
        """Passages at ``rows`` as wire documents, in the order given."""
        ids, contents = self.get_fields(rows)
        return [Document(id=i, contents=c) for i, c in zip(ids, contents, strict=True)]

    def iter_batches(self, batch_size: int = 1024) -> Iterator[tuple[list[str], list[str]]]:
        """(ids, contents) in row order, for index building."""
        for batch in self._table.to_batches(max_chunksize=batch_size):
            yield batch.column("id").to_pylist(), batch.column("contents").to_pylist()
