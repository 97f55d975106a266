"""veRL's rollout tracing names (`rollout_trace_op`, `rollout_trace_attr`, `RolloutTraceConfig`), so a
tool or agent-loop file that imports them loads here unmodified.

veRL sends spans to weave or mlflow; here `rollout_trace_op` records each decorated call (its name,
seconds, and the exception type if it raised) into the span list of the innermost active
`rollout_trace_attr(...)` block, and passes straight through when none is active (the default).

    with rollout_trace_attr(step=3, sample_index=0) as spans:
        await tool.execute(instance_id, {"x": 1})
    spans   # [{"name": "MyTool.execute", "seconds": 0.01, "error": None, "step": 3, "sample_index": 0, ...}]
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

_ACTIVE: ContextVar[tuple[list[dict[str, Any]], dict[str, Any]] | None] = ContextVar("rollout_trace", default=None)


class RolloutTraceConfig:
    """veRL's trace settings (one per process). `backend` None: nothing leaves the process."""

    _instance: RolloutTraceConfig | None = None

    def __init__(self) -> None:
        self.project_name: str | None = None
        self.experiment_name: str | None = None
        self.backend: str | None = None
        self.token2text = False
        self.max_samples_per_step_per_worker: int | None = None

    @classmethod
    def get_instance(cls) -> RolloutTraceConfig:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    @classmethod
    def init(cls, project_name: str | None = None, experiment_name: str | None = None, backend: str | None = None,
             token2text: bool = False, max_samples_per_step_per_worker: int | None = None) -> None:
        if backend not in (None, "memory"):
            raise ValueError(f"rollout trace backend {backend!r} is not available here; spans are kept in memory "
                             "(rollout_trace_attr) or not at all (backend null)")
        config = cls.get_instance()
        config.project_name, config.experiment_name, config.backend = project_name, experiment_name, backend
        config.token2text, config.max_samples_per_step_per_worker = bool(token2text), max_samples_per_step_per_worker

    @classmethod
    def get_backend(cls) -> str | None:
        return cls.get_instance().backend

    @classmethod
    def get_client(cls) -> None:
        return None

    @classmethod
    def enable_token2text(cls) -> bool:
        return cls.get_instance().token2text

    @classmethod
    def reset(cls) -> None:
        cls._instance = None


@contextmanager
def rollout_trace_attr(sample_index: Any = None, step: Any = None, rollout_n: Any = None, name: str = "rollout_trace",
                       validate: bool = False, trace: bool = True) -> Iterator[list[dict[str, Any]]]:
    """Collect the spans of the decorated calls made inside the block (the yielded list); the
    attributes are copied into each span. `trace=False`: nothing is collected."""
    spans: list[dict[str, Any]] = []
    if not trace:
        yield spans
        return
    attrs = {"sample_index": sample_index, "step": step, "rollout_n": rollout_n, "trace_name": name,
             "validate": validate}
    token = _ACTIVE.set((spans, attrs))
    try:
        yield spans
    finally:
        _ACTIVE.reset(token)


def _record(func: Callable[..., Any], args: tuple, start: float, error: BaseException | None) -> None:
    active = _ACTIVE.get()
    if active is None:
        return
    spans, attrs = active
    owner = type(args[0]).__name__ + "." if args and not inspect.isfunction(args[0]) else ""
    spans.append({"name": owner + func.__name__, "seconds": time.perf_counter() - start,
                  "error": None if error is None else type(error).__name__, **attrs})


def rollout_trace_op(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a method (sync or async) so each call is a span of the active `rollout_trace_attr`."""
    if inspect.iscoroutinefunction(func):
        @functools.wraps(func)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            if _ACTIVE.get() is None:
                return await func(*args, **kwargs)
            start, error = time.perf_counter(), None
            try:
                return await func(*args, **kwargs)
            except BaseException as err:
                error = err
                raise
            finally:
                _record(func, args, start, error)

        return async_wrapper

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _ACTIVE.get() is None:
            return func(*args, **kwargs)
        start, error = time.perf_counter(), None
        try:
            return func(*args, **kwargs)
        except BaseException as err:
            error = err
            raise
        finally:
            _record(func, args, start, error)

    return wrapper


__all__ = ["RolloutTraceConfig", "rollout_trace_attr", "rollout_trace_op"]
