"""The LLM judge against a hostile or broken endpoint (issue 42): a reply that drips, a reply too
large, a reply nested too deep or not decodable, a reply whose verdict is not in the asked format,
an error body that echoes the key; and a graded answer too long to send whole.

A scripted server on 127.0.0.1 picks its behaviour from the question (read from the request's data
blocks); each bad item is judged next to a good one: a hostile reply fails its own row, counted,
never the batch.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import tracemalloc
from collections.abc import Iterator

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tests.conftest import serving
from tests.trainer._judge_requests import prompt_fields
from verl.utils.reward_score import llm_judge
from verl.utils.reward_score.llm_judge import JudgeConfig, JudgeFailureBoundExceeded, LLMJudge

KEY = "sk-Zq8Rt2Lm5Vx9Np3Hc7Jd1Fw6Ks4Gb0Ya"     # 35 characters
DRIP_BYTES, DRIP_EVERY_S = 30, 0.3                # a 9 s reply, one byte at a time
HUGE_BYTES, HUGE_CHUNK = 50 * 2**20, 64 * 2**10   # a 50 MiB reply in 64 KiB chunks
# replies whose verdict is not a final-line yes/no (the first three are issue 42's examples)
REPLIES = {
    "reply-not-correct": "Not correct.",
    "reply-not-true": "That is not true.",
    "reply-think": "<think>Is the answer correct? Yes, it might be.</think> no",
    "reply-unclosed-think": "<think>The answer is correct, so yes",
    "reply-verdict-then-more": "yes\nbut the answer names a different city",
    "reply-last-line": "The answer names the same city.\nYes",
}


def _completion(text: str) -> dict:
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]}


def _question(messages: list[dict[str, str]]) -> str:
    try:
        return prompt_fields(messages)["question"]
    except (AssertionError, AttributeError):   # the request before issue 42, to run these tests against it
        return re.search(r"^Question: (.*)$", messages[-1]["content"], re.M).group(1)


class Sent:
    prompts: dict[str, list[dict[str, str]]] = {}


@pytest.fixture(scope="module")
def hostile_server() -> Iterator[str]:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await request.json()
        question = _question(body["messages"])
        Sent.prompts[question] = body["messages"]
        ok = json.dumps(_completion("yes"))
        if question == "drip":
            async def drip():
                for _ in range(DRIP_BYTES):       # leading whitespace: the reply is valid JSON once complete
                    yield b" "
                    await asyncio.sleep(DRIP_EVERY_S)
                yield ok.encode()
            return StreamingResponse(drip(), media_type="application/json")
        if question == "huge":
            async def huge():
                chunk = b" " * HUGE_CHUNK
                for _ in range(HUGE_BYTES // HUGE_CHUNK):
                    yield chunk
                yield ok.encode()
            return StreamingResponse(huge(), media_type="application/json")
        if question == "huge-declared":      # 2 MiB with a Content-Length: refused before it is read
            return Response(content=b" " * 2**21 + ok.encode(), media_type="application/json")
        if question == "deep-json":
            return Response(content=b"[" * 100_000 + b"]" * 100_000, media_type="application/json")
        if question == "gzip-garbage":
            return Response(content=b"\x1f\x8b\x08\x00" + b"not gzip at all" * 20, media_type="application/json",
                            headers={"content-encoding": "gzip"})
        if question == "echo-key":           # a 401 body that echoes the key across its 200th character
            return JSONResponse(status_code=401, content={
                "error": "x" * 150 + f" invalid credentials {request.headers.get('authorization')}"})
        return JSONResponse(content=_completion(REPLIES.get(question, "Yes.")))

    with serving(app) as base:
        yield f"{base}/v1"


def _judge(url: str, **kwargs) -> LLMJudge:
    settings = {"url": url, "model": "scripted", "max_retries": 0, "timeout": 30.0}
    settings.update(kwargs)
    return LLMJudge(JudgeConfig(**settings))


def test_a_dripping_reply_is_cut_at_the_wall_clock_deadline(hostile_server):
    # each byte comes within the per-read timeout, so only a deadline on the whole request stops it
    judge = _judge(hostile_server, timeout=1.0, max_retries=1, backoff_factor=0.01)
    start = time.monotonic()
    assert judge.judge([("drip", "a", "a"), ("ok", "a", "a")]) == [None, True]
    seconds = time.monotonic() - start
    assert seconds < 6.0, seconds                  # two 1 s attempts; the drip alone lasts 9 s
    (error,) = judge.last_stats.errors
    assert "timeout: no complete reply within 1.0s" in error and "after 1 retries" in error
    assert judge.last_stats.calls == 3 and judge.last_stats.malformed == 0   # a deadline is retried


def test_a_huge_reply_is_refused_at_the_byte_cap_without_reading_it(hostile_server):
    cap = 256 * 2**10
    judge = _judge(hostile_server, max_reply_bytes=cap)
    tracemalloc.start()
    try:
        verdicts = judge.judge([("huge", "a", "a"), ("ok", "a", "a")])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert verdicts == [None, True]
    assert f"reply refused past max_reply_bytes={cap}" in judge.last_stats.errors[0]
    assert judge.last_stats.malformed == 1 and judge.last_stats.calls == 2       # not retried
    # the client held about the cap (plus a chunk), not the 50 MiB (reading it all: a peak of 100+ MiB)
    assert peak < 16 * 2**20, peak
    declared = _judge(hostile_server)                 # default cap 1 MiB; Content-Length says 2 MiB
    assert declared.judge([("huge-declared", "a", "a")]) == [None]
    assert "more than max_reply_bytes=1048576" in declared.last_stats.errors[0]


def test_a_too_deep_or_undecodable_reply_fails_its_row_not_the_batch(hostile_server):
    judge = _judge(hostile_server)
    assert judge.judge([("deep-json", "a", "a"), ("gzip-garbage", "a", "a"), ("ok", "a", "a")]) == [None, None, True]
    errors = judge.last_stats.errors
    assert any("malformed chat completion (RecursionError)" in e for e in errors), errors
    assert any("compressed reply refused (Content-Encoding: 'gzip'" in e for e in errors), errors
    assert judge.last_stats.failures == 2 and judge.last_stats.malformed == 2
    # the run's failure bound still applies to such failures
    with pytest.raises(JudgeFailureBoundExceeded, match=r"2 of 3 judge calls failed"):
        judge.check_failure_bound(2, 3)


def test_an_unexpected_error_fails_its_row_not_the_batch(hostile_server, monkeypatch):
    real = llm_judge.parse_verdict

    def parse(text):
        if text == "Not correct.":
            raise ZeroDivisionError("a bug met by one reply")
        return real(text)

    monkeypatch.setattr(llm_judge, "parse_verdict", parse)
    judge = _judge(hostile_server)
    assert judge.judge([("reply-not-correct", "a", "a"), ("ok", "a", "a")]) == [None, True]
    assert judge.last_stats.errors == ["unexpected ZeroDivisionError: a bug met by one reply"]
    assert judge.last_stats.failures == 1 and judge.last_stats.malformed == 0


def test_only_a_final_line_yes_or_no_is_a_verdict_anything_else_is_a_counted_malformed_reply(hostile_server):
    judge = _judge(hostile_server)
    questions = list(REPLIES)
    verdicts = judge.judge([(q, "Paris", "Paris") for q in questions])
    assert dict(zip(questions, verdicts, strict=True)) == {
        "reply-not-correct": None, "reply-not-true": None, "reply-think": False,
        "reply-unclosed-think": None, "reply-verdict-then-more": None, "reply-last-line": True}
    stats = judge.last_stats
    assert stats.failures == stats.malformed == 4 and stats.calls == len(questions)   # never retried
    assert stats.metrics()["reward/judge_malformed_replies"] == 4
    assert any("no yes/no verdict on the last line of the judge's reply 'Not correct.'" in e for e in stats.errors)
    assert not any(key[0] == "reply-not-correct" for key in judge.cache)            # never cached


def test_a_key_echoed_past_the_excerpt_length_is_redacted_whole(hostile_server, monkeypatch):
    monkeypatch.setenv("JUDGE_HOSTILE_KEY", KEY)
    judge = _judge(hostile_server, api_key_env="JUDGE_HOSTILE_KEY", max_failure_fraction=0.0)
    assert judge.judge([("echo-key", "a", "a")]) == [None]
    (error,) = judge.last_stats.errors
    assert "HTTP 401" in error and "invalid credentials Bearer ***" in error
    with pytest.raises(JudgeFailureBoundExceeded) as raised:
        judge.check_failure_bound(1, 1)
    for text in (error, str(raised.value)):
        leaked = [KEY[i:i + 6] for i in range(len(KEY) - 5) if KEY[i:i + 6] in text]
        assert not leaked, (leaked, text)


def test_a_long_answer_is_cut_to_max_answer_chars_and_counted(hostile_server):
    judge = _judge(hostile_server, max_answer_chars=100)
    answer = "Paris " + "blah " * 4000
    assert judge.judge([("long-answer", answer, "Paris"), ("short-answer", "Paris", "Paris")]) == [True, True]
    sent = prompt_fields(Sent.prompts["long-answer"])["answer"]
    assert sent == answer[:100] + f" [{len(answer) - 100} more characters cut]"
    assert prompt_fields(Sent.prompts["short-answer"])["answer"] == "Paris"
    assert sum(len(m["content"]) for m in Sent.prompts["long-answer"]) < 2000
    assert judge.last_stats.answers_cut == 1 and judge.last_stats.metrics()["reward/judge_answers_cut"] == 1
