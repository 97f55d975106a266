"""Corpus store, encoder and retrievers, called in-process."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from search_r1.search.corpus import Corpus, CorpusFormatError, default_arrow_path
from search_r1.search.encoders import BGE_QUERY_INSTRUCTION, detect_family, length_groups
from search_r1.search.retrievers import BM25Retriever, DenseRetriever
from search_r1.search.schema import Hit
from tests.search.conftest import DISTINCT_TITLES, TINY_CORPUS_SIZE, read_rows


def test_corpus_rows_match_jsonl_lines_in_any_order(tiny_corpus_path: str) -> None:
    corpus = Corpus.open(tiny_corpus_path)
    rows = read_rows(tiny_corpus_path)
    assert len(corpus) == TINY_CORPUS_SIZE
    docs = corpus.get([41, 3, 41, 0])
    assert [d.id for d in docs] == [rows[41]["id"], rows[3]["id"], rows[41]["id"], rows[0]["id"]]
    assert docs[1].contents == rows[3]["contents"]


def test_corpus_store_is_reused_until_the_jsonl_changes(tmp_path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text('{"id": "a", "contents": "\\"A\\"\\nfirst"}\n')
    assert len(Corpus.open(path, cache_dir=tmp_path / "cache")) == 1
    store = default_arrow_path(path, tmp_path / "cache")
    mtime = store.stat().st_mtime_ns
    assert len(Corpus.open(path, cache_dir=tmp_path / "cache")) == 1
    assert store.stat().st_mtime_ns == mtime
    path.write_text(path.read_text() + '\n{"id": "b", "contents": "\\"B\\"\\nsecond"}\n')
    corpus = Corpus.open(path, cache_dir=tmp_path / "cache")
    assert [d.id for d in corpus.get([0, 1])] == ["a", "b"]


def test_corpus_accepts_title_text_lines_and_missing_ids(tmp_path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"title": "Moon", "text": "It orbits."}) + "\n")
    doc = Corpus.open(path, cache_dir=tmp_path).get([0])[0]
    assert (doc.id, doc.contents) == ("0", '"Moon"\nIt orbits.')


@pytest.mark.parametrize(
    ("bad_line", "expected"),
    [
        ("{not json", "not valid JSON"),
        ('{"id": "1", "text": "no contents"}', "no 'contents' field"),
        ('["a", "list"]', "expected a JSON object"),
        ('{"id": "1", "contents": 5}', "'contents' must be a string"),
    ],
)
def test_corpus_format_errors_name_file_and_line(tmp_path, bad_line: str, expected: str) -> None:
    path = tmp_path / "broken.jsonl"
    good = json.dumps({"id": "0", "contents": '"T"\nbody'})
    path.write_text(f"{good}\n\n{good}\n{bad_line}\n{good}\n")
    with pytest.raises(CorpusFormatError, match=rf"broken\.jsonl:4: .*{expected}"):
        Corpus.open(path, cache_dir=tmp_path / "cache")
    # A failed conversion leaves no store behind that a later open would trust.
    assert not default_arrow_path(path, tmp_path / "cache").exists()


def test_corpus_rejects_rows_out_of_range(tiny_corpus_path: str) -> None:
    with pytest.raises(IndexError, match=f"row {TINY_CORPUS_SIZE} out of range"):
        Corpus.open(tiny_corpus_path).get([0, TINY_CORPUS_SIZE])


def test_hit_splits_quoted_title_from_body() -> None:
    hit = Hit.from_contents("7", '"Honeybee"\nBees make honey.\nSecond line.', 1.5)
    assert (hit.title, hit.text) == ("Honeybee", "Bees make honey.\nSecond line.")
    assert Hit.from_contents("8", "no title here", 0.0).title == ""
    assert Hit.from_wire(hit.to_wire(return_scores=True)) == hit
    assert Hit.from_wire(hit.to_wire(return_scores=False)).contents == hit.contents


def test_encoder_families_pick_pooling_and_prefixes() -> None:
    e5 = detect_family("intfloat/e5-base-v2")
    assert (e5.pooling, e5.query_prefix, e5.passage_prefix) == ("mean", "query: ", "passage: ")
    bge = detect_family("/models/encoder", hint="bge")
    assert (bge.pooling, bge.query_prefix) == ("cls", BGE_QUERY_INSTRUCTION)
    assert detect_family("sentence-transformers/all-MiniLM-L6-v2").pooling == "mean"


def test_encoder_returns_unit_float32_rows_independent_of_batching(minilm_encoder) -> None:
    texts = ["a lighthouse on the coast", "bees make honey", "x", "the moon has phases"]
    together = minilm_encoder.encode(texts, is_query=True, batch_size=4)
    one_by_one = minilm_encoder.encode(texts, is_query=True, batch_size=1)
    assert together.dtype == np.float32 and together.shape == (4, minilm_encoder.dim)
    # A normalised fp32 row has norm 1 up to ~sqrt(dim)*eps ~ 3e-6. Batched vs single rows change
    # only GEMM blocking and padding (masked): components (~0.05 each) move by ~1e-6 through the
    # 6 layers on any CPU; 1e-5 keeps a 10x margin, a pad token leaking into pooling moves them > 1e-2.
    np.testing.assert_allclose(np.linalg.norm(together, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(together, one_by_one, atol=1e-5)


def test_length_groups_cover_all_rows_in_order_within_the_batch_limit() -> None:
    lengths = sorted([7, 7, 8, 9, 9, 9, 12, 12, 20, 31, 31, 31, 31, 40])
    for overhead in (0.0, 24.0, 1e9):
        groups = length_groups(lengths, max_batch=4, overhead_tokens=overhead)
        assert groups[0][0] == 0 and groups[-1][1] == len(lengths)
        assert all(a[1] == b[0] for a, b in zip(groups, groups[1:], strict=False))
        assert all(0 < end - start <= 4 for start, end in groups)
    # Free calls: every distinct length alone (no padding at all), split at max_batch.
    free = length_groups(lengths, max_batch=4, overhead_tokens=0.0)
    assert all(len(set(lengths[s:e])) == 1 for s, e in free)
    # Costly calls: as few batches as max_batch allows, i.e. plain chunks of 4.
    assert length_groups(lengths, max_batch=4, overhead_tokens=1e9) == [(0, 4), (4, 8), (8, 12), (12, 14)]
    assert length_groups([], max_batch=4, overhead_tokens=24.0) == []


def test_length_grouped_encoding_matches_one_padded_batch(minilm_encoder, dense_retriever) -> None:
    """The encoder before length grouping padded all queries of a call to the longest one;
    embeddings and hits must not change."""
    queries = ["x", "bees make honey", "where is the lighthouse on the rocky northern coast of the grey sea",
               "glacier", "who built the first steam loom", "a telescope", "moon phases and the sunlit half"]
    with torch.inference_mode():
        inputs = minilm_encoder.tokenizer(queries, max_length=128, padding=True, truncation=True, return_tensors="pt")
        output = minilm_encoder.model(**inputs, return_dict=True)
        reference = torch.nn.functional.normalize(minilm_encoder._pool(output, inputs["attention_mask"]), dim=-1)
    grouped = minilm_encoder.encode(queries, is_query=True, batch_size=64)
    np.testing.assert_allclose(grouped, reference.numpy(), atol=1e-5)  # tolerance: see the test above
    _, rows_ref = dense_retriever.index.search(reference.numpy(), 5)
    _, rows_new = dense_retriever.index.search(grouped, 5)
    np.testing.assert_array_equal(rows_new, rows_ref)


def test_encoder_workers_split_batches_without_changing_vectors(minilm_path: str, minilm_encoder) -> None:
    from search_r1.search.encoders import Encoder

    two = Encoder(minilm_path, max_length=128, device="cpu", workers=2)
    texts = [f"passage about town {i} on the river" for i in range(9)] + ["x", "bees make honey in a hive"]
    np.testing.assert_allclose(two.encode(texts, batch_size=4), minilm_encoder.encode(texts, batch_size=4), atol=1e-5)
    with pytest.raises(ValueError, match="workers"):
        Encoder(minilm_path, device="cpu", workers=0)


@pytest.mark.parametrize("retriever_fixture", ["bm25_retriever", "dense_retriever"])
def test_query_naming_a_title_returns_that_passage_first(request, retriever_fixture: str) -> None:
    retriever = request.getfixturevalue(retriever_fixture)
    titles = list(DISTINCT_TITLES)
    results = retriever.search_batch(titles, topk=4)
    assert len(results) == len(titles)
    for title, hits in zip(titles, results, strict=True):
        assert len(hits) == 4
        assert hits[0].doc_id == DISTINCT_TITLES[title], (title, [h.title for h in hits])
        assert hits[0].title == title
        assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)


@pytest.mark.parametrize("retriever_fixture", ["bm25_retriever", "dense_retriever"])
def test_topk_larger_than_corpus_returns_whole_corpus(request, retriever_fixture: str) -> None:
    retriever = request.getfixturevalue(retriever_fixture)
    hits = retriever.search("Glacier", topk=TINY_CORPUS_SIZE + 10)
    assert len(hits) == TINY_CORPUS_SIZE
    assert len({h.doc_id for h in hits}) == TINY_CORPUS_SIZE


def test_torch_flat_search_matches_faiss_across_blocks() -> None:
    import faiss

    from search_r1.search.retrievers import TorchFlatIP

    rng = np.random.default_rng(0)
    xb = rng.standard_normal((1000, 16)).astype(np.float32)
    index = faiss.IndexFlatIP(16)
    index.add(xb)
    queries = rng.standard_normal((7, 16)).astype(np.float32)
    want_scores, want_rows = index.search(queries, 10)
    for block_rows in (1000, 333, 7):
        scores, rows = TorchFlatIP(index, block_rows=block_rows).search(queries, 10)
        np.testing.assert_array_equal(rows, want_rows)
        # 16-term fp32 dot products (top scores ~5-10) summed in another order than faiss's BLAS:
        # <= 16*eps*sum|x_i*y_i| ~ 2e-6 relative here; rtol 1e-5 holds on any CPU.
        np.testing.assert_allclose(scores, want_scores, rtol=1e-5)
    assert TorchFlatIP(index, block_rows=300).search(queries[:1], 1000)[1].shape == (1, 1000)


def test_bm25_query_with_no_known_words_still_answers(bm25_retriever) -> None:
    hits = bm25_retriever.search_batch(["zzqx", "the of and"], topk=2)
    assert [len(h) for h in hits] == [2, 2]


def test_index_built_from_another_corpus_is_refused(tmp_path, dense_index_path, bm25_index_dir, minilm_encoder) -> None:
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"id": "0", "contents": '"A"\nb'}) + "\n")
    corpus = Corpus.open(other, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="holds 60 vectors but corpus .*other.jsonl has 1"):
        DenseRetriever(dense_index_path, corpus, minilm_encoder)
    with pytest.raises(ValueError, match="covers 60 passages but corpus .*other.jsonl has 1"):
        BM25Retriever(bm25_index_dir, corpus)


def test_lucene_index_without_pyserini_says_how_to_fix(tmp_path, tiny_corpus_path) -> None:
    lucene_dir = tmp_path / "lucene"
    lucene_dir.mkdir()
    (lucene_dir / "segments_1").write_bytes(b"")
    try:
        import pyserini  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="needs pyserini"):
            BM25Retriever(str(lucene_dir), Corpus.open(tiny_corpus_path))
    else:
        with pytest.raises(Exception):  # noqa: B017 -- an empty folder is not a usable index
            BM25Retriever(str(lucene_dir), Corpus.open(tiny_corpus_path))
