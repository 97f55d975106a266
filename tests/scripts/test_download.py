"""scripts/download.py without the network: assembling index parts, unpacking the corpus, and
download_all with the hub's download function and file sizes faked (what it states, deletes,
caches and skips)."""

from __future__ import annotations

import gzip
import os
import shutil
from pathlib import Path

import pytest

from scripts import download
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


# -- download_all with the hub faked: no network ------------------------------------------------

PARTS = {"part_aa": b"A" * 3000 + b"a", "part_ab": b"B" * 1500 + b"b"}
CORPUS_LINES = b"".join(b'{"id": "%d", "contents": "\\"T%d\\"\\ntext %d"}\n' % (i, i, i) for i in range(200))


class FakeHub:
    """Stands in for huggingface_hub.hf_hub_download and the hub's file sizes; records what it was asked."""

    def __init__(self, capsys: pytest.CaptureFixture[str]) -> None:
        self.capsys = capsys
        self.gz = gzip.compress(CORPUS_LINES)
        self.calls: list[dict] = []
        self.size_queries = 0
        self.printed_before_first_download: str | None = None

    def sizes(self, repo_id: str, filenames) -> dict[str, int]:
        self.size_queries += 1
        files = {**PARTS, "wiki-18.jsonl.gz": self.gz}
        return {name: len(files[name]) for name in filenames}

    def hf_hub_download(self, *, repo_id: str, filename: str, repo_type: str, local_dir, cache_dir) -> str:
        if self.printed_before_first_download is None:
            self.printed_before_first_download = self.capsys.readouterr().out
        self.calls.append({"filename": filename, "local_dir": Path(local_dir), "cache_dir": Path(cache_dir),
                           "xet_cache": os.environ.get("HF_XET_CACHE")})
        data = self.gz if filename == "wiki-18.jsonl.gz" else PARTS[filename]
        path = Path(local_dir) / filename
        path.write_bytes(data)
        return str(path)


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> FakeHub:
    import huggingface_hub

    fake = FakeHub(capsys)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake.hf_hub_download)
    monkeypatch.setattr(download, "remote_sizes", fake.sizes)
    monkeypatch.delenv("HF_XET_CACHE", raising=False)
    return fake


def test_download_assembles_verifies_and_deletes_the_parts_and_the_gz(tmp_path: Path, hub: FakeHub) -> None:
    index, corpus = download.download_all(tmp_path / "wiki")
    assert index.read_bytes() == PARTS["part_aa"] + PARTS["part_ab"]
    assert corpus.read_bytes() == CORPUS_LINES
    assert [c["filename"] for c in hub.calls] == ["part_aa", "part_ab", "wiki-18.jsonl.gz"]
    left = sorted(p.name for p in (tmp_path / "wiki").iterdir() if p.name != ".cache")   # the hub's, if any
    assert left == ["e5_Flat.index", "e5_Flat.index.complete", "wiki-18.jsonl", "wiki-18.jsonl.complete"]


def test_the_hub_cache_stays_beside_the_data(tmp_path: Path, hub: FakeHub) -> None:
    download.download_all(tmp_path / "wiki")
    cache = tmp_path / "wiki" / ".cache" / "huggingface"
    for call in hub.calls:
        assert call["local_dir"] == tmp_path / "wiki"
        assert call["cache_dir"].is_relative_to(cache)
        assert Path(call["xet_cache"]).is_relative_to(cache)
    assert not (cache / "xet").exists()   # the transfer cache is removed at the end


def test_the_disk_need_is_stated_before_downloading(tmp_path: Path, hub: FakeHub) -> None:
    download.download_all(tmp_path / "wiki")
    printed = hub.printed_before_first_download
    assert printed is not None and "peak" in printed and "left at the end" in printed and "free now" in printed
    parts = len(PARTS["part_aa"]) + len(PARTS["part_ab"])
    plan = download.disk_plan([len(p) for p in PARTS.values()], len(hub.gz))
    assert plan.index == plan.parts == parts
    assert plan.corpus == int(len(hub.gz) * download.CORPUS_GZ_RATIO)
    # parts + index while concatenating; index + .gz + corpus while unzipping; the larger one.
    assert plan.peak == max(2 * parts, parts + len(hub.gz) + plan.corpus)
    assert plan.final == parts + plan.corpus
    kept = download.disk_plan([len(p) for p in PARTS.values()], len(hub.gz), keep_downloads=True)
    assert kept.peak == kept.final == 2 * parts + len(hub.gz) + kept.corpus
    assert f"{plan.peak / 1e9:8.1f} GB" in printed


def test_a_rerun_downloads_nothing_once_complete(tmp_path: Path, hub: FakeHub) -> None:
    download.download_all(tmp_path / "wiki")
    calls, queries = len(hub.calls), hub.size_queries
    download.download_all(tmp_path / "wiki")   # parts and .gz are gone: the .complete records say why
    assert len(hub.calls) == calls and hub.size_queries == queries


def test_too_little_free_space_stops_before_any_download(
        tmp_path: Path, hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(download.shutil, "disk_usage", lambda _: usage._replace(free=1000))
    with pytest.raises(SystemExit, match="not enough free space"):
        download.download_all(tmp_path / "wiki")
    assert hub.calls == []


def test_keep_downloads_keeps_the_parts_and_the_gz(tmp_path: Path, hub: FakeHub) -> None:
    download.main(["--save_path", str(tmp_path / "wiki"), "--keep_downloads"])
    assert {"part_aa", "part_ab", "wiki-18.jsonl.gz"} <= {p.name for p in (tmp_path / "wiki").iterdir()}


def test_a_concatenation_that_does_not_verify_keeps_the_parts(
        tmp_path: Path, hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    def short_copy(dst, parts) -> None:   # a write that lost the last byte
        dst.write(b"".join(p.read_bytes() for p in parts)[:-1])

    monkeypatch.setattr(download, "_copy_into", short_copy)
    with pytest.raises(OSError, match="parts kept"):
        download.download_all(tmp_path / "wiki")
    folder = tmp_path / "wiki"
    assert (folder / "part_aa").exists() and (folder / "part_ab").exists()
    assert not (folder / "e5_Flat.index.complete").exists()


def test_a_corrupt_gz_raises_and_is_not_recorded(tmp_path: Path) -> None:
    data = gzip.compress(CORPUS_LINES)
    (tmp_path / "wiki-18.jsonl.gz").write_bytes(data[:-8] + b"\0" * 8)   # CRC and length trailer damaged
    with pytest.raises((OSError, EOFError)):
        gunzip(tmp_path / "wiki-18.jsonl.gz", tmp_path / "wiki-18.jsonl")
    assert not (tmp_path / "wiki-18.jsonl").exists() and not (tmp_path / "wiki-18.jsonl.complete").exists()
