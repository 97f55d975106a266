"""Per-step metrics computed by the driver from the batch it sees (plain dicts of floats)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from verl.utils import batch_keys as K
from verl.utils.profiler import profiled_range


@contextmanager
def timer(name: str, timing_s: dict[str, float]) -> Iterator[None]:
    """Add the wall time of the block to timing_s[name]; the block is the range `name` in a global_profiler trace."""
    start = time.perf_counter()
    try:
        with profiled_range(name):
            yield
    finally:
        timing_s[name] = timing_s.get(name, 0.0) + time.perf_counter() - start


def host_cpu_times(stat_file: str = "/proc/stat") -> tuple[float, float] | None:
    """(busy, total) CPU time of this host, all CPUs and processes, in clock ticks since boot (Linux's
    /proc/stat; busy = user + nice + system + irq + softirq + steal); None where it is not readable."""
    try:
        with open(stat_file) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (float(x) for x in fields[1:9])
    busy = user + nice + system + irq + softirq + steal
    return busy, busy + idle + iowait


class StepClock:
    """From one training step's end to the next: `perf/step_wall_s`, and `perf/host_cpu_util`, the
    share of the driver host's CPU time that was busy meanwhile (every process: the workers on that
    host, a retrieval server, anything else). On a saturated host it is near 1, and no pipeline can
    then shorten the step without removing work; 1 / util of a sync run bounds what overlapping its
    idle time can gain on the same cores."""

    def __init__(self, stat_file: str = "/proc/stat") -> None:
        self._stat_file = stat_file
        self._wall, self._cpu = time.monotonic(), host_cpu_times(stat_file)

    def lap(self) -> dict[str, float]:
        wall, cpu = time.monotonic(), host_cpu_times(self._stat_file)
        out = {"perf/step_wall_s": wall - self._wall}
        if cpu is not None and self._cpu is not None and cpu[1] > self._cpu[1]:
            out["perf/host_cpu_util"] = (cpu[0] - self._cpu[0]) / (cpu[1] - self._cpu[1])
        self._wall, self._cpu = wall, cpu
        return out


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    if values.numel() == 0:
        return {}
    values = values.float()
    return {f"{prefix}/mean": values.mean().item(), f"{prefix}/max": values.max().item(),
            f"{prefix}/min": values.min().item()}


def compute_data_metrics(batch: Any, use_critic: bool) -> dict[str, float]:
    """score / rewards / advantages / returns / values, response and prompt lengths, state tokens."""
    tensors = batch.batch
    responses = tensors[K.RESPONSES]
    response_len_max = responses.shape[-1]
    attention_mask = tensors[K.ATTENTION_MASK]
    prompt_mask = attention_mask[:, :-response_len_max].bool()
    response_attn = attention_mask[:, -response_len_max:]
    response_mask_BR = tensors[K.RESPONSE_MASK].bool()

    prompt_length = prompt_mask.sum(-1).float()
    response_length = response_attn.sum(-1).float()
    metrics: dict[str, float] = {}
    metrics.update(_stats("critic/score", tensors[K.TOKEN_LEVEL_SCORES].sum(-1)))
    metrics.update(_stats("critic/rewards", tensors[K.TOKEN_LEVEL_REWARDS].sum(-1)))
    metrics.update(_stats("critic/advantages", tensors[K.ADVANTAGES][response_mask_BR]))
    metrics.update(_stats("critic/returns", tensors[K.RETURNS][response_mask_BR]))
    if use_critic and K.VALUES in tensors.keys():
        values = tensors[K.VALUES][response_mask_BR]
        returns = tensors[K.RETURNS][response_mask_BR]
        metrics.update(_stats("critic/values", values))
        if returns.numel() > 1:
            var_returns = torch.var(returns)
            metrics["critic/vf_explained_var"] = (1.0 - torch.var(returns - values) / (var_returns + 1e-5)).item()
    metrics.update(_stats("response_length", response_length))
    metrics["response_length/clip_ratio"] = (response_length == response_len_max).float().mean().item()
    metrics.update(_stats("prompt_length", prompt_length))
    metrics["prompt_length/clip_ratio"] = (prompt_length == prompt_mask.shape[-1]).float().mean().item()
    if K.INFO_MASK in tensors.keys():
        # state tokens = response tokens that are inserted observations, not sampled by the policy
        info_resp = tensors[K.INFO_MASK][:, -response_len_max:]
        state_tokens = (response_attn - info_resp).clamp(min=0).sum().float()
        metrics["state_tokens/total"] = state_tokens.item()
        metrics["state_tokens/coverage"] = (state_tokens / response_attn.sum().clamp(min=1)).item()
    return metrics


def compute_rollout_log_prob_gap(batch: Any) -> dict[str, float]:
    """|rollout log-prob - actor's recomputed old log-prob| over policy tokens, mean and max.

    The engine that sampled (vLLM, or the HF loop) and the trainer's forward should agree up to
    kernel rounding; a growing gap means the rollout is not the policy being trained (stale
    weights, a different temperature, bf16 drift), which biases the PPO ratio. Policy tokens are
    `loss_mask`'s, the tokens the engine sampled (response_mask when the rollout wrote none): with
    `actor.state_masking=false` response_mask holds observations too, which have no engine
    log-prob. Tokens sampled from a cut rolling context are excluded (their context differed from
    the one the actor sees)."""
    if K.ROLLOUT_LOG_PROBS not in batch.batch.keys() or K.OLD_LOG_PROBS not in batch.batch.keys():
        return {}
    if not batch.meta_info.get(K.META_ROLLOUT_LOG_PROBS_MATCH_ACTOR, True):
        # vLLM renormalised its log-probs over the top-k / top-p set at a temperature other than 1:
        # not the actor's full-softmax quantity, so a gap would measure the truncation, not drift.
        return {"rollout/log_prob_gap_comparable": 0.0}
    sampled = K.LOSS_MASK if K.LOSS_MASK in batch.batch.keys() else K.RESPONSE_MASK
    mask = batch.batch[sampled].bool()
    if K.CONTEXT_CUT_MASK in batch.batch.keys():
        mask = mask & ~batch.batch[K.CONTEXT_CUT_MASK].bool()
    if not bool(mask.any()):
        return {}
    gap = (batch.batch[K.ROLLOUT_LOG_PROBS].float() - batch.batch[K.OLD_LOG_PROBS].float()).abs()[mask]
    return {"rollout/log_prob_gap_mean": float(gap.mean()), "rollout/log_prob_gap_max": float(gap.max())}


def compute_rollout_metrics(gen_meta: dict[str, Any]) -> dict[str, float]:
    """rollout/engine_wake_ups: how often the rollout engines woke during the step's rollout (1 when
    a multi-turn rollout keeps them awake across its turns, as it should). rollout/weight_sync_bytes:
    bytes the latest weight sync sent to a vLLM engine (LoRA's adapter, or the full weights).
    timing_s/rollout_wake, timing_s/rollout_sleep: seconds the vLLM engine's wake_up / sleep took in
    the step's rollout (GPU; at level 1, lora_sync=adapter, a host round trip of the base weights);
    rollout/sleep_host_bytes: what its sleep backed up to host memory (per engine rank)."""
    metrics = {}
    if "engine_wake_ups" in gen_meta:
        metrics["rollout/engine_wake_ups"] = float(gen_meta["engine_wake_ups"])
    if "weight_sync_bytes" in gen_meta:
        metrics["rollout/weight_sync_bytes"] = float(gen_meta["weight_sync_bytes"])
    for key, name in (("rollout_wake_s", "timing_s/rollout_wake"), ("rollout_sleep_s", "timing_s/rollout_sleep"),
                      ("sleep_host_bytes", "rollout/sleep_host_bytes")):
        if key in gen_meta:
            metrics[name] = float(gen_meta[key])
    return metrics


def compute_timing_metrics(batch: Any, timing_s: dict[str, float]) -> dict[str, float]:
    """timing_s/<stage> and timing_per_token_ms/<stage> (per token the stage processed)."""
    tensors = batch.batch
    response_len_max = tensors[K.RESPONSES].shape[-1]
    attention_mask = tensors[K.ATTENTION_MASK]
    n_response_tokens = attention_mask[:, -response_len_max:].sum().item()
    n_all_tokens = attention_mask.sum().item()
    tokens_of_stage = {"gen": n_response_tokens}
    metrics = {f"timing_s/{name}": value for name, value in timing_s.items()}
    for name, value in timing_s.items():
        if name in ("step", "testing", "save_checkpoint"):
            continue
        n = tokens_of_stage.get(name, n_all_tokens)
        metrics[f"timing_per_token_ms/{name}"] = value * 1000.0 / max(n, 1)
    return metrics


def compute_throughput_metrics(batch: Any, timing_s: dict[str, float], n_workers: int) -> dict[str, float]:
    total_tokens = float(batch.batch[K.ATTENTION_MASK].sum().item())
    step_time = max(timing_s.get("step", 0.0), 1e-9)
    return {"perf/total_num_tokens": total_tokens, "perf/time_per_step": step_time,
            "perf/throughput": total_tokens / step_time / max(n_workers, 1)}


def compute_env_metrics(meta_info: dict[str, Any]) -> dict[str, float]:
    """env/* from the generation manager's per-trajectory statistics (do_search=true)."""
    metrics: dict[str, float] = {}
    if "turns_stats" in meta_info:
        metrics.update(_stats("env/number_of_actions", torch.as_tensor(np.asarray(meta_info["turns_stats"]))))
    if "active_mask" in meta_info:
        active = np.asarray(meta_info["active_mask"], dtype=np.float64)
        metrics["env/finish_ratio"] = float(1.0 - active.mean()) if active.size else 0.0
    if "valid_action_stats" in meta_info:
        valid = np.asarray(meta_info["valid_action_stats"], dtype=np.float64)
        metrics["env/number_of_valid_action"] = float(valid.mean()) if valid.size else 0.0
        if "turns_stats" in meta_info:
            turns = np.asarray(meta_info["turns_stats"], dtype=np.float64)
            metrics["env/ratio_of_valid_action"] = float((valid / np.maximum(turns, 1)).mean()) if valid.size else 0.0
    if "valid_search_stats" in meta_info:
        searches = np.asarray(meta_info["valid_search_stats"], dtype=np.float64)
        metrics["env/number_of_valid_search"] = float(searches.mean()) if searches.size else 0.0
    if "valid_open_stats" in meta_info:   # the tag protocol's open tag (open_tag.enable): opens per row
        opens = np.asarray(meta_info["valid_open_stats"], dtype=np.float64)
        metrics["env/number_of_valid_open"] = float(opens.mean()) if opens.size else 0.0
    for key in ("open_not_found", "open_failures"):
        if key in meta_info:
            metrics[f"env/{key}"] = float(np.asarray(meta_info[key], dtype=np.float64).sum())
    for key in ("search_failures", "obs_truncated", "context_cuts", "row_errors", "interaction_turns",
                "tool_calls", "tool_call_errors", "tool_response_truncated"):   # (the last three: tool protocol)
        if key in meta_info:
            metrics[f"env/{key}"] = float(np.asarray(meta_info[key], dtype=np.float64).sum())
    for key, value in (meta_info.get("agent_loop_stats") or {}).items():
        # agent loops: rows each loop rolled out (agent_loop/<name>/rows), responses cut to the bound
        metrics[f"env/{key}"] = float(value)
    for name, count in (meta_info.get("row_error_types") or {}).items():
        # a row whose turn raised got an error observation instead (the batch went on): by exception type
        metrics[f"env/row_errors/{name}"] = float(count)
    if "search_failures" in meta_info and "valid_search_stats" in meta_info:
        # valid_search_stats counts every search a row made, failed ones included
        searches = float(np.asarray(meta_info["valid_search_stats"], dtype=np.float64).sum())
        metrics["env/search_failure_fraction"] = metrics["env/search_failures"] / searches if searches else 0.0
    tool_stats = meta_info.get("tool_stats") or {}
    for key, value in tool_stats.items():
        # tools/<name>/calls, .../errors (tool protocol, per tool), .../latency_ms (total) and its mean per call
        metrics[key] = float(value)
        if key.endswith("/latency_ms"):
            calls = float(tool_stats.get(key.removesuffix("latency_ms") + "calls", 0.0))
            metrics[key + "_mean"] = float(value) / calls if calls else 0.0
    reasons = meta_info.get("stop_reasons") or {}
    n_rows = sum(reasons.values())
    for reason, count in reasons.items():
        # why trajectories ended, as a fraction of rows (answered, max_turns, context_full, ...)
        metrics[f"env/stop_reason/{reason}"] = count / max(n_rows, 1)
    for stage, seconds in (meta_info.get("timing_s") or {}).items():
        metrics[f"timing_s/gen_{stage}"] = float(seconds)
    return metrics


def reduce_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """Lists of per-micro-batch values (from update_*) become their mean."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if isinstance(value, list | tuple | np.ndarray):
            out[key] = float(np.mean(value)) if len(value) else float("nan")
        elif isinstance(value, torch.Tensor):
            out[key] = value.float().mean().item()
        else:
            out[key] = float(value)
    return out


def score_by_data_source(scores_B: torch.Tensor, data_sources: Any) -> dict[str, float]:
    """val/test_score/<data_source>: mean score per source."""
    grouped: dict[str, list[float]] = defaultdict(list)
    for score, source in zip(scores_B.tolist(), list(data_sources), strict=True):
        grouped[str(source)].append(score)
    return {f"val/test_score/{source}": float(np.mean(values)) for source, values in sorted(grouped.items())}


def row_metrics_by_data_source(rows: list[dict[str, float]], data_sources: Any) -> dict[str, float]:
    """val/test_<name>/<data_source>: mean of each per-row metric (f1, judge) over the rows that have it."""
    grouped: dict[tuple[str, str], list[float]] = defaultdict(list)
    for row, source in zip(rows, list(data_sources), strict=True):
        for name, value in row.items():
            grouped[(name, str(source))].append(float(value))
    return {f"val/test_{name}/{source}": float(np.mean(values)) for (name, source), values in sorted(grouped.items())}
