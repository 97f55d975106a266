"""An asyncio event loop on a daemon thread of its own, for blocking code that must run coroutines
(the sync rollout calling tools' async `create` / `execute` / `calc_reward` / `release`)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """`run(coro)` runs `coro` on the thread's loop and waits for its result (started on first use)."""

    def __init__(self, name: str = "rollout-tools") -> None:
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def _ensure(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, daemon=True, name=self._name).start()
                self._loop = loop
            return self._loop

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._ensure()).result()

    def __getstate__(self) -> dict:
        return {"_name": self._name}       # a loop does not travel; a new one starts on first use

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["_name"])


__all__ = ["LoopThread"]
