"""The retrieval server, with its default limits, serves the original Search-R1 trainer's requests.

The original generation manager (search_r1/llm_agent/generation.py, `_batch_search`) sends all
of a turn's queries in one POST and reads `['result']`:

    requests.post(url, json={"queries": queries, "topk": 3, "return_scores": True}).json()['result']

With its GRPO recipe (train_batch_size=512, n_agent=5) that is up to 2,560 queries. The server
runs here as a user starts it (`python -m search_r1.search.retrieval_server`, BM25, no limit flags).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from search_r1.search.schema import ServerLimits
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
ORIGINAL_GRPO_TURN = 512 * 5   # the original's train_grpo.sh: data.train_batch_size x rollout.n_agent


@pytest.fixture(scope="module")
def default_server(bm25_index_dir: str, tiny_corpus_path: str) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "search_r1.search.retrieval_server", "--index_path", bm25_index_dir,
         "--corpus_path", tiny_corpus_path, "--retriever_name", "bm25", "--port", str(port)],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                if requests.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"retrieval server exited early: {proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.5)
        else:
            raise TimeoutError("retrieval server did not start within 120 s")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _turn_queries(n: int) -> list[str]:
    """Distinct queries of a realistic length (~60-90 characters), as a trained policy writes them."""
    subjects = ["Photosynthesis", "Glacier", "Lighthouse", "Honeybee", "Telescope"]
    return [f"who first described {subjects[i % 5].lower()} and in which year was it recorded, rollout {i}"
            for i in range(n)]


def test_one_post_of_the_original_grpo_turn_gets_every_answer(default_server: str) -> None:
    queries = _turn_queries(ORIGINAL_GRPO_TURN)
    result = requests.post(f"{default_server}/retrieve", json={"queries": queries, "topk": 3, "return_scores": True},
                           timeout=300).json()["result"]
    assert len(result) == ORIGINAL_GRPO_TURN
    assert all(len(hits) == 3 for hits in result)
    # The original reads each hit this way (_passages2string).
    assert all(isinstance(hit["document"]["contents"], str) and "score" in hit for hits in result for hit in hits)


def test_default_body_limit_fits_the_default_query_count_at_the_truncation_length() -> None:
    """Every query the server accepts may be as long as it is useful (the cut at max_query_chars)
    without the body limit refusing the request first."""
    limits = ServerLimits()
    assert limits.max_queries_per_request >= ORIGINAL_GRPO_TURN
    longest = ["q" * limits.max_query_chars] * limits.max_queries_per_request
    body = json.dumps({"queries": longest, "topk": limits.max_topk, "return_scores": True}).encode()
    assert len(body) <= limits.max_body_bytes


def test_a_deeply_nested_body_answers_400_and_the_server_keeps_serving(default_server: str) -> None:
    answer = requests.post(f"{default_server}/retrieve", data="[" * 100_000,
                           headers={"Content-Type": "application/json"}, timeout=60)
    assert answer.status_code == 400, answer.text
    assert "nested too deeply" in answer.json()["detail"]
    after = requests.post(f"{default_server}/retrieve", json={"queries": ["Glacier"], "topk": 1}, timeout=60)
    assert after.status_code == 200 and len(after.json()["result"]) == 1
