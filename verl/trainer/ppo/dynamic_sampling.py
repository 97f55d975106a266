"""DAPO's dynamic sampling (`algorithm.filter_groups`, veRL's keys): drop the groups (rows sharing a
uid) whose filter metric is the same for every sample, since their GRPO advantages are all zero;
keep generating batches of `data.gen_batch_size` prompts until `data.train_batch_size` prompts'
groups are kept, then train on exactly that many.

    sampling = FilterGroups.from_config(cfg)
    collector = GroupCollector(sampling, train_batch_size, pad_token_id)
    collector.add(scored_batch)             # rows of kept groups accumulate (scored: reward_shaping)
    if collector.ready: batch, metrics = collector.take()
    else: collector.check_cap()             # DynamicSamplingError at max_num_gen_batches (veRL raises too)

Metrics (veRL's `train/num_gen_batches`, plus the group counts): train/num_gen_batches,
train/filter_groups/{generated,kept,filtered,filtered_ratio,unused}; `unused` are kept groups past the
batch, dropped when the batch is trimmed (veRL drops them too).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from omegaconf import DictConfig

from verl.trainer.config_schema import ConfigError
from verl.trainer.ppo.reward_shaping import ACC, SCORE, SEQ_REWARD
from verl.utils import batch_keys as K

if TYPE_CHECKING:   # verl.protocol imports tensordict (and with it torch._dynamo): preflight's config checks read
    from verl.protocol import DataProto  # this module's settings without it

SEQ_FINAL_REWARD = "seq_final_reward"
METRICS = (ACC, SCORE, SEQ_REWARD, SEQ_FINAL_REWARD)
# Tensors whose first columns are the (left-padded) prompt; of those, the ones that also hold the response.
_PROMPT_ALIGNED = (K.PROMPTS, K.INPUT_IDS, K.ATTENTION_MASK, K.POSITION_IDS, K.INFO_MASK)
_FULL_SEQUENCE = (K.INPUT_IDS, K.ATTENTION_MASK, K.POSITION_IDS, K.INFO_MASK)
_PAD_WITH_TOKEN = (K.PROMPTS, K.INPUT_IDS, K.RESPONSES)


class DynamicSamplingError(RuntimeError):
    """algorithm.filter_groups.max_num_gen_batches generation batches kept too few groups."""


@dataclass(frozen=True)
class FilterGroups:
    """`algorithm.filter_groups` and `data.gen_batch_size` (prompts per generation batch)."""

    enable: bool = False
    metric: str = ACC
    max_num_gen_batches: int = 0        # <= 0: no cap (veRL)
    gen_batch_size: int = 0             # prompts per generation batch; the train batch size when null

    @classmethod
    def from_config(cls, cfg: DictConfig) -> FilterGroups:
        node = cfg.algorithm.get("filter_groups") or {}
        train = int(cfg.data.train_batch_size)
        gen = cfg.data.get("gen_batch_size")
        enable = bool(node.get("enable", False))
        metric = node.get("metric") or ACC
        cap = node.get("max_num_gen_batches", 0)
        errors = []
        if metric not in METRICS:
            errors.append(f"algorithm.filter_groups.metric={metric!r} is unknown; choose one of {list(METRICS)} "
                          "(null = acc)")
        if isinstance(cap, bool) or not isinstance(cap, int):
            errors.append(f"algorithm.filter_groups.max_num_gen_batches={cap!r} must be an int (<= 0: no cap)")
        if gen is not None and (isinstance(gen, bool) or not isinstance(gen, int) or gen < train):
            errors.append(f"data.gen_batch_size={gen!r} must be an int >= data.train_batch_size={train} "
                          "(null = data.train_batch_size)")
        if errors:
            raise ConfigError(errors[0], errors)
        return cls(enable=enable, metric=str(metric), max_num_gen_batches=int(cap),
                   gen_batch_size=train if gen is None else int(gen))


def metric_values(batch: DataProto, metric: str) -> np.ndarray:
    """The filter metric per row: a non-tensor written by reward_shaping.score_rollouts, or the row's
    reward total (`seq_final_reward`: token_level_rewards, else token_level_scores)."""
    if metric == SEQ_FINAL_REWARD:
        key = K.TOKEN_LEVEL_REWARDS if K.TOKEN_LEVEL_REWARDS in batch.batch.keys() else K.TOKEN_LEVEL_SCORES
        return batch.batch[key].sum(-1).cpu().double().numpy()
    if metric not in batch.non_tensor_batch:
        raise KeyError(f"algorithm.filter_groups.metric={metric!r}: the scored batch has no per-row {metric!r}")
    return np.asarray(batch.non_tensor_batch[metric], dtype=np.float64)


def kept_rows(uids: Sequence[Any], values: Sequence[float]) -> np.ndarray:
    """Bool per row: its group (same uid) has metric values that differ (std > 0), or only one row (veRL)."""
    groups: dict[Any, list[float]] = {}
    for uid, value in zip(uids, values, strict=True):
        groups.setdefault(uid, []).append(float(value))
    kept = {uid for uid, vals in groups.items() if len(vals) == 1 or float(np.std(vals)) > 0}
    return np.array([uid in kept for uid in uids], dtype=bool)


def _pad(tensor: torch.Tensor, left: int, right: int, value: int | float, key: str) -> torch.Tensor:
    if left == 0 and right == 0:
        return tensor
    parts = []
    if left:
        parts.append(torch.full((tensor.shape[0], left, *tensor.shape[2:]), value, dtype=tensor.dtype,
                                device=tensor.device))
    parts.append(tensor)
    if right:
        if key == K.POSITION_IDS:   # positions run on past the last token, as a generation's padding does
            last = tensor[:, -1:]
            parts.append(last + torch.arange(1, right + 1, dtype=tensor.dtype, device=tensor.device))
        else:
            parts.append(torch.full((tensor.shape[0], right, *tensor.shape[2:]), value, dtype=tensor.dtype,
                                    device=tensor.device))
    return torch.cat(parts, dim=1)


def concat_padded(parts: Sequence[DataProto], pad_token_id: int) -> DataProto:
    """Stack rolled-out batches whose prompt (left-padded) or response (right-padded) widths differ:
    each is padded to the widest prompt and response first. meta_info from the first; the rollout
    log-prob match flag holds only if it holds for every part."""
    from verl.protocol import DataProto

    parts = [p for p in parts if len(p) > 0]
    if len(parts) <= 1:
        return parts[0] if parts else DataProto()
    widths = [(p.batch[K.PROMPTS].shape[-1], p.batch[K.RESPONSES].shape[-1]) for p in parts]
    prompt_w, resp_w = max(w[0] for w in widths), max(w[1] for w in widths)
    padded = []
    for part, (p_w, r_w) in zip(parts, widths, strict=True):
        if (p_w, r_w) != (prompt_w, resp_w):
            part = DataProto(batch=part.batch.clone(), non_tensor_batch=dict(part.non_tensor_batch),
                             meta_info=dict(part.meta_info))
            for key in list(part.batch.keys()):
                tensor = part.batch[key]
                value = pad_token_id if key in _PAD_WITH_TOKEN else (-1 if key == K.TOKEN_VERSIONS else 0)
                left = prompt_w - p_w if key in _PROMPT_ALIGNED else 0
                right = resp_w - r_w if key in _FULL_SEQUENCE or (key not in _PROMPT_ALIGNED
                                                                  and tensor.dim() >= 2) else 0
                if key not in _PROMPT_ALIGNED and tensor.dim() >= 2 and tensor.shape[1] != r_w:
                    raise ValueError(f"dynamic sampling: batch key {key!r} has width {tensor.shape[1]}, "
                                     f"neither the response's ({r_w}) nor a prompt-aligned key")
                part.batch[key] = _pad(tensor, left, right, value, key)
        padded.append(part)
    out = DataProto.concat(padded)
    match = all(bool(p.meta_info.get(K.META_ROLLOUT_LOG_PROBS_MATCH_ACTOR, True)) for p in parts)
    if K.META_ROLLOUT_LOG_PROBS_MATCH_ACTOR in out.meta_info:
        out.meta_info[K.META_ROLLOUT_LOG_PROBS_MATCH_ACTOR] = match
    return out


class GroupCollector:
    """Kept groups over the generation batches of one training step (veRL's accumulation)."""

    def __init__(self, sampling: FilterGroups, train_batch_size: int, pad_token_id: int) -> None:
        self.sampling = sampling
        self.train_batch_size = int(train_batch_size)
        self.pad_token_id = int(pad_token_id)
        self.reset()

    def reset(self) -> None:
        self.parts: list[DataProto] = []
        self.num_gen_batches = 0
        self.generated = 0
        self.kept = 0
        self.metrics: list[dict[str, float]] = []   # each generation batch's rollout / reward metrics
        self.timing: dict[str, float] = {}          # summed over the generation batches

    def add(self, batch: DataProto, metrics: dict[str, float] | None = None) -> None:
        """Count one generation batch; keep the rows of its groups whose metric varies."""
        uids = batch.non_tensor_batch[K.UID]
        mask = kept_rows(uids, metric_values(batch, self.sampling.metric))
        self.num_gen_batches += 1
        self.generated += len(set(uids.tolist()))
        self.kept += len(set(uids[mask].tolist()))
        if mask.any():
            self.parts.append(batch.select_idxs(np.nonzero(mask)[0]))
        self.metrics.append(dict(metrics or {}))

    @property
    def ready(self) -> bool:
        return self.kept >= self.train_batch_size

    def check_cap(self) -> None:
        """Raise when the cap is reached with too few groups (veRL raises too: the data or the
        metric leaves too few groups with signal)."""
        cap = self.sampling.max_num_gen_batches
        if not self.ready and cap > 0 and self.num_gen_batches >= cap:
            raise DynamicSamplingError(
                f"dynamic sampling: {self.num_gen_batches} generation batches of {self.sampling.gen_batch_size} "
                f"prompts kept {self.kept} groups whose algorithm.filter_groups.metric={self.sampling.metric!r} "
                f"varies, fewer than data.train_batch_size={self.train_batch_size}, and "
                f"algorithm.filter_groups.max_num_gen_batches={cap} is reached: raise it (<= 0: no cap), raise "
                "data.gen_batch_size or rollout.n, or check the data (all groups right or all wrong)")

    def take(self) -> tuple[DataProto, dict[str, float]]:
        """The first train_batch_size kept groups (all their rows) and the step's filtering metrics; resets."""
        if not self.ready:
            raise RuntimeError(f"take() with {self.kept} groups kept, fewer than {self.train_batch_size}")
        batch = concat_padded(self.parts, self.pad_token_id)
        uids = batch.non_tensor_batch[K.UID]
        chosen = set(list(dict.fromkeys(uids.tolist()))[: self.train_batch_size])   # first in row order
        rows = np.array([i for i, uid in enumerate(uids.tolist()) if uid in chosen])
        batch = batch.select_idxs(rows)
        metrics = {key: float(np.mean([m[key] for m in self.metrics if key in m]))
                   for key in {k for m in self.metrics for k in m}}
        filtered = self.generated - self.kept
        metrics.update({
            "train/num_gen_batches": float(self.num_gen_batches),
            "train/filter_groups/generated": float(self.generated),
            "train/filter_groups/kept": float(self.kept),
            "train/filter_groups/filtered": float(filtered),
            "train/filter_groups/filtered_ratio": filtered / max(self.generated, 1),
            "train/filter_groups/unused": float(self.kept - self.train_batch_size),
        })
        self.reset()
        return batch, metrics


class DynamicSamplingTraining:
    """RayPPOTrainer's dynamic-sampling step (algorithm.filter_groups.enable): the fit loop hands it
    each dataloader batch (data.gen_batch_size prompts); it trains once enough groups are kept."""

    _collector: GroupCollector | None = None

    def _sampling_step(self: Any, batch: DataProto) -> dict[str, float] | None:
        """Roll out and score one generation batch, keep its varying groups; once data.train_batch_size
        prompts' groups are kept, train on them and return the step's metrics (None until then).
        Raises DynamicSamplingError at algorithm.filter_groups.max_num_gen_batches."""
        from verl.trainer.ppo import metric_utils as mu

        collector, metrics = self._group_collector(), {}
        with mu.timer("step", collector.timing):
            batch = self._rollout(batch, self.global_step, metrics, collector.timing)
        taken = self._collect_groups(batch, metrics, {})
        if taken is None:
            return None
        batch, metrics, timing = taken
        with mu.timer("step", timing):
            batch = self._train_on(batch, metrics, timing)
        return self._step_metrics(batch, metrics, timing)

    def _group_collector(self: Any) -> GroupCollector:
        if self._collector is None:
            self._collector = GroupCollector(self.run.sampling, int(self.config.data.train_batch_size),
                                             self.tokenizer.pad_token_id)
        return self._collector

    def _collect_groups(self: Any, batch: DataProto, metrics: dict[str, float], timing: dict[str, float]
                        ) -> tuple[DataProto, dict[str, float], dict[str, float]] | None:
        """Score one rolled-out generation batch and keep its varying groups (its `timing` added to the
        step's); once data.train_batch_size prompts' groups are kept, the step's (batch, metrics, timing),
        else None. Raises DynamicSamplingError at algorithm.filter_groups.max_num_gen_batches. The sync
        loop (`_sampling_step`) and the pipelines (the trainer thread, on the producer's batches) call it."""
        from verl.trainer.ppo import metric_utils as mu
        from verl.trainer.ppo.reward_shaping import OverlongBuffer, score_rollouts

        collector = self._group_collector()
        for key, seconds in timing.items():
            collector.timing[key] = collector.timing.get(key, 0.0) + seconds
        with mu.timer("step", collector.timing):
            metrics.update(score_rollouts(self.reward_fn, batch, OverlongBuffer.from_config(self.config),
                                          int(self.config.data.max_response_length), row_values=True))
        collector.add(batch, metrics)
        if not collector.ready:
            collector.check_cap()
            return None
        timing = collector.timing
        batch, metrics = collector.take()
        return batch, metrics, timing
