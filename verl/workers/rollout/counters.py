"""Counters that say what a rollout costs on an accelerator, counted on any device.

On a GPU, decoding a small model is bound by what the host issues, not by arithmetic: every
forward costs about the same whatever its tokens (kernel launches, one read of the weights),
every torch op outside it is one more launch, and every read of a device value on the host
(`.item()`, `.tolist()`, `bool(t)`, a pageable host-to-device copy) stalls the stream until
the GPU has caught up. On a CPU the same extras cost little next to the forward's arithmetic,
so a rollout can be fast on CPU and slow on GPU. What matters there is counted here:
forwards per generated token, rows per forward, prefill tokens, host syncs and torch ops per
decoding step. They are counts, equal on CPU and CUDA, so CPU tests can pin them.

    with RolloutCounters(module) as counts:
        counts.watch(rollout, "generate_sequences")      # sync: the engine is this call
        counts.watch(step_engine, "step")                # async: each step, in whatever thread runs it
        ...
    counts.summary(generated_tokens=...)                 # a dict of numbers (JSON)

Forwards of `module` are counted wherever they run; host syncs and ops only inside watched
calls (the engine's work, not the caller's bookkeeping on host tensors), apart inside and
outside the model's forward. torch modes are per thread, so each watched call enters its own.
A *decoding step* is one decode forward (one new token for every running row).
"""

from __future__ import annotations

import functools
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# Calls that hand a device value to the host: on CUDA each one waits for the stream to drain.
# (multinomial is not here: since torch 2.5 its argument checks are device-side asserts.)
HOST_READS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy",
                        "nonzero", "argwhere", "masked_select", "unique", "equal", "allclose", "is_nonzero"})
# Copies from host memory to a device: torch makes a pageable copy synchronous (non_blocking=False).
HOST_TO_DEVICE = frozenset({"to", "cuda", "tensor", "as_tensor"})
_ABSENT = object()


def _names_a_device(args: tuple, kwargs: dict) -> bool:
    if kwargs.get("device") is not None:
        return True
    return any(isinstance(a, torch.device) or (isinstance(a, str) and a.split(":")[0] in ("cpu", "cuda", "xpu", "mps"))
               for a in args)


