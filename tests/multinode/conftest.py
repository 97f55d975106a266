"""One search world for the package (both modules): the BM25 server, the model warmed up to
search it and the question parquets of tests/trainer/test_search_e2e.py, built with the same
helpers once instead of once a module (the warm-up is the slow part on a 2-core machine)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.trainer._search_model import (
    build_bm25_retriever,
    warm_up_searching_model,
    write_corpus,
    write_question_parquets,
)
from tests.trainer.test_search_e2e import SearchWorld


@pytest.fixture(scope="package")
def search_world(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SearchWorld]:
    from search_r1.search.retrieval_server import create_app
    from search_r1.search.serving import serve_in_background

    root = tmp_path_factory.mktemp("search_world")
    retriever = build_bm25_retriever(write_corpus(root / "corpus.jsonl"), root / "index")
    model_dir = warm_up_searching_model(tiny_model_dir, retriever, root / "model", steps=200)
    data = write_question_parquets(root / "data")
    with serve_in_background(create_app(retriever)) as url:
        yield SearchWorld(server_url=url, model_dir=str(model_dir), data=data)
