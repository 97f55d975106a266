"""index_builder: build with the original's CLI flags, then serve the result over HTTP."""

from __future__ import annotations

from pathlib import Path

import faiss
import numpy as np
import pytest
import requests

from search_r1.search.index_builder import build_index, index_file_name, main
from search_r1.search.retrieval_server import ServerConfig, create_app
from search_r1.search.retrievers import build_retriever
from search_r1.search.serving import serve_in_background
from tests.search.conftest import DISTINCT_TITLES, TINY_CORPUS_SIZE


def _ask(url: str, title: str) -> str:
    resp = requests.post(f"{url}/retrieve", json={"queries": [title], "topk": 3, "return_scores": True}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["result"][0][0]["document"]["id"]


def test_index_file_keeps_original_naming() -> None:
    assert index_file_name("e5", "Flat") == "e5_Flat.index"
    assert index_file_name("/models/bge-large-en/", "IVF4096,Flat") == "bge-large-en_IVF4096,Flat.index"


def test_bm25_cli_build_then_serve_round_trip(tmp_path: Path, tiny_corpus_path: str) -> None:
    main(["--retrieval_method", "bm25", "--corpus_path", tiny_corpus_path, "--save_dir", str(tmp_path)])
    index_dir = tmp_path / "bm25"
    assert index_dir.is_dir()
    retriever = build_retriever("bm25", str(index_dir), tiny_corpus_path)
    with serve_in_background(create_app(retriever, ServerConfig())) as url:
        for title, doc_id in DISTINCT_TITLES.items():
            assert _ask(url, title) == doc_id


def test_dense_hnsw_cli_build_then_serve_round_trip(tmp_path: Path, tiny_corpus_path: str, minilm_path: str) -> None:
    main([
        "--retrieval_method", "minilm", "--model_path", minilm_path, "--corpus_path", tiny_corpus_path,
        "--save_dir", str(tmp_path), "--faiss_type", "HNSW32", "--batch_size", "32", "--max_length", "128",
        "--save_embedding",
    ])  # fmt: skip
    index_path = tmp_path / "minilm_HNSW32.index"
    index = faiss.read_index(str(index_path))
    assert index.ntotal == TINY_CORPUS_SIZE and index.metric_type == faiss.METRIC_INNER_PRODUCT
    emb = np.load(tmp_path / "emb_minilm.npy")
    assert emb.shape == (TINY_CORPUS_SIZE, 384)
    # The norm of a normalised 384-dim fp32 row is 1 up to ~sqrt(384)*eps ~ 3e-6 on any CPU.
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
    retriever = build_retriever("minilm", str(index_path), tiny_corpus_path, retriever_model=minilm_path)
    with serve_in_background(create_app(retriever, ServerConfig())) as url:
        for title, doc_id in DISTINCT_TITLES.items():
            assert _ask(url, title) == doc_id


def test_trained_index_type_is_trained_and_embeddings_removed_by_default(
    tmp_path: Path, tiny_corpus_path: str, minilm_path: str, dense_index_path: str
) -> None:
    out = build_index(
        "minilm", tiny_corpus_path, str(tmp_path), model_path=minilm_path, faiss_type="IVF4,Flat", batch_size=32
    )
    index = faiss.read_index(str(out))
    assert out.name == "minilm_IVF4,Flat.index" and index.is_trained and index.ntotal == TINY_CORPUS_SIZE
    assert not (tmp_path / "emb_minilm.npy").exists()
    # IVF searched with every list probed must agree with the exact (Flat) index.
    flat = faiss.read_index(dense_index_path)
    query = np.ascontiguousarray(flat.reconstruct_n(0, 5))
    faiss.extract_index_ivf(index).nprobe = 4
    np.testing.assert_array_equal(index.search(query, 3)[1], flat.search(query, 3)[1])


def test_bad_faiss_type_is_named(tmp_path: Path, tiny_corpus_path: str, minilm_path: str) -> None:
    with pytest.raises(ValueError, match="--faiss_type 'NotAnIndex'"):
        build_index("minilm", tiny_corpus_path, str(tmp_path), model_path=minilm_path, faiss_type="NotAnIndex")
