"""The user's agent, run once per row against the endpoint (docs/agent.md "Train an agent you already wrote").

    async def agent(base_url: str, row: dict) -> dict      # the file and name the `openai_agent` keys give

`base_url` is the row's own session (`http://127.0.0.1:<port>/sessions/<id>/v1`): the agent points its
OpenAI client there and runs its tools itself. `row` is the dataset row's fields (`raw_prompt`: its chat
messages; `extra_info`, `data_source`, `index`), without `reward_model`: the agent does not see the
answer. Its return value feeds the reward: `answer` (a string), when given, is what the reward function
scores (as `<answer>answer</answer>`), and the whole dict reaches a custom reward function as
`extra_info["agent_output"]`.

Agents run concurrently up to `concurrency`, each under `timeout` seconds; a row whose agent raises,
times out, returns something other than a dict, or made no completion in its session is dropped and
counted (`agent/failures`); more than `max_failure_fraction` of a rollout's rows failing stops the run.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from search_r1.llm_agent.openai_endpoint.server import Endpoint, serve_endpoint
from search_r1.llm_agent.openai_endpoint.sessions import Sample

logger = logging.getLogger(__name__)
KEY = "openai_agent"
HIDDEN_FIELDS = ("reward_model",)
AgentFn = Callable[[str, dict], Awaitable[Any]]


@dataclass(frozen=True)
class AgentSettings:
    """The `openai_agent` config block."""

    path: str
    name: str = "agent"
    concurrency: int = 32
    timeout: float = 600.0
    max_failure_fraction: float = 0.05

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError(f"{KEY}.path: required (a .py file defining async def {self.name}(base_url, row))")
        if int(self.concurrency) < 1:
            raise ValueError(f"{KEY}.concurrency must be >= 1, got {self.concurrency}")
        if not float(self.timeout) > 0:
            raise ValueError(f"{KEY}.timeout must be > 0 seconds, got {self.timeout}")
        if not 0.0 <= float(self.max_failure_fraction) <= 1.0:
            raise ValueError(f"{KEY}.max_failure_fraction must be in [0, 1], got {self.max_failure_fraction}")

    @classmethod
    def from_config(cls, node: Any) -> AgentSettings | None:
        """None when the block is absent or its path is null (the agent is off)."""
        if node is None or not node.get("path"):
            return None
        return cls(path=str(node.get("path")), name=str(node.get("name") or "agent"),
                   concurrency=int(node.get("concurrency", 32)), timeout=float(node.get("timeout", 600.0)),
                   max_failure_fraction=float(node.get("max_failure_fraction", 0.05)))


def load_agent(settings: AgentSettings) -> AgentFn:
    """The function `name` of the file `path`: an `async def`, or refused with the key named."""
    from verl.utils.user_file import import_user_file

    file = Path(settings.path).expanduser().resolve()
    module = import_user_file(file, f"{KEY}.path", "search_r1_openai_agent_")
    fn = getattr(module, settings.name, None)
    if fn is None:
        raise AttributeError(f"{KEY}.name: {str(file)!r} defines no {settings.name!r}")
    if not inspect.iscoroutinefunction(fn):
        raise TypeError(f"{KEY}.name: {settings.name!r} in {str(file)!r} must be an async function "
                        "`async def agent(base_url: str, row: dict) -> dict` (run a blocking framework inside it "
                        "with `await asyncio.to_thread(...)`)")
    return fn


@dataclass
class RowResult:
    """One row's agent run: its samples (empty when it failed), its return value, why it failed."""

    row: int
    samples: list[Sample] = field(default_factory=list)
    output: dict | None = None
    error: str | None = None
    prefix_breaks: int = 0
    completions: int = 0


class Running:
    """How many agents are still running (the sync engine client sends a wave when all of them wait)."""

    def __init__(self, n: int) -> None:
        self._n = n
        self._lock = threading.Lock()

    def __call__(self) -> int:
        return self._n

    def done(self) -> None:
        with self._lock:
            self._n -= 1


