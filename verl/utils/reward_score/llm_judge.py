"""An LLM judge over any OpenAI-compatible chat endpoint (`reward_model.judge.*`).

`LLMJudge.judge(items)` asks the endpoint's `/v1/chat/completions` whether each (question,
answer, reference) is correct: one request per item (judge_prompt.py: a system message with the
instructions, the three texts in nonce-tagged data blocks of the user message built from
`prompt_template`, the answer cut to `max_answer_chars`), at most `max_concurrency` requests in
flight on one `httpx.AsyncClient`. Each request has a wall-clock deadline of `timeout` seconds for
the whole exchange (connect, send, every byte of the reply), and its reply is read as a stream and
refused past `max_reply_bytes`. Connection errors, deadlines, 429 and 5xx answers are retried with
exponential backoff (`backoff_factor * 2**(retry - 1)` s) up to `max_retries` times; a 4xx or a
malformed reply (not JSON, too deep or too large, undecodable, no chat completion, or no verdict
line in the format the prompt asks for) is not retried. Verdicts are cached by (question, answer,
reference): in memory, and appended to the jsonl file `cache` (read back at start) when set.

A failed item is never a verdict, and never an exception out of `judge`: `judge` returns None for
it and counts it (`reward/judge_failures`, malformed replies also in
`reward/judge_malformed_replies`); the reward manager decides what the row scores (EM, counted)
and `check_failure_bound` stops the run when a batch's failures exceed `max_failure_fraction`.
Error texts are redacted (the endpoint's key removed) before they are cut or stored.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from search_r1.llm_agent.tool_results import redact
from verl.utils.reward_score.judge_prompt import (
    DEFAULT_PROMPT_TEMPLATE,
    check_template,
    judge_messages,
    parse_verdict,
)

__all__ = ["DEFAULT_PROMPT_TEMPLATE", "JudgeConfig", "JudgeError", "JudgeFailureBoundExceeded", "JudgeStats",
           "LLMJudge", "chat_completions_url", "parse_verdict"]

RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})
ERROR_EXCERPT_CHARS = 200

JudgeItem = tuple[str, str, str]   # (question, answer, reference)


class JudgeError(RuntimeError):
    """One judge call failed for good (after its retries)."""


class MalformedReply(JudgeError):
    """The endpoint answered 200 with something that is not a verdict; never retried."""


class _Retryable(Exception):
    """One attempt failed in a way another attempt may not (deadline, connection, 429/5xx)."""


class JudgeFailureBoundExceeded(RuntimeError):
    """More of a batch's judge calls failed than reward_model.judge.max_failure_fraction allows."""


def chat_completions_url(url: str) -> str:
    """`.../v1/chat/completions` from a server root, a `/v1` base or the full endpoint."""
    url = url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    if url.endswith("/v1"):
        return url + "/chat/completions"
    return url + "/v1/chat/completions"


@dataclass(frozen=True)
class JudgeConfig:
    """`reward_model.judge` in ppo_trainer.yaml."""

    url: str
    model: str
    prompt_template: str = DEFAULT_PROMPT_TEMPLATE
    max_concurrency: int = 16
    timeout: float = 60.0
    max_retries: int = 3
    backoff_factor: float = 0.5
    max_tokens: int = 16
    cache: str | None = None
    max_failure_fraction: float = 0.05
    api_key_env: str | None = None   # the environment variable holding the endpoint's key (Bearer); never logged
    max_answer_chars: int = 2000     # the graded answer is cut to this many characters (the block says so)
    max_reply_bytes: int = 1 << 20   # a reply past this many (decoded) bytes is refused while it streams

    @classmethod
    def from_config(cls, node: Any, prefix: str = "reward_model.judge") -> JudgeConfig | None:
        """The judge's settings, or None when `url` is null; ValueError naming the bad key."""
        if node is None or node.get("url") in (None, ""):
            return None
        get = node.get
        if not get("model"):
            raise ValueError(f"{prefix}.model must name the served model when {prefix}.url is set")
        template = get("prompt_template") or DEFAULT_PROMPT_TEMPLATE
        check_template(str(template), f"{prefix}.prompt_template")
        cfg = cls(url=str(get("url")), model=str(get("model")), prompt_template=str(template),
                  max_concurrency=int(get("max_concurrency", 16)), timeout=float(get("timeout", 60)),
                  max_retries=int(get("max_retries", 3)), backoff_factor=float(get("backoff_factor", 0.5)),
                  max_tokens=int(get("max_tokens", 16)),
                  cache=str(get("cache")) if get("cache") else None,
                  max_failure_fraction=float(get("max_failure_fraction", 0.05)),
                  api_key_env=str(get("api_key_env")) if get("api_key_env") else None,
                  max_answer_chars=int(get("max_answer_chars", 2000)),
                  max_reply_bytes=int(get("max_reply_bytes", 1 << 20)))
        if cfg.max_concurrency < 1:
            raise ValueError(f"{prefix}.max_concurrency={cfg.max_concurrency} must be >= 1")
        if cfg.timeout <= 0:
            raise ValueError(f"{prefix}.timeout={cfg.timeout} must be > 0")
        if cfg.max_retries < 0:
            raise ValueError(f"{prefix}.max_retries={cfg.max_retries} must be >= 0")
        if cfg.max_answer_chars < 1:
            raise ValueError(f"{prefix}.max_answer_chars={cfg.max_answer_chars} must be >= 1")
        if cfg.max_reply_bytes < 1024:
            raise ValueError(f"{prefix}.max_reply_bytes={cfg.max_reply_bytes} must be >= 1024")
        if not 0.0 <= cfg.max_failure_fraction <= 1.0:
            raise ValueError(f"{prefix}.max_failure_fraction={cfg.max_failure_fraction} must be in [0, 1]")
        cfg.api_key(prefix)   # a named variable that is not set fails at start-up
        return cfg

    def api_key(self, prefix: str = "reward_model.judge") -> str | None:
        """The key from the environment variable `api_key_env` names (None when it names none)."""
        if self.api_key_env is None:
            return None
        key = os.environ.get(self.api_key_env)
        if not key:
            raise ValueError(f"{prefix}.api_key_env={self.api_key_env!r}: that environment variable is not set "
                             "(export it with the judge endpoint's key)")
        return key


