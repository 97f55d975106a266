"""Fixtures for the generation-manager tests: a tokenizer and a real BM25 retrieval
server over HTTP (the project's own app, on a free port)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.bench.rollout import serve_bm25
from tests.llm_agent.helpers import CORPUS, with_template


@pytest.fixture(scope="session")
def tokenizer():
    from verl.utils.tiny_model import DEFAULT_TEXTS, train_bpe_tokenizer

    return train_bpe_tokenizer(list(DEFAULT_TEXTS) + [c["contents"] for c in CORPUS], vocab_size=700)


@pytest.fixture(scope="session")
def tool_tokenizer(tokenizer):
    """The tiny tokenizer with a chat template that renders tools and tool messages (Qwen2.5's shape)."""
    from verl.utils.tiny_model import TOOL_CHAT_TEMPLATE

    return with_template(tokenizer, TOOL_CHAT_TEMPLATE)


@pytest.fixture(scope="session")
def retrieval_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """POST /retrieve url of a real BM25 server (the project's app) on a free port, top-2."""
    folder: Path = tmp_path_factory.mktemp("bm25")
    with serve_bm25(CORPUS, folder, topk=2) as url:
        yield url
