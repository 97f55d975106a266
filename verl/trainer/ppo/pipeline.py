"""Pipelined training (`trainer.pipeline=one_step_off|async`): a rollout pool generates the next
batches while the train pool trains on the current one.

A producer thread in the driver draws batches from the dataloader and rolls each out on the
rollout pool (the same generation manager and searches as a sync step); the driver's main thread
takes them from a queue and trains. Versions count the driver's completed steps: the weights after
step v are version v, and a batch trained at step s + 1 (global_step s) that version v sampled is
s - v updates stale.

    producer:  [push weights v][roll out batch j] ... waits while j - steps_done > bound
    trainer:                   [old log-prob, ref, adv, update -> step j + 1] ...

- bound: one_step_off 1; async `trainer.max_staleness`; `+trainer.pipeline_wait_for_sync=true` 0,
  which makes every rollout wait for the weights of the update just made (a sync run's steps).
- Weights go to the rollout pool between two of its rollouts, from the train pool's rank 0 over the
  weight-sync group (verl/workers/weight_sync.py); with `rollout.partial=true` also between two
  turns of a rollout in flight, each turn's tokens recording the version that sampled them
  (`token_versions`; the batch's version, which the bound reads, is its oldest). The send is
  submitted while no update can be, so the weights sent are exactly version v.
- A batch more stale than the bound is dropped, never trained (counted in `pipeline/dropped_stale`).
- Checkpoints record the dataloader position of the batch trained, not of the ones already drawn:
  a resumed run rolls the in-flight batches out again, with its weights, and trains each once.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig

from verl.protocol import DataProto
from verl.trainer.run_config import Trainer


def staleness_bound(config: DictConfig) -> int:
    """How many updates a batch may trail the policy it trains: 0 (wait for sync), 1 (one_step_off)
    or trainer.max_staleness (async)."""
    if Trainer.from_config(config).pipeline_wait_for_sync:
        return 0
    if str(config.trainer.pipeline) == "one_step_off":
        return 1
    return int(config.trainer.max_staleness)


@dataclass
class RolledBatch:
    """One batch rolled out by the producer, ready to train."""

    index: int                       # its place in the run: trained at step index + 1
    batch: DataProto
    metrics: dict[str, float]
    timing: dict[str, float]
    version: int                     # the steps done when the weights that sampled it were sent
    loader_state: dict[str, Any]     # the dataloader's state right after this batch was drawn
    rollout_idle_s: float            # the producer's wait before this rollout (staleness bound, validation)


@dataclass
class _Stats:
    staleness: Counter = field(default_factory=Counter)
    dropped: int = 0
    syncs: int = 0
    sync_s: float = 0.0
    sync_bytes: int = 0


class RolloutProducer:
    """The producer thread and what it shares with the trainer: the steps done, the rollout pool's
    lock (one rollout, weight push or validation at a time) and the queue of rolled batches."""

    def __init__(self, rollout: Callable[[DataProto, int, dict, dict], DataProto],
                 push_weights: Callable[[], int], steps_done: int, total_steps: int, bound: int,
                 rollout_version: int = 0) -> None:
        self._rollout = rollout
        self._push = push_weights
        self.bound = bound
        self.total_steps = total_steps
        self.steps_done = steps_done
        # the version of the rollout pool's weights (the trainer pushed a loaded checkpoint's already)
        self.rollout_version = rollout_version
        self.stats = _Stats()
        self._cond = threading.Condition()
        self._update_lock = threading.Lock()    # held while an update is submitted and runs
        self._pool_lock = threading.Lock()      # the rollout pool: one user at a time
        self._queue: queue.Queue[RolledBatch | BaseException | None] = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- producer side
    def start(self, batches: Iterator[tuple[DataProto, dict[str, Any]]]) -> None:
        self._thread = threading.Thread(target=self._run, args=(batches,), name="rollout-producer", daemon=True)
        self._thread.start()

    def _run(self, batches: Iterator[tuple[DataProto, dict[str, Any]]]) -> None:
        try:
            index = self.steps_done
            for batch, loader_state in batches:
                if index >= self.total_steps:
                    break
                waited = time.monotonic()
                with self._cond:
                    self._cond.wait_for(lambda i=index: self._stop.is_set() or i - self.steps_done <= self.bound)
                if self._stop.is_set():
                    return
                with self._pool_lock:
                    idle = time.monotonic() - waited
                    version = self.sync_weights()
                    metrics: dict[str, float] = {}
                    timing: dict[str, float] = {}
                    rolled = self._rollout(batch, index, metrics, timing)
                self._queue.put(RolledBatch(index, rolled, metrics, timing, version, loader_state, idle))
                index += 1
            self._queue.put(None)
        except BaseException as err:   # handed to the trainer, which raises it
            self._queue.put(err)

    def sync_weights(self) -> int:
        """Bring the rollout pool to the newest weights (call with the pool lock held); their version."""
        with self._update_lock:   # no update in flight: the weights sent are exactly version steps_done
            self._push_newest()
        return self.rollout_version

    def refresh(self) -> int:
        """Between two turns of a partial rollout: the newest weights if they can be sent now (no update
        in flight; the rollout does not wait for one), else the ones it has; their version."""
        if self._update_lock.acquire(blocking=False):
            try:
                self._push_newest()
            finally:
                self._update_lock.release()
        return self.rollout_version

    def _push_newest(self) -> None:
        if self.rollout_version != self.steps_done:
            began = time.monotonic()
            self.stats.sync_bytes += self._push()
            self.rollout_version = self.steps_done
            self.stats.syncs += 1
            self.stats.sync_s += time.monotonic() - began

    # ---------------------------------------------------------------- trainer side
    def next_batch(self) -> tuple[RolledBatch | None, float]:
        """The next rolled batch (None when the producer ran out of data) and the seconds waited."""
        began = time.monotonic()
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item, time.monotonic() - began

    @contextmanager
    def updating(self) -> Iterator[None]:
        """Around an actor update: no weight push is submitted meanwhile."""
        with self._update_lock:
            yield

    def step_done(self, global_step: int) -> None:
        """The trainer finished step `global_step`: the producer may roll out up to bound steps ahead."""
        with self._cond:
            self.steps_done = global_step
            self._cond.notify_all()

    @contextmanager
    def rollout_pool(self) -> Iterator[None]:
        """The rollout pool for the trainer (validation), with the newest weights."""
        with self._pool_lock:
            self.sync_weights()
            yield

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()

    def metrics(self, item: RolledBatch, global_step: int, train_idle_s: float) -> dict[str, float]:
        out = self._batch_metrics(item, global_step, train_idle_s)
        out.update(token_version_metrics(item.batch, global_step))
        return out

    def _batch_metrics(self, item: RolledBatch, global_step: int, train_idle_s: float) -> dict[str, float]:
        """`pipeline/*` metrics of a batch about to train at step global_step + 1."""
        staleness = global_step - item.version
        self.stats.staleness[staleness] += 1
        out = {
            "pipeline/staleness": float(staleness),
            "pipeline/max_staleness_seen": float(max(self.stats.staleness)),
            "pipeline/policy_version": float(item.version),
            "pipeline/rollout_idle_s": item.rollout_idle_s,
            "pipeline/train_idle_s": train_idle_s,
            "pipeline/dropped_stale": float(self.stats.dropped),
            "pipeline/weight_syncs": float(self.stats.syncs),
            "pipeline/weight_sync_s": self.stats.sync_s,
            "pipeline/weight_sync_bytes": float(self.stats.sync_bytes),
        }
        # the histogram so far: batches trained at each staleness
        out.update({f"pipeline/staleness_hist/{k}": float(n) for k, n in sorted(self.stats.staleness.items())})
        return out


def token_version_metrics(batch: DataProto, global_step: int) -> dict[str, float]:
    """A partial rollout's per-token versions (`token_versions`, over the policy's tokens): the share
    of rows sampled by more than one version, and the tokens' staleness at this step."""
    import torch

    from verl.utils import batch_keys as K

    if K.TOKEN_VERSIONS not in batch.batch.keys():
        return {}
    versions = batch.batch[K.TOKEN_VERSIONS]
    policy = batch.batch[K.LOSS_MASK].bool() if K.LOSS_MASK in batch.batch.keys() else versions >= 0
    if not policy.any():
        return {}
    big = torch.iinfo(versions.dtype).max
    newest = torch.where(policy, versions, torch.full_like(versions, -1)).max(-1).values
    oldest = torch.where(policy, versions, torch.full_like(versions, big)).min(-1).values
    has_tokens = policy.any(-1)
    staleness = (global_step - versions[policy]).float()
    return {
        "pipeline/partial_rows": float(((newest > oldest) & has_tokens).float().sum() / has_tokens.sum()),
        "pipeline/token_staleness_mean": float(staleness.mean()),
        "pipeline/token_staleness_max": float(staleness.max()),
    }
