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
- Dynamic sampling (`algorithm.filter_groups.enable`, DAPO): the producer rolls out generation batches
  of data.gen_batch_size prompts, with at most bound - 1 of them waiting in the queue (so none is more
  than bound updates stale when trained); the trainer scores each and keeps its varying groups
  (dynamic_sampling.py) until a step's worth, then trains; the checkpoint records the position after
  the last generation batch it took.
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, open_dict

from verl.protocol import DataProto
from verl.trainer.ppo import metric_utils as mu
from verl.trainer.ppo.pool_sync import join_weight_sync, push_weights
from verl.trainer.ppo.resource_pools import Role
from verl.trainer.run_config import Trainer
from verl.utils.tracking import Tracking

logger = logging.getLogger(__name__)


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
                 rollout_version: int = 0, batches_per_step_vary: bool = False) -> None:
        self._rollout = rollout
        self._push = push_weights
        self.bound = bound
        self.total_steps = total_steps
        self.steps_done = steps_done
        # dynamic sampling: a step takes as many batches as it needs, so the producer runs until stopped
        # and bounds the batches waiting in the queue (`_may_roll_out`)
        self.batches_per_step_vary = batches_per_step_vary
        self.taken = 0   # batches the trainer has taken this run
        # the version of the rollout pool's weights (the trainer pushed a loaded checkpoint's already)
        self.rollout_version = rollout_version
        self.stats = _Stats()
        self._cond = threading.Condition()
        self._update_lock = threading.Lock()    # held while an update is submitted and runs
        self._pool_lock = threading.Lock()      # the rollout pool: one user at a time
        self._queue: queue.Queue[RolledBatch | BaseException | None] = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._first_index = steps_done

    # ---------------------------------------------------------------- producer side
    def start(self, batches: Iterator[tuple[DataProto, dict[str, Any]]]) -> None:
        self._thread = threading.Thread(target=self._run, args=(batches,), name="rollout-producer", daemon=True)
        self._thread.start()

    def _run(self, batches: Iterator[tuple[DataProto, dict[str, Any]]]) -> None:
        try:
            index = self._first_index = self.steps_done
            for batch, loader_state in batches:
                if index >= self.total_steps and not self.batches_per_step_vary:
                    break
                waited = time.monotonic()
                with self._cond:
                    self._cond.wait_for(lambda i=index: self._stop.is_set() or self._may_roll_out(i))
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

    def _may_roll_out(self, index: int) -> bool:
        """Whether batch `index` may start rolling out now (call with the condition held). One batch a
        step: batch j trains at step j + 1, so it may start once j - steps done <= bound. Batches per
        step varying: at most bound - 1 wait in the queue untaken; a batch rolled out now is taken after
        those, each of which may end a step, and one update in flight: at most bound updates stale."""
        if self.batches_per_step_vary:
            return (index - self._first_index) - self.taken <= self.bound - 1
        return index - self.steps_done <= self.bound

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
        with self._cond:
            self.taken += 1
            self._cond.notify_all()
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


def rollout_pool_config(actor_rollout_ref: DictConfig) -> DictConfig:
    """A pipelined run's rollout workers' config: the actor_rollout_ref tree, with the vLLM engine kept
    awake between rollouts (`rollout.free_cache_engine=false`): no trainer shares those GPUs, and the
    engine's weights are the only copy there (pushes load into it; sleeping would discard them)."""
    config = copy.deepcopy(actor_rollout_ref)
    with open_dict(config):
        config.rollout.free_cache_engine = False
    return config


