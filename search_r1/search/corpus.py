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
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from search_r1.search.schema import Document, quote_id

ARROW_SCHEMA = pa.schema([("id", pa.string()), ("contents", pa.string())])
_SOURCE_KEY = b"search_r1.source"
_BATCH_ROWS = 8192
# Duplicate ids named in the start-up warning (the rest are counted).
_DUPLICATES_NAMED = 10

logger = logging.getLogger(__name__)


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

    def get_ids(self, rows: Sequence[int]) -> list[str]:
        """The ids of ``rows``, in the order given (no passage text is read)."""
        rows = [int(r) for r in rows]
        if not rows:
            return []
        self._check_rows(rows)
        chunk_of_row = np.searchsorted(self._chunk_starts, rows, side="right") - 1
        return [self._id_chunks[chunk][row - int(self._chunk_starts[chunk])].as_py()
                for row, chunk in zip(rows, chunk_of_row.tolist(), strict=True)]

    def get(self, rows: Sequence[int]) -> list[Document]:
        """Passages at ``rows`` as wire documents, in the order given."""
        ids, contents = self.get_fields(rows)
        return [Document(id=i, contents=c) for i, c in zip(ids, contents, strict=True)]

    def iter_batches(self, batch_size: int = 1024) -> Iterator[tuple[list[str], list[str]]]:
        """(ids, contents) in row order, for index building."""
        for batch in self._table.to_batches(max_chunksize=batch_size):
            yield batch.column("id").to_pylist(), batch.column("contents").to_pylist()


@dataclass(frozen=True)
class DuplicateId:
    """An id that more than one corpus row carries, and those rows (ascending)."""

    doc_id: str
    rows: tuple[int, ...]


class IdIndex:
    """The row of a passage by its id, in 12 bytes an id (wiki-18's 21M ids: ~250 MB, where a dict
    of Python strings took ~2.5 GiB): each id's 64-bit hash, sorted, beside its row. A lookup
    finds the hash by binary search and checks the id stored at that row, so a hash collision
    never answers the wrong passage. An id on several rows answers the first one; ``duplicates``
    counts such ids and names the first few (the start-up warning).

    The hash is Python's own ``hash(str)`` (randomised per process), so an index is built and
    used in one process and never stored or shipped. ``build`` takes seconds for millions of ids:
    a server calls ``build_in_background`` at start-up, and the GIL is released in the sort.
    """

    def __init__(self, corpus: Corpus, hashes: np.ndarray, rows: np.ndarray,
                 duplicates: list[DuplicateId], num_duplicates: int) -> None:
        self.corpus = corpus
        self._hashes = hashes  # (n,) int64, ascending
        self._rows = rows      # (n,) row of each hash
        self.duplicates = duplicates
        self.num_duplicates = num_duplicates

    @classmethod
    def build(cls, corpus: Corpus, batch_rows: int = 8192) -> IdIndex:
        """Hash every id of ``corpus`` (one pass over its id column) and sort; warns about duplicate ids."""
        n = len(corpus)
        hashes = np.empty(n, dtype=np.int64)
        start = 0
        for chunk in corpus._id_chunks:
            for offset in range(0, len(chunk), batch_rows):
                ids = chunk.slice(offset, batch_rows).to_pylist()
                hashes[start:start + len(ids)] = np.fromiter(map(hash, ids), dtype=np.int64, count=len(ids))
                start += len(ids)
        order = np.argsort(hashes)  # (the GIL is released while numpy sorts)
        hashes = hashes[order]
        rows = order.astype(np.uint32 if n < 2**32 else np.int64)
        del order
        keep, duplicates, num_duplicates = _find_duplicates(corpus, hashes, rows)
        if keep is not None:  # a duplicated id keeps its first row only: a lookup checks one row, not all
            hashes, rows = hashes[keep], rows[keep]
        index = cls(corpus, hashes, rows, duplicates, num_duplicates)
        if num_duplicates:
            named = "; ".join(f"{quote_id(d.doc_id)} on rows {list(d.rows)}" for d in duplicates)
            more = f" (and {num_duplicates - len(duplicates)} more)" if num_duplicates > len(duplicates) else ""
            logger.warning(
                "corpus %s: %d ids are carried by more than one row, so /retrieve hits of different passages "
                "share an id and /open answers only the first row of each (rows from 0, in file order): %s%s. "
                "Give each passage its own id.",
                corpus.path, num_duplicates, named, more)
        return index

    @classmethod
    def build_in_background(cls, corpus: Corpus) -> Future[IdIndex]:
        """``build`` in a daemon thread; the future holds the index, or the error the build raised."""
        future: Future[IdIndex] = Future()

        def run() -> None:
            try:
                future.set_result(cls.build(corpus))
            except BaseException as err:  # noqa: BLE001 - handed to whoever awaits the index
                logger.exception("building the id index of corpus %s failed", corpus.path)
                future.set_exception(err)

        future.set_running_or_notify_cancel()
        threading.Thread(target=run, daemon=True, name="corpus-id-index").start()
        return future

    def row(self, doc_id: str) -> int | None:
        """The first row whose id is ``doc_id``, or None."""
        h = hash(doc_id)
        lo = int(np.searchsorted(self._hashes, h, side="left"))
        hi = int(np.searchsorted(self._hashes, h, side="right"))
        # one candidate, but for ids whose 64-bit hashes collide
        candidates = sorted(int(r) for r in self._rows[lo:hi])
        for row, stored in zip(candidates, self.corpus.get_ids(candidates), strict=True):
            if stored == doc_id:
                return row
        return None


def _find_duplicates(corpus: Corpus, hashes: np.ndarray,
                     rows: np.ndarray) -> tuple[np.ndarray | None, list[DuplicateId], int]:
    """Ids on several rows, among the runs of equal hashes (a run can also be a collision of different
    ids): which positions to keep (each id's first row only; None: all), the first
    ``_DUPLICATES_NAMED`` duplicated ids by first row, and how many ids are duplicated."""
    equal_next = hashes[1:] == hashes[:-1]
    if not equal_next.any():
        return None, [], 0
    edges = np.diff(np.concatenate(([False], equal_next, [False])).astype(np.int8))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1) + 1
    keep = np.ones(len(hashes), dtype=bool)
    found: list[DuplicateId] = []
    count = 0
    for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
        position_of = {int(rows[pos]): pos for pos in range(start, end)}
        run = sorted(position_of)
        rows_of: dict[str, list[int]] = {}
        for row, doc_id in zip(run, corpus.get_ids(run), strict=True):
            rows_of.setdefault(doc_id, []).append(row)
        for doc_id, same in rows_of.items():
            if len(same) > 1:
                count += 1
                keep[[position_of[row] for row in same[1:]]] = False
                found.append(DuplicateId(doc_id, tuple(same)))
                if len(found) > 4 * _DUPLICATES_NAMED:  # memory stays bounded on a corpus of duplicates
                    found = sorted(found, key=lambda d: d.rows[0])[:_DUPLICATES_NAMED]
    return keep, sorted(found, key=lambda d: d.rows[0])[:_DUPLICATES_NAMED], count