class _HostSyncs(TorchFunctionMode):
    def __init__(self, owner: RolloutCounters) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        owner = self.owner
        if not owner._local.paused:
            name = getattr(func, "__name__", "")
            if name in HOST_READS:
                owner._count_sync(name)
            elif name in HOST_TO_DEVICE and not kwargs.get("non_blocking", False):
                source_on_host = name in ("tensor", "as_tensor") or (
                    bool(args) and isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu")
                if source_on_host and (name == "cuda" or _names_a_device(args[1:] if name == "to" else (), kwargs)):
                    owner._count_sync(f"{name}(host->device)")
        return func(*args, **kwargs)


@functools.cache
def ops_inside(name: str) -> int:
    """How many aten ops one call of `name` runs inside its kernel, where a dispatch mode sees one.

    Measured once with torch.profiler on this torch: the op's direct children. multinomial with
    one sample is 15 (aminmax, two checks of 3-4 ops and a device assert each, sum, the draw, a
    divide, argmax, two allocations). Ops not listed in `_COMPOSITE` count 1."""
    make = _COMPOSITE.get(name)
    if make is None:
        return 1
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        make()
    return max(1, sum(len(e.cpu_children) for e in prof.events() if e.name == f"aten::{name}"))


_COMPOSITE = {"multinomial": lambda: torch.multinomial(torch.full((4,), 0.25), 1,
                                                       generator=torch.Generator().manual_seed(0))}


class _Ops(TorchDispatchMode):
    """Every aten op that computes (views excluded): on CUDA, about one kernel launch each; an op
    whose kernel runs several (`ops_inside`) counts them all."""

    def __init__(self, owner: RolloutCounters) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        owner = self.owner
        if not owner._local.paused and not func.is_view:
            owner._count_op(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


class RolloutCounters:
    """Counts forwards of `module` (prefill: no past_key_values; decode: with them), the rows and
    tokens each one feeds, and the host syncs and torch ops of the watched calls, while entered."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.prefill_forwards = 0
        self.decode_forwards = 0
        self.prefill_rows = 0
        self.decode_rows = 0
        self.prefill_positions = 0       # rows x width fed to prefill forwards, padding included
        self.prefill_tokens = 0          # the real (attended) ones among them
        self.host_syncs_in_forward = 0
        self.host_syncs_outside_forward = 0
        self.ops_in_forward = 0
        self.ops_outside_forward = 0
        self.sync_names: Counter[str] = Counter()
        self.op_names: Counter[str] = Counter()
        self._inside = {name: ops_inside(name) for name in _COMPOSITE}   # profiled here, not inside a mode
        self._lock = threading.Lock()    # steps may run in a worker thread while the caller's thread counts
        self._local = threading.local()  # per thread: forward depth, watched-call depth, paused
        self._handles: list[Any] = []
        self._patched: list[tuple[Any, str, Any]] = []

    # --- recording -----------------------------------------------------------------------

    def _state(self) -> threading.local:
        local = self._local
        if not hasattr(local, "paused"):
            local.paused, local.forward_depth, local.watch_depth = False, 0, 0
        return local

    @contextmanager
    def _pause(self) -> Iterator[None]:
        local = self._state()
        was, local.paused = local.paused, True
        try:
            yield
        finally:
            local.paused = was

    def _count_sync(self, name: str) -> None:
        with self._lock:
            if self._state().forward_depth:
                self.host_syncs_in_forward += 1
            else:
                self.host_syncs_outside_forward += 1
                self.sync_names[name] += 1

    def _count_op(self, name: str) -> None:
        n = self._inside.get(name, 1)
        with self._lock:
            if self._state().forward_depth:
                self.ops_in_forward += n
            else:
                self.ops_outside_forward += n
                self.op_names[name] += n

    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        with self._pause():
            input_ids = kwargs.get("input_ids", args[0] if args else None)
            rows, width = input_ids.shape
            past = kwargs.get("past_key_values")
            prefill = past is None or (hasattr(past, "get_seq_length") and past.get_seq_length() == 0)
            mask = kwargs.get("attention_mask")
            real = rows * width if mask is None or not prefill else int(mask[:, -width:].sum())
        with self._lock:
            if prefill:
                self.prefill_forwards += 1
                self.prefill_rows += rows
                self.prefill_positions += rows * width
                self.prefill_tokens += real
            else:
                self.decode_forwards += 1
                self.decode_rows += rows
        self._state().forward_depth += 1

    def _after_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self._state().forward_depth -= 1

    @contextmanager
    def _counting(self) -> Iterator[None]:
        """Count host syncs and ops in this thread for the duration (once, however deeply nested)."""
        local = self._state()
        local.watch_depth += 1
        try:
            if local.watch_depth > 1:
                yield
                return
            with ExitStack() as stack:
                stack.enter_context(_HostSyncs(self))
                stack.enter_context(_Ops(self))
                yield
        finally:
            local.watch_depth -= 1

    def watch(self, obj: Any, name: str) -> None:
        """Count inside every call of `obj.name` (an instance attribute until exit)."""
        original = getattr(obj, name)

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            with self._counting():
                return original(*args, **kwargs)

        own = vars(obj).get(name, _ABSENT) if hasattr(obj, "__dict__") else _ABSENT
        setattr(obj, name, counted)
        self._patched.append((obj, name, own))

    def watch_rollout(self, rollout: Any) -> None:
        """Count the rollout's own work in both modes: `generate_sequences` (sync) and every step
        of each step engine its `step_engine(meta)` makes (async; steps may run in a worker thread)."""
        self.watch(rollout, "generate_sequences")
        make_step_engine = rollout.step_engine
        own = vars(rollout).get("step_engine", _ABSENT)

        def watched_step_engine(meta: dict) -> Any:
            engine = make_step_engine(meta)
            self.watch(engine, "step")
            return engine

        rollout.step_engine = watched_step_engine
        self._patched.append((rollout, "step_engine", own))

    def __enter__(self) -> RolloutCounters:
        self._handles = [self.module.register_forward_pre_hook(self._before_forward, with_kwargs=True),
                         self.module.register_forward_hook(self._after_forward, with_kwargs=True)]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        for obj, name, own in reversed(self._patched):
            if own is _ABSENT:
                delattr(obj, name)     # the class's method again
            else:
                setattr(obj, name, own)
        self._handles, self._patched = [], []

    # --- reading -------------------------------------------------------------------------

    def summary(self, generated_tokens: int | None = None) -> dict[str, Any]:
        """The counts, and the ratios that decide GPU wall time (per decoding step = per decode forward)."""
        steps = max(1, self.decode_forwards)
        forwards = self.prefill_forwards + self.decode_forwards
        out: dict[str, Any] = {
            "forwards": forwards,
            "prefill_forwards": self.prefill_forwards,
            "decode_forwards": self.decode_forwards,
            "rows_per_decode_forward": round(self.decode_rows / steps, 2),
            "rows_per_prefill_forward": round(self.prefill_rows / max(1, self.prefill_forwards), 2),
            "prefill_tokens": self.prefill_tokens,
            "prefill_positions": self.prefill_positions,
            "host_syncs_per_step": round(self.host_syncs_outside_forward / steps, 2),
            "host_syncs_in_forward_per_forward": round(self.host_syncs_in_forward / max(1, forwards), 2),
            "ops_per_step": round(self.ops_outside_forward / steps, 1),
            "ops_in_forward_per_forward": round(self.ops_in_forward / max(1, forwards), 1),
            # Everything the host issued: on a GPU where launches and syncs, not FLOPs, bound the
            # rollout (a small model), the ratio of these between two runs predicts their wall-clock ratio.
            "ops_total": self.ops_in_forward + self.ops_outside_forward,
            "host_syncs_total": self.host_syncs_in_forward + self.host_syncs_outside_forward,
            "host_syncs_outside_forward": dict(self.sync_names.most_common()),
            "top_ops_outside_forward": dict(self.op_names.most_common(8)),
        }
        if generated_tokens is not None:
            out["generated_tokens"] = int(generated_tokens)
            out["forwards_per_generated_token"] = round(forwards / max(1, generated_tokens), 4)
        return out
