"""One search world for the package (both modules): the BM25 server, the model warmed up to
search it and the question parquets of tests/trainer/test_search_e2e.py, built with the same
helpers once instead of once a module (the warm-up is the slow part on a 2-core machine)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.trainer.test_search_e2e import SearchWorld, serve_search_world


@pytest.fixture(scope="package")
def search_world(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SearchWorld]:
    with serve_search_world(tmp_path_factory.mktemp("search_world"), tiny_model_dir) as world:
        yield world
