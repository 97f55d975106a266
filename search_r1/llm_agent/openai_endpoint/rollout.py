"""The `openai_agent` rollout: the user's agent on every row, through the endpoint, into a training batch.

Async mode (rollout.mode=async): each rollout worker runs its shard's agents against an endpoint it serves
over its own engine's continuous batching (`agent_shard`, the worker's `generate_agent_samples`); the
driver composes their results as below.

Sync mode (rollout.mode=sync): the driver serves the endpoint; its requests are gathered into one
`generate_sequences` call of the worker group per wave (engines.BatchedClient over the manager's own
`_generate`). The batch it returns has one row per *sample*: a row whose agent failed has none (dropped),
a row whose agent broke its prefix chain has several; `meta_info[SAMPLE_ROWS]` names each sample's source
row, and the trainer repeats the rows' fields to match (`select_samples`), so a row's samples share its
uid (GRPO group), ground truth and reward. Metrics: agent/failures, agent/prefix_breaks, agent/samples,
agent/completions, agent/timeouts, agent/context_exceeded, agent/sampling_ignored (docs/agent.md).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from search_r1.llm_agent import actions, tools
from search_r1.llm_agent.openai_endpoint.agents import (
    AgentSettings,
    RowResult,
    Running,
    agent_rows,
    check_failures,
    count_results,
    endpoint_counters,
    load_agent,
    run_agents,
)
from search_r1.llm_agent.openai_endpoint.engines import BatchedClient, StepEngineClient
from search_r1.llm_agent.openai_endpoint.server import Endpoint, EndpointLimits
from search_r1.llm_agent.openai_endpoint.sessions import Sample
from search_r1.llm_agent.trajectory import _Row
from verl.utils import batch_keys as K

SAMPLE_ROWS = "agent_sample_rows"        # meta_info: each sample's row in the generation batch
AGENT_OUTPUTS = "agent_outputs"          # meta_info: each sample's agent return value
AGENT_OUTPUT = "agent_output"            # the key of extra_info that carries it to the reward function
# Async mode (generate_agent_samples): the rows' fields in, each row's RowResult and each shard's endpoint
# counters (on its first row; {} on the others) out; the agent settings in meta_info.
AGENT_ROW = "agent_row"
AGENT_FIELDS = "agent_fields"
AGENT_RESULTS = "agent_results"
AGENT_ENDPOINT_COUNTERS = "agent_endpoint_counters"
AGENT_SETTINGS = "openai_agent"
# The engine stops a completion at the end of its first tool call, as the tool protocol's engine does
# (veRL's max_parallel_calls=1): the call comes back at once, and no decoding is spent past it.
DEFAULT_STOP = (tools.TOOL_CALL_CLOSE,)


def settings_dict(config: Any) -> dict | None:
    """GenerationConfig.openai_agent from the trainer config (plain types; None: off)."""
    node = config.get("openai_agent")
    settings = AgentSettings.from_config(node)
    if settings is None:
        return None
    stop = node.get("stop")
    return {"path": settings.path, "name": settings.name, "concurrency": settings.concurrency,
            "timeout": settings.timeout, "max_failure_fraction": settings.max_failure_fraction,
            "stop": list(DEFAULT_STOP if stop is None else stop),
            "max_prompt_length": int(config.data.max_prompt_length),
            "max_response_length": int(config.data.max_response_length)}


def _stop_reason(sample: Sample, text: Any) -> str:
    if sample.finish_reason == "length":
        return actions.CONTEXT_FULL
    if sample.finish_reason == "tool_calls":
        return actions.MAX_TURNS      # the agent ended on a call it did not answer
    last = sample.turns[-1][0] if sample.turns else []
    return actions.ANSWERED if tools.has_answer(text.decode(last)) else actions.EOS


def _as_row(sample: Sample, text: Any) -> _Row:
    row = _Row(prompt_ids=list(sample.prompt_ids))
    for completion, inserted, log_probs in sample.turns:
        row.append_turn(list(completion), list(inserted), list(log_probs))
    row.n_turns = len(sample.turns)
    row.n_valid_actions = sample.tool_calls + int(tools.has_answer(text.decode(sample.turns[-1][0])))
    row.n_searches = sample.tool_calls
    row.stop_reason = _stop_reason(sample, text)
    return row


def compose(manager: Any, results: Sequence[RowResult], counters: Counter[str], timing: dict[str, float],
            multiple: int = 1) -> Any:
    """The batch of every sample (left-padded prompts, the manager's composition); meta_info names each
    sample's row. Trimmed to a multiple of `multiple` samples (the trainer's data-parallel size): the
    last ones are dropped and counted (agent/samples_trimmed)."""
    from search_r1.llm_agent.tensor_helper import left_pad
    from search_r1.llm_agent.token_text import TokenText

    text = TokenText(manager.tokenizer)
    picked = [(r.row, sample, r.output) for r in results for sample in r.samples]
    keep = len(picked) - len(picked) % max(1, int(multiple))
    counters["samples_trimmed"] += len(picked) - keep
    picked = picked[:keep]
    if not picked:
        raise RuntimeError(f"no sample to train on: {counters['failures']} of {len(results)} agents failed and the "
                           "others made no completion (see the log for each row's error)")
    rows = [_as_row(sample, text) for _, sample, _ in picked]
    prompts, prompt_mask = left_pad([row.prompt_ids for row in rows], manager.tokenizer.pad_token_id)
    stats: Counter[str] = Counter({"tool_calls": sum(s.tool_calls for _, s, _ in picked),
                                   "generated_tokens": sum(len(c) for _, s, _ in picked for c, _, _ in s.turns)})
    stats["kept_tokens"] = stats["generated_tokens"]
    output = manager._compose_final_output(rows, prompts.long(), prompt_mask.long(), stats, timing)
    n_rows = max(1, len(results))
    agent_metrics = {f"agent/{k}": float(v) for k, v in sorted(counters.items())}
    agent_metrics["agent/failure_fraction"] = counters["failures"] / n_rows
    # tool_stats' entries become metrics under their own names (metric_utils.compute_env_metrics)
    output.meta_info.setdefault("tool_stats", {}).update(agent_metrics)
    output.meta_info[SAMPLE_ROWS] = [row for row, _, _ in picked]
    output.meta_info[AGENT_OUTPUTS] = [out for _, _, out in picked]
    return output


def _settings(cfg: dict) -> AgentSettings:
    return AgentSettings(**{k: cfg[k] for k in ("path", "name", "concurrency", "timeout", "max_failure_fraction")})


def _limits(cfg: dict, settings: AgentSettings, call_seed: int = 0) -> EndpointLimits:
    return EndpointLimits(max_prompt_length=int(cfg["max_prompt_length"]), max_response_length=int(cfg["max_response_length"]),
                          max_concurrent_requests=max(64, 2 * settings.concurrency), call_seed=int(call_seed))


def agent_rollout(manager: Any, fields: Sequence[dict], meta: dict[str, Any], eos_token_ids: frozenset[int]) -> Any:
    """Every row's agent against the endpoint (`fields`: each row's non-tensor fields); returns the composed
    samples. Sync mode: the driver serves the endpoint over the worker group (one `generate_sequences` a
    wave). Async mode: each rollout worker serves its shard's rows over its own engine's continuous batching
    (`generate_agent_samples`, `agent_shard`)."""
    cfg = dict(manager.config.openai_agent)
    settings = _settings(cfg)
    n = len(fields)
    call_meta = {**meta, K.META_STOP: list(cfg.get("stop") or [])}
    start = time.perf_counter()
    if manager.config.mode == "async":
        results, counters = _worker_results(manager, fields, call_meta, cfg)
    else:
        agent = load_agent(settings)
        running = Running(n)

        def generate_batch(prompts: list[list[int]], length: int) -> tuple[list[list[int]], list[list[float]] | None]:
            return manager._generate(prompts, {**call_meta, K.META_RESPONSE_LENGTH: int(length)})

        client = BatchedClient(generate_batch, response_length=int(cfg["max_response_length"]), running=running)
        endpoint = Endpoint(manager.tokenizer, client, _limits(cfg, settings), eos_token_ids)
        results, counters = run_agents(agent, endpoint, agent_rows(fields), settings, running)
        counters["engine_calls"] += client.calls
    where = "validation" if manager.is_validation else "rollout"
    check_failures(counters, n, settings, where)
    timing = {"generate": time.perf_counter() - start, "retrieval": 0.0}
    return compose(manager, results, counters, timing, multiple=1 if manager.is_validation else manager.config.num_gpus)


def _worker_results(manager: Any, fields: Sequence[dict], call_meta: dict[str, Any],
                    cfg: dict) -> tuple[list[RowResult], Counter[str]]:
    """Async mode: the rows split over the rollout workers (`generate_agent_samples`); each result's row is
    its index in this batch. The dispatch pads the batch to a multiple of the workers with copies of its
    first rows: their agents run too and are dropped here (the endpoint counters of their worker count them)."""
    from verl.protocol import DataProto

    column = np.empty(len(fields), dtype=object)
    column[:] = [dict(f) for f in fields]
    batch = DataProto.from_dict(tensors={AGENT_ROW: torch.arange(len(fields))}, non_tensors={AGENT_FIELDS: column},
                                meta_info={**call_meta, AGENT_SETTINGS: cfg})
    out = manager.actor_rollout_wg.generate_agent_samples(batch)
    # whether the engine's log-probs are the actor's quantity (vLLM with truncated sampling: not), as
    # generate_trajectories reports it; the composed batch carries it to rollout correction
    manager._log_probs_match_actor = bool(out.meta_info.get(K.META_ROLLOUT_LOG_PROBS_MATCH_ACTOR, True))
    results = list(out.non_tensor_batch[AGENT_RESULTS])
    if len(results) != len(fields):
        raise ValueError(f"generate_agent_samples returned {len(results)} rows for {len(fields)}")
    for index, result in enumerate(results):
        result.row = index
    counters = count_results(results)
    for shard in out.non_tensor_batch[AGENT_ENDPOINT_COUNTERS]:
        counters.update(shard)
    return results, counters


def agent_shard(tokenizer: Any, cfg: dict, step_engine: Any, fields: Sequence[dict], eos_token_ids: frozenset[int],
                call_seed: int) -> tuple[list[RowResult], Counter[str]]:
    """Async mode, in a rollout worker: its rows' agents against an endpoint it serves over `step_engine`
    (continuous batching, a seed per request from `call_seed`, the session and the request's position);
    returns each row's result and the endpoint's counters."""
    settings = _settings(cfg)
    endpoint = Endpoint(tokenizer, StepEngineClient(step_engine, int(cfg["max_response_length"])),
                        _limits(cfg, settings, call_seed), eos_token_ids)
    results, _ = run_agents(load_agent(settings), endpoint, agent_rows(fields), settings)
    return results, endpoint_counters(endpoint)


def select_samples(batch: Any, gen_meta: dict[str, Any]) -> Any:
    """The trainer's side: the generation batch's rows repeated to match the samples (each sample gets its
    row's uid, data source, ground truth), each sample's extra_info carrying its agent's return value."""
    if SAMPLE_ROWS not in gen_meta:
        return batch
    rows = gen_meta.pop(SAMPLE_ROWS)
    outputs = gen_meta.pop(AGENT_OUTPUTS, None) or [None] * len(rows)
    picked = batch.select_idxs(torch.tensor(rows, dtype=torch.long)) if len(batch) else batch
    infos = picked.non_tensor_batch.get(K.EXTRA_INFO)
    if infos is not None:
        merged = np.empty(len(rows), dtype=object)
        merged[:] = [{**(dict(info) if isinstance(info, dict) else {}), AGENT_OUTPUT: out}
                     for info, out in zip(infos, outputs, strict=True)]
        picked.non_tensor_batch[K.EXTRA_INFO] = merged
    return picked


__all__ = ["AGENT_ENDPOINT_COUNTERS", "AGENT_FIELDS", "AGENT_OUTPUT", "AGENT_OUTPUTS", "AGENT_RESULTS",
           "AGENT_SETTINGS", "SAMPLE_ROWS", "agent_rollout", "agent_shard", "compose", "select_samples",
           "settings_dict"]
