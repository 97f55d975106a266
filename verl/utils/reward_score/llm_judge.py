"""An LLM judge over any OpenAI-compatible chat endpoint (`reward_model.judge.*`).

`LLMJudge.judge(items)` asks the endpoint's `/v1/chat/completions` whether each (question,
answer, reference) is correct: one prompt per item from `prompt_template` ({question},
{answer}, {reference}), at most `max_concurrency` requests in flight on one `httpx.AsyncClient`,
each bounded by `timeout` seconds. Connection errors, timeouts, 429 and 5xx answers are retried
with exponential backoff (`backoff_factor * 2**(retry - 1)` s) up to `max_retries` times; a 4xx
or a reply with no yes/no verdict is not retried. Verdicts are cached by (question, answer,
reference): in memory, and appended to the jsonl file `cache` (read back at start) when set.

A failed item is never a verdict: `judge` returns None for it and counts it
(`reward/judge_failures`); the reward manager decides what the row scores (EM, counted) and
`check_failure_bound` stops the run when a batch's failures exceed `max_failure_fraction`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_PROMPT_TEMPLATE = (
    "You are grading an answer to a question against reference answers.\n"
    "Question: {question}\n"
    "Reference answer(s): {reference}\n"
    "Answer to grade: {answer}\n"
    "Is the answer to grade correct, that is, does it mean the same as one of the references? "
    "Reply with one word: yes or no."
)
RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})
_VERDICT_RE = re.compile(r"\b(yes|no|correct|incorrect|true|false)\b", re.IGNORECASE)
_POSITIVE = frozenset({"yes", "correct", "true"})

JudgeItem = tuple[str, str, str]   # (question, answer, reference)


class JudgeError(RuntimeError):
    """One judge call failed for good (after its retries)."""


class JudgeFailureBoundExceeded(RuntimeError):
    """More of a batch's judge calls failed than reward_model.judge.max_failure_fraction allows."""


def parse_verdict(text: str) -> bool | None:
    """True/False from the first yes/no (correct/incorrect, true/false) word in `text`; None if there is none."""
    match = _VERDICT_RE.search(text or "")
    if match is None:
        return None
    return match.group(1).lower() in _POSITIVE


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

    @classmethod
    def from_config(cls, node: Any, prefix: str = "reward_model.judge") -> JudgeConfig | None:
        """The judge's settings, or None when `url` is null; ValueError naming the bad key."""
        if node is None or node.get("url") in (None, ""):
            return None
        get = node.get
        if not get("model"):
            raise ValueError(f"{prefix}.model must name the served model when {prefix}.url is set")
        template = get("prompt_template") or DEFAULT_PROMPT_TEMPLATE
        for slot in ("{question}", "{answer}", "{reference}"):
            if slot not in template:
                raise ValueError(f"{prefix}.prompt_template must contain {slot}")
        try:
            template.format(question="", answer="", reference="")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"{prefix}.prompt_template: only {{question}}, {{answer}}, {{reference}} "
                             f"may appear in braces (double other braces): {exc!r}") from exc
        cfg = cls(url=str(get("url")), model=str(get("model")), prompt_template=str(template),
                  max_concurrency=int(get("max_concurrency", 16)), timeout=float(get("timeout", 60)),
                  max_retries=int(get("max_retries", 3)), backoff_factor=float(get("backoff_factor", 0.5)),
                  max_tokens=int(get("max_tokens", 16)),
                  cache=str(get("cache")) if get("cache") else None,
                  max_failure_fraction=float(get("max_failure_fraction", 0.05)),
                  api_key_env=str(get("api_key_env")) if get("api_key_env") else None)
        if cfg.max_concurrency < 1:
            raise ValueError(f"{prefix}.max_concurrency={cfg.max_concurrency} must be >= 1")
        if cfg.timeout <= 0:
            raise ValueError(f"{prefix}.timeout={cfg.timeout} must be > 0")
        if cfg.max_retries < 0:
            raise ValueError(f"{prefix}.max_retries={cfg.max_retries} must be >= 0")
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
        for name in ("items", "calls", "cache_hits", "failures", "seconds"):
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
        headers = {"Authorization": f"Bearer {self._key}"} if self._key else None
        async with httpx.AsyncClient(timeout=cfg.timeout, limits=limits, headers=headers) as client:
            async def one(item: JudgeItem) -> bool | None:
                async with semaphore:
                    try:
                        return await self._judge_one(client, item, stats)
                    except JudgeError as exc:
                        stats.errors.append(self._redacted(str(exc)))
                        return None
            return list(await asyncio.gather(*(one(item) for item in items)))

    async def _judge_one(self, client: Any, item: JudgeItem, stats: JudgeStats) -> bool:
        import httpx

        cfg = self.config
        question, answer, reference = item
        body = {"model": cfg.model, "temperature": 0.0, "max_tokens": cfg.max_tokens,
                "messages": [{"role": "user", "content": cfg.prompt_template.format(
                    question=question, answer=answer, reference=reference)}]}
        last_error = ""
        for attempt in range(cfg.max_retries + 1):
            if attempt:
                await asyncio.sleep(cfg.backoff_factor * 2 ** (attempt - 1))
            stats.calls += 1
            try:
                response = await client.post(self.endpoint, json=body)
            except httpx.TimeoutException as exc:
                last_error = f"timeout after {cfg.timeout}s ({type(exc).__name__})"
                continue
            except httpx.TransportError as exc:
                last_error = f"{type(exc).__name__}: {exc}"
                continue
            if response.status_code in RETRYABLE_STATUS:
                last_error = f"HTTP {response.status_code}"
                continue
            if response.status_code != 200:
                raise JudgeError(f"HTTP {response.status_code}: {response.text[:200]}")
            try:
                content = response.json()["choices"][0]["message"]["content"]
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                raise JudgeError(f"malformed chat completion ({exc!r}): {response.text[:200]}") from exc
            verdict = parse_verdict(content if isinstance(content, str) else "")
            if verdict is None:
                raise JudgeError(f"no yes/no verdict in the judge's reply {str(content)[:200]!r}")
            return verdict
        raise JudgeError(f"{last_error} (after {cfg.max_retries} retries)")


    def _redacted(self, text: str) -> str:
        """`text` without the API key (a server may echo the request's headers in its error)."""
        return text.replace(self._key, "***") if self._key else text


def _run_coroutine(coroutine: Any) -> Any:
    """Run `coroutine` to completion from sync code, also when this thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()