class PipelinedTraining:
    """The trainer's pipelined run (mixed into RayPPOTrainer): its rollout pool, the weight pushes, and
    the loop that trains on the producer's batches. Reads the trainer's worker groups, dataloader and
    step pieces (`_rollout`, `_train_on`, `_step_metrics`)."""

    _rollout_pool_wg: Any = None   # a pipelined run's rollout pool (see rollout_wg)
    _producer: RolloutProducer | None = None   # while fit() runs

    @property
    def rollout_wg(self) -> Any:
        """The workers that generate: the actor's (sync), or a pipelined run's rollout pool."""
        return self._rollout_pool_wg if self._rollout_pool_wg is not None else self.actor_rollout_wg

    def _init_rollout_pool(self, config: DictConfig) -> None:
        """A pipelined run's rollout workers (role rollout: the engine alone, with the model's weights
        in its compute dtype; no FSDP copy, no optimizer) on their own pool, and the weight-sync group
        of the train pool's rank 0 and them. Pushes carry the engine's dtype (verl/workers/weight_sync.py)."""
        from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup

        pool = self.resource_pool_manager.get_resource_pool(Role.Rollout)
        cls = RayClassWithInitArgs(self.role_worker_mapping[Role.Rollout], config=rollout_pool_config(config),
                                   role="rollout")
        self._rollout_pool_wg = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=cls)
        self._worker_groups.append(self._rollout_pool_wg)
        self.rollout_wg.init_model()
        manifest = join_weight_sync(self.actor_rollout_wg, self.rollout_wg)
        logger.info("pipeline %s: train pool of %d worker(s), rollout pool of %d; a push sends %d tensors, %.3f GB in %s",
                    self.config.trainer.pipeline, self.world_size, self.rollout_wg.world_size, len(manifest.tensors),
                    manifest.nbytes / 1e9, manifest.dtype)

    def _push_weights(self) -> int:
        """The train pool's weights to the rollout pool; returns the bytes the sender broadcast."""
        return push_weights(self.actor_rollout_wg, self.rollout_wg)

    def _updating(self) -> AbstractContextManager:
        """Around an actor update and the step count after it: a pipelined run pushes no weights meanwhile."""
        return self._producer.updating() if self._producer is not None else nullcontext()

    def _drawn_batches(self) -> Iterator[tuple[DataProto, dict[str, Any]]]:
        """Every training batch from the dataloader's position on, epoch after epoch, each with the
        dataloader's state right after it was drawn."""
        while True:
            for batch in self.train_dataloader:
                yield batch, self.train_dataloader.state_dict()

    def _fit_pipelined(self, tracker: Tracking, bar: Any) -> None:
        """trainer.pipeline=one_step_off|async: the producer rolls out on the rollout pool while this
        thread trains (verl/trainer/ppo/pipeline.py)."""
        bound = staleness_bound(self.config)
        sampling = self.run.sampling.enable   # dynamic sampling: several generation batches a step
        self._producer = producer = RolloutProducer(self._rollout, self._push_weights, self.global_step,
                                                    self.total_training_steps, bound, self._rollout_version,
                                                    batches_per_step_vary=sampling)
        if bool(self.config.actor_rollout_ref.rollout.get("partial", False)):
            # partial rollout: newer weights reach the rollout in flight between two turns
            self._generation_manager(validation=False).turn_version = producer.refresh
        producer.start(self._drawn_batches())
        clock = mu.StepClock()
        while self.global_step < self.total_training_steps:
            item, train_idle = producer.next_batch()
            if item is None:
                break
            if self.global_step - item.version > bound:
                producer.stats.dropped += 1
                logger.warning("dropped batch %d: sampled by version %d, %d steps stale (bound %d)", item.index,
                               item.version, self.global_step - item.version, bound)
                continue
            metrics, timing = item.metrics, item.timing
            metrics.update(producer.metrics(item, self.global_step, train_idle))
            self._trained_loader_state = item.loader_state
            batch = item.batch
            if sampling:   # pipeline/* metrics: the mean over the step's generation batches
                taken = self._collect_groups(batch, metrics, timing)
                if taken is None:
                    continue
                batch, metrics, timing = taken
            self._profiler.begin(self.global_step + 1)   # global_profiler: the training side of the step
            with mu.timer("step", timing):
                batch = self._train_on(batch, metrics, timing)
            self._profiler.end(self.global_step)
            metrics = self._step_metrics(batch, metrics, timing)
            # the pass over the data of the step's (last) batch: batch j of a run drawn in pass j // batches a pass
            metrics["train/epoch"] = float(item.index // len(self.train_dataloader))
            metrics.update(clock.lap())
            tracker.log(metrics, step=self.global_step)
            self.history.append({"step": self.global_step, **metrics})
            bar.update(1)