@dataclass
class JudgeStats:
    """Counters of one `judge` call (and running totals on the judge)."""

    items: int = 0
    calls: int = 0          # HTTP requests sent, retries included
    cache_hits: int = 0
    failures: int = 0
    malformed: int = 0      # replies that were no verdict (a subset of failures)
    answers_cut: int = 0    # answers longer than max_answer_chars, sent cut
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        judged = self.items - self.cache_hits
        return {
            "reward/judge_items": float(self.items),
            "reward/judge_calls": float(self.calls),
            "reward/judge_cache_hits": float(self.cache_hits),
            "reward/judge_cache_hit_rate": self.cache_hits / self.items if self.items else 0.0,
            "reward/judge_failures": float(self.failures),
            "reward/judge_malformed_replies": float(self.malformed),
            "reward/judge_answers_cut": float(self.answers_cut),
            "reward/judge_items_per_s": judged / self.seconds if self.seconds > 0 else 0.0,
        }


class LLMJudge:
    """Batched, cached, retried yes/no judgements from an OpenAI-compatible chat endpoint."""

    def __init__(self, config: JudgeConfig) -> None:
        self.config = config
        self.endpoint = chat_completions_url(config.url)
        self._key = config.api_key()
        self.cache: dict[JudgeItem, bool] = {}
        self.last_stats = JudgeStats()
        self.total = JudgeStats()
        if config.cache and Path(config.cache).is_file():
            self._load_cache(Path(config.cache))

    def _load_cache(self, path: Path) -> None:
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                self.cache[(row["question"], row["answer"], row["reference"])] = bool(row["verdict"])
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"reward_model.judge.cache {path}: line {number} is not a verdict row: {exc!r}") from exc

    def judge(self, items: list[JudgeItem]) -> list[bool | None]:
        """A verdict per item (True: correct), None where the call failed after its retries."""
        stats = JudgeStats(items=len(items))
        verdicts: dict[JudgeItem, bool | None] = {}
        todo: list[JudgeItem] = []
        for item in items:
            if item in self.cache:
                stats.cache_hits += 1
                verdicts[item] = self.cache[item]
            elif item not in verdicts:
                verdicts[item] = None
                todo.append(item)
            else:
                stats.cache_hits += 1   # a duplicate inside the batch is asked once
        start = time.perf_counter()
        if todo:
            results = _run_coroutine(self._judge_all(todo, stats))
            new_rows = []
            for item, verdict in zip(todo, results, strict=True):
                verdicts[item] = verdict
                if verdict is not None:
                    self.cache[item] = verdict
                    new_rows.append({"question": item[0], "answer": item[1], "reference": item[2], "verdict": verdict})
            if new_rows and self.config.cache:
                path = Path(self.config.cache)
                path.parent.mkdir(parents=True, exist_ok=True)
                with path.open("a") as f:
                    f.writelines(json.dumps(row) + "\n" for row in new_rows)
        stats.seconds = time.perf_counter() - start
        out = [verdicts[item] for item in items]
        stats.failures = sum(verdict is None for verdict in out)
        self.last_stats = stats
        for name in ("items", "calls", "cache_hits", "failures", "malformed", "answers_cut", "seconds"):
            setattr(self.total, name, getattr(self.total, name) + getattr(stats, name))
        return out

    def check_failure_bound(self, failed: int, total: int) -> None:
        """Stop the run when `failed / total` exceeds reward_model.judge.max_failure_fraction."""
        if total and failed / total > self.config.max_failure_fraction:
            examples = "; ".join(self.last_stats.errors[:3])
            raise JudgeFailureBoundExceeded(
                f"{failed} of {total} judge calls failed ({failed / total:.1%}), more than "
                f"reward_model.judge.max_failure_fraction={self.config.max_failure_fraction} "
                f"(judge {self.endpoint}); first errors: {examples}")

    async def _judge_all(self, items: list[JudgeItem], stats: JudgeStats) -> list[bool | None]:
        import httpx

        cfg = self.config
        semaphore = asyncio.Semaphore(cfg.max_concurrency)
        limits = httpx.Limits(max_connections=cfg.max_concurrency, max_keepalive_connections=cfg.max_concurrency)
        # identity: a reply's size on the wire is its size in memory (a compressed reply is refused)
        headers = {"Accept-Encoding": "identity"}
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        async with httpx.AsyncClient(timeout=cfg.timeout, limits=limits, headers=headers) as client:
            async def one(item: JudgeItem) -> bool | None:
                async with semaphore:
                    try:
                        return await self._judge_one(client, item, stats)
                    except MalformedReply as exc:
                        stats.malformed += 1
                        stats.errors.append(self._redacted(str(exc)))
                    except JudgeError as exc:
                        stats.errors.append(self._redacted(str(exc)))
                    except Exception as exc:   # noqa: BLE001 - a hostile reply fails its row, never the batch
                        stats.errors.append(self._excerpt(f"unexpected {type(exc).__name__}: {exc}"))
                    return None
            return list(await asyncio.gather(*(one(item) for item in items)))

    async def _judge_one(self, client: Any, item: JudgeItem, stats: JudgeStats) -> bool:
        cfg = self.config
        question, answer, reference = item
        last_error = ""
        for attempt in range(cfg.max_retries + 1):
            if attempt:
                await asyncio.sleep(cfg.backoff_factor * 2 ** (attempt - 1))
            prompt = judge_messages(cfg.prompt_template, question, answer, reference, cfg.max_answer_chars)
            if attempt == 0 and prompt.answer_chars_cut:
                stats.answers_cut += 1
            body = {"model": cfg.model, "temperature": 0.0, "max_tokens": cfg.max_tokens, "messages": prompt.messages}
            stats.calls += 1
            try:
                status, raw = await self._post(client, body)
            except _Retryable as exc:
                last_error = str(exc)
                continue
            if status in RETRYABLE_STATUS:
                last_error = f"HTTP {status}"
                continue
            text = raw.decode("utf-8", errors="replace")
            if status != 200:
                raise JudgeError(f"HTTP {status}: {self._excerpt(text)}")
            return self._verdict(text)
        raise JudgeError(f"{last_error} (after {cfg.max_retries} retries)")

    async def _post(self, client: Any, body: dict[str, Any]) -> tuple[int, bytes]:
        """(status, body bytes) of one request within the `timeout` deadline, its reply at most
        `max_reply_bytes`; _Retryable for a missed deadline or a connection error, MalformedReply for
        a reply too large or undecodable."""
        import httpx

        cfg = self.config
        try:
            async with asyncio.timeout(cfg.timeout):
                async with client.stream("POST", self.endpoint, json=body) as response:
                    return response.status_code, await _read_capped(response, cfg.max_reply_bytes)
        except (TimeoutError, httpx.TimeoutException) as exc:
            raise _Retryable(f"timeout: no complete reply within {cfg.timeout}s ({type(exc).__name__})") from None
        except httpx.TransportError as exc:
            raise _Retryable(self._excerpt(f"{type(exc).__name__}: {exc}")) from None
        except httpx.HTTPError as exc:   # any other httpx error (DecodingError, ...): the reply is unusable
            raise MalformedReply(self._excerpt(f"undecodable reply ({type(exc).__name__}: {exc})")) from None

    def _verdict(self, text: str) -> bool:
        """The verdict in a 200 reply's body; MalformedReply when there is none."""
        try:
            content = json.loads(text)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError, RecursionError) as exc:
            raise MalformedReply(f"malformed chat completion ({type(exc).__name__}): {self._excerpt(text)}") from None
        verdict = parse_verdict(content)
        if verdict is None:
            raise MalformedReply(f"no yes/no verdict on the last line of the judge's reply "
                                 f"{self._excerpt(str(content))!r}")
        return verdict

    def _redacted(self, text: str) -> str:
        """`text` without the API key (a server may echo the request's headers in its error)."""
        return redact(text, [self._key])

    def _excerpt(self, text: str) -> str:
        """The first ERROR_EXCERPT_CHARS characters of `text`, redacted first: a cut never splits the key."""
        return self._redacted(text)[:ERROR_EXCERPT_CHARS]


async def _read_capped(response: Any, cap: int) -> bytes:
    """The response body, read as it streams; MalformedReply once it passes `cap` bytes, or at once when it
    announces more or comes compressed (asked for identity: a compressed body would be inflated before
    the cap could count it)."""
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise MalformedReply(f"compressed reply refused (Content-Encoding: {encoding[:40]!r}; asked for identity)")
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > cap:
        raise MalformedReply(f"reply of {int(declared)} bytes refused: more than max_reply_bytes={cap}")
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) > cap:
            raise MalformedReply(f"reply refused past max_reply_bytes={cap} (still streaming)")
    return bytes(body)


def _run_coroutine(coroutine: Any) -> Any:
    """Run `coroutine` to completion from sync code, also when this thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()