async def _run_one(agent: AgentFn, endpoint: Endpoint, base: str, index: int, row: dict, settings: AgentSettings,
                   gate: asyncio.Semaphore, running: Running) -> RowResult:
    result = RowResult(row=index)
    async with gate:
        session_id = endpoint.open_session(row=index)
        try:
            output = await asyncio.wait_for(agent(f"{base}/sessions/{session_id}/v1", row), settings.timeout)
            if not isinstance(output, dict):
                raise TypeError(f"the agent returned {type(output).__name__}, not a dict")
            result.output = output
        except asyncio.TimeoutError:
            result.error = f"timed out after {settings.timeout:g} s"
        except Exception as err:  # noqa: BLE001 - the row's failure, counted; never the rollout's
            result.error = f"{type(err).__name__}: {str(err)[:300]}"
        finally:
            running.done()
            session = endpoint.close_session(session_id)
    result.samples = session.samples()
    result.prefix_breaks = session.prefix_breaks
    result.completions = len(session.exchanges)
    if result.error is None and not result.samples:
        result.error = "the agent made no completion in its session"
    if result.error is not None:
        logger.warning("row %d: the agent failed (%s); the row is dropped", index, result.error)
        result.samples = []
    return result


def agent_rows(fields: Sequence[dict]) -> list[dict]:
    """What each agent sees of its row: its fields less the hidden ones (the ground truth)."""
    return [{k: _plain(v) for k, v in f.items() if k not in HIDDEN_FIELDS} for f in fields]


def _plain(value: Any) -> Any:
    import numpy as np

    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def run_agents(agent: AgentFn, endpoint: Endpoint, rows: Sequence[dict], settings: AgentSettings,
               running: Running | None = None) -> tuple[list[RowResult], Counter[str]]:
    """Serve `endpoint` and run `agent` on every row (blocking: its own event loop on this thread); returns
    each row's result, in row order, and the counters (`failures`, `prefix_breaks`, `completions`, ...)."""
    running = running or Running(len(rows))

    async def main(base: str) -> list[RowResult]:
        gate = asyncio.Semaphore(int(settings.concurrency))
        return list(await asyncio.gather(*(_run_one(agent, endpoint, base, i, dict(row), settings, gate, running)
                                           for i, row in enumerate(rows))))

    with serve_endpoint(endpoint) as base:
        results = asyncio.run(main(base))
    counters = count_results(results)
    counters.update(endpoint_counters(endpoint))   # update, not +: zero counts stay (logged as 0)
    return results, counters


def count_results(results: Sequence[RowResult]) -> Counter[str]:
    """The rows' counters: failures, timeouts, prefix breaks, completions, samples."""
    counters: Counter[str] = Counter()
    for result in results:
        counters["failures"] += int(result.error is not None)
        counters["timeouts"] += int(bool(result.error and result.error.startswith("timed out")))
        counters["prefix_breaks"] += result.prefix_breaks
        counters["completions"] += result.completions
        counters["samples"] += len(result.samples)
    return counters


def endpoint_counters(endpoint: Endpoint) -> Counter[str]:
    """What the endpoint counted over all its sessions (requests refused or cut)."""
    return Counter({key: int(endpoint.counters.get(key, 0))
                    for key in ("context_exceeded", "sampling_ignored", "rate_limited", "engine_errors")})


class AgentFailureError(RuntimeError):
    """More of a rollout's rows failed than `openai_agent.max_failure_fraction` allows."""


def check_failures(counters: Counter[str], n_rows: int, settings: AgentSettings, where: str) -> None:
    fraction = counters["failures"] / max(1, n_rows)
    if fraction > settings.max_failure_fraction:
        raise AgentFailureError(
            f"{counters['failures']} of {n_rows} agents failed in the {where} (agent/failure_fraction="
            f"{fraction:.3f} > {KEY}.max_failure_fraction={settings.max_failure_fraction:g}): the run stops instead "
            "of training on what is left; the log names each row's error (set the key to 1.0 never to stop)")


__all__ = ["AgentFailureError", "AgentSettings", "RowResult", "Running", "agent_rows", "check_failures",
           "count_results", "endpoint_counters", "load_agent", "run_agents"]
