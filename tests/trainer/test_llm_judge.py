"""LLM judge against a scripted OpenAI-compatible server: verdicts, cache, retries, timeouts,
malformed replies, bounded concurrency, and the reward manager's failure policy.

The scripted server reads its behaviour from the question: "fail500:N" answers HTTP 500 the first
N times, "always500", "slow" sleeps past the client's timeout, "malformed" answers JSON without
`choices`, "maybe" answers without a verdict, "bad400" answers 400; otherwise it says "Yes." when
the answer occurs in the reference, else "no". It reads the three texts from the request's
nonce-tagged data blocks (`prompt_fields`). The real-model test is
tests/trainer/test_llm_judge_vllm.py; hostile replies are tests/trainer/test_llm_judge_hostile.py,
hostile answers tests/trainer/test_llm_judge_injection.py.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tests.conftest import serving
from tests.trainer._judge_requests import prompt_fields
from tests.trainer.test_reward import _batch, _row
from verl.trainer.main_ppo import compose_config
from verl.utils.reward_score.llm_judge import (
    JudgeConfig,
    JudgeFailureBoundExceeded,
    LLMJudge,
    chat_completions_url,
    parse_verdict,
)
from verl.utils.tiny_model import train_bpe_tokenizer
from verl.workers.reward_manager import build_reward_managers


class Script:
    def __init__(self) -> None:
        self.requests: Counter[str] = Counter()
        self.in_flight = 0
        self.max_in_flight = 0
        self.delay = 0.0


@pytest.fixture(scope="module")
def judge_server() -> Iterator[tuple[str, Script]]:
    app = FastAPI()
    script = Script()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        body = await request.json()
        fields = prompt_fields(body["messages"])
        question, answer, reference = fields["question"], fields["answer"], fields["reference"]
        script.requests[question] += 1
        counted = question.startswith("q-conc")     # earlier tests' timed-out requests may still run
        script.in_flight += counted
        script.max_in_flight = max(script.max_in_flight, script.in_flight)
        try:
            await asyncio.sleep(script.delay)
            if question.startswith("auth") and request.headers.get("authorization") != "Bearer s3cret-key":
                # echoes the header it got, as some gateways do: the client must not log it
                return JSONResponse(status_code=401, content={"error": f"bad key {request.headers.get('authorization')}"})
            if question.startswith("fail500:") and script.requests[question] <= int(question.split(":")[1]):
                return JSONResponse(status_code=500, content={"error": "judge overloaded"})
            if question == "always500":
                return JSONResponse(status_code=500, content={"error": "judge down"})
            if question == "bad400":
                return JSONResponse(status_code=400, content={"error": "bad request"})
            if question == "slow":
                await asyncio.sleep(2.0)
            if question == "malformed":
                return JSONResponse(content={"id": "x", "object": "chat.completion"})
            text = "maybe" if question == "maybe" else ("Yes." if answer.lower() in reference.lower() else "no")
            return JSONResponse(content={"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}],
                                         "model": body["model"]})
        finally:
            script.in_flight -= counted

    with serving(app) as base:
        yield f"{base}/v1", script


def _judge(url: str, **kwargs) -> LLMJudge:
    settings = {"url": url, "model": "scripted", "max_retries": 2, "backoff_factor": 0.01, "timeout": 5.0}
    settings.update(kwargs)
    return LLMJudge(JudgeConfig(**settings))


def test_parse_verdict_and_url():
    assert parse_verdict("Yes.") is True and parse_verdict("  no") is False and parse_verdict("**No**") is False
    assert parse_verdict("The answer means the same.\nyes") is True    # the last line is the verdict
    assert parse_verdict("maybe") is None and parse_verdict("") is None and parse_verdict(None) is None
    assert parse_verdict("yesterday") is None
    for url in ("http://h:1", "http://h:1/v1", "http://h:1/v1/", "http://h:1/v1/chat/completions"):
        assert chat_completions_url(url) == "http://h:1/v1/chat/completions"


def test_config_errors_name_the_key():
    def from_cfg(**node):
        return JudgeConfig.from_config(node)

    assert from_cfg(url=None, model="m") is None
    with pytest.raises(ValueError, match=r"reward_model.judge.model must name"):
        from_cfg(url="http://x")
    with pytest.raises(ValueError, match=r"reward_model.judge.prompt_template must contain \{reference\}"):
        from_cfg(url="http://x", model="m", prompt_template="{question} {answer}")
    with pytest.raises(ValueError, match=r"reward_model.judge.prompt_template: only"):
        from_cfg(url="http://x", model="m", prompt_template="{question} {answer} {reference} {other}")
    with pytest.raises(ValueError, match=r"reward_model.judge.max_failure_fraction=2.0 must be in"):
        from_cfg(url="http://x", model="m", max_failure_fraction=2.0)
    with pytest.raises(ValueError, match=r"reward_model.judge.max_concurrency=0"):
        from_cfg(url="http://x", model="m", max_concurrency=0)
    with pytest.raises(ValueError, match=r"reward_model.judge.max_answer_chars=0 must be >= 1"):
        from_cfg(url="http://x", model="m", max_answer_chars=0)
    with pytest.raises(ValueError, match=r"reward_model.judge.max_reply_bytes=10 must be >= 1024"):
        from_cfg(url="http://x", model="m", max_reply_bytes=10)
    cfg = from_cfg(url="http://x", model="m", max_answer_chars=50, max_reply_bytes=4096)
    assert (cfg.max_answer_chars, cfg.max_reply_bytes) == (50, 4096)


def test_the_api_key_comes_from_the_named_variable_as_a_bearer_and_is_never_shown(judge_server, monkeypatch):
    url, _ = judge_server
    monkeypatch.delenv("JUDGE_TEST_KEY", raising=False)
    with pytest.raises(ValueError, match=r"reward_model.judge.api_key_env='JUDGE_TEST_KEY': that environment "
                                         r"variable is not set"):
        JudgeConfig.from_config({"url": url, "model": "m", "api_key_env": "JUDGE_TEST_KEY"})
    monkeypatch.setenv("JUDGE_TEST_KEY", "s3cret-key")
    judge = _judge(url, api_key_env="JUDGE_TEST_KEY")
    assert judge.judge([("auth-1", "Paris", "Paris")]) == [True]
    monkeypatch.setenv("JUDGE_TEST_KEY", "wrong-s3cret")
    wrong = _judge(url, api_key_env="JUDGE_TEST_KEY")
    assert wrong.judge([("auth-2", "Paris", "Paris")]) == [None]    # 401: a failure, not a verdict
    (error,) = wrong.last_stats.errors
    assert "HTTP 401" in error and "wrong-s3cret" not in error and "Bearer ***" in error
    assert _judge(url).judge([("auth-3", "Paris", "Paris")]) == [None]   # no key: refused by the server


def test_verdicts_cache_in_memory_and_on_disk(judge_server, tmp_path: Path):
    url, script = judge_server
    cache = tmp_path / "judge_cache.jsonl"
    judge = _judge(url, cache=str(cache))
    items = [("q-cache-1", "Paris", "Paris, France"), ("q-cache-2", "Lyon", "Paris"), ("q-cache-1", "Paris", "Paris, France")]
    assert judge.judge(items) == [True, False, True]
    assert script.requests["q-cache-1"] == 1           # a duplicate inside a batch is asked once
    stats = judge.last_stats.metrics()
    assert stats["reward/judge_calls"] == 2 and stats["reward/judge_cache_hits"] == 1
    assert stats["reward/judge_failures"] == 0 and stats["reward/judge_items_per_s"] > 0
    assert judge.judge(items[:2]) == [True, False]
    assert judge.last_stats.calls == 0 and judge.last_stats.metrics()["reward/judge_cache_hit_rate"] == 1.0
    rows = [json.loads(line) for line in cache.read_text().splitlines()]
    assert {(r["question"], r["verdict"]) for r in rows} == {("q-cache-1", True), ("q-cache-2", False)}
    fresh = _judge(url, cache=str(cache))               # a new run reads the cache back
    assert fresh.judge(items[:2]) == [True, False] and fresh.last_stats.calls == 0
    assert script.requests["q-cache-1"] == 1 and script.requests["q-cache-2"] == 1


def test_retries_then_success_and_persistent_5xx_is_a_counted_failure(judge_server):
    url, script = judge_server
    judge = _judge(url, max_retries=2)
    assert judge.judge([("fail500:2", "a", "a")]) == [True]          # two 500s, then the verdict
    assert script.requests["fail500:2"] == 3 and judge.last_stats.calls == 3
    assert judge.judge([("always500", "a", "a")]) == [None]
    assert script.requests["always500"] == 3 and judge.last_stats.failures == 1
    assert "HTTP 500 (after 2 retries)" in judge.last_stats.errors[0]
    assert ("always500", "a", "a") not in judge.cache                 # a failure is never cached


def test_timeout_malformed_and_no_verdict_fail_without_scoring(judge_server):
    url, script = judge_server
    judge = _judge(url, timeout=0.3, max_retries=1)
    verdicts = judge.judge([("slow", "a", "a"), ("malformed", "a", "a"), ("maybe", "a", "a"),
                            ("bad400", "a", "a"), ("q-ok", "a", "a")])
    assert verdicts == [None, None, None, None, True]
    errors = " | ".join(judge.last_stats.errors)
    assert "timeout: no complete reply within 0.3s" in errors and "malformed chat completion" in errors
    assert "no yes/no verdict on the last line of the judge's reply 'maybe'" in errors and "HTTP 400" in errors
    assert judge.last_stats.malformed == 2 and judge.last_stats.metrics()["reward/judge_malformed_replies"] == 2
    # timeouts are retried: the client sent "slow" twice and each other item once (counted client-side,
    # since under load a timed-out retry may never reach the server's handler within the 0.3 s)
    assert judge.last_stats.calls == 2 + 4 and script.requests["slow"] >= 1
    assert script.requests["malformed"] == 1 and script.requests["maybe"] == 1 and script.requests["bad400"] == 1


def test_concurrency_is_bounded(judge_server):
    url, script = judge_server
    script.max_in_flight, script.delay = 0, 0.15
    try:
        judge = _judge(url, max_concurrency=2)
        assert judge.judge([(f"q-conc-{i}", "a", "a") for i in range(6)]) == [True] * 6
    finally:
        script.delay = 0.0
    assert script.max_in_flight == 2


# ---------------------------------------------------------------- through the reward manager
@pytest.fixture(scope="module")
def tok():
    return train_bpe_tokenizer()


def _judge_batch(tok, questions: list[str], answers: list[str], golds: list[list[str]]):
    rows = [_row(tok, [(f"<answer> {a} </answer>", True)]) for a in answers]
    data = _batch(tok, rows, ["nq"] * len(rows), golds)
    data.non_tensor_batch["extra_info"] = np.array([{"question": q} for q in questions], dtype=object)
    return data


def _managers(tok, url: str, *extra: str):
    return build_reward_managers(compose_config([
        "reward_model.metric=judge", f"reward_model.judge.url={url}", "reward_model.judge.model=scripted",
        "reward_model.judge.max_retries=0", *extra]), tok)


def test_judge_reward_exact_matches_skip_the_call_and_failures_fall_back_to_em(judge_server, tok):
    url, script = judge_server
    train, val = _managers(tok, url, "reward_model.judge.max_failure_fraction=0.5")
    # rows: exact match (no call), judged correct (the scripted judge: answer within the reference),
    # judged wrong, a failed call (falls back to EM = 0, counted)
    data = _judge_batch(tok, ["q-m-exact", "q-m-right", "q-m-wrong", "always500"],
                        ["Paris", "Obama", "Lyon", "Rome"], [["Paris"], ["Barack Obama"], ["Paris"], ["Italy"]])
    scores = train(data).sum(-1).tolist()
    assert scores == [1.0, 1.0, 0.0, 0.0]
    assert script.requests["q-m-exact"] == 0
    metrics = train.last_metrics
    assert metrics["reward/judge_items"] == 3 and metrics["reward/judge_failures"] == 1
    assert metrics["reward/judge_fallback_rows"] == 1
    # validation: EM score, plus per-row judge verdicts (none for the failed row) and F1
    assert val(data).sum(-1).tolist() == [1.0, 0.0, 0.0, 0.0]
    assert [r.get("judge") for r in val.last_row_metrics] == [1.0, 1.0, 0.0, None]
    assert val.last_metrics["reward/judge_cache_hits"] == 2      # the judge (and its cache) is shared


def test_judge_failures_past_the_bound_stop_the_run_naming_the_key(judge_server, tok):
    url, _ = judge_server
    train, _ = _managers(tok, url, "reward_model.judge.max_failure_fraction=0.2")
    data = _judge_batch(tok, ["always500", "q-b-ok"], ["Rome", "Obama"], [["Italy"], ["Barack Obama"]])
    with pytest.raises(JudgeFailureBoundExceeded,
                       match=r"1 of 2 judge calls failed \(50.0%\), more than reward_model.judge.max_failure_fraction=0.2"):
        train(data)


def test_question_falls_back_to_the_decoded_prompt(judge_server, tok):
    url, script = judge_server
    train, _ = _managers(tok, url)
    rows = [_row(tok, [("<answer> Lyon </answer>", True)])]
    data = _batch(tok, rows, ["nq"], [["Paris"]], prompt="q-prompt-fallback")
    assert train(data).sum().item() == 0.0
    assert any("q-prompt-fallback" in q for q in script.requests)
