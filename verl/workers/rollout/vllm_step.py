"""vLLM's in-process engine stepped one request batch at a time (the async rollout's engine,
verl/workers/rollout/async_engine.py), and what it reads from vLLM's outputs. Used by vllm_rollout.py."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from verl.workers.rollout.async_engine import Completion, request_max_tokens


def lora_kwargs(lora_request: Any) -> dict[str, Any]:
    """add_request's LoRA argument: the actor's adapter, where the engine serves one (lora_sync=adapter)."""
    return {} if lora_request is None else {"lora_request": lora_request}


def sampled_ids_and_log_probs(output: Any) -> tuple[list[int], list[float]]:
    """A finished vLLM RequestOutput's sampled ids and each one's log-prob (requested with
    `logprobs=0`; an output without one per id is an error, not zeros: they are the rollout
    correction's and bypass mode's anchor)."""
    completion = output.outputs[0]
    ids = list(completion.token_ids)
    if ids and (completion.logprobs is None or len(completion.logprobs) != len(ids)):
        given = "none" if completion.logprobs is None else len(completion.logprobs)
        raise RuntimeError(f"vLLM returned {len(ids)} sampled ids but {given} log-probs for request "
                           f"{getattr(output, 'request_id', '?')}: sampling must request logprobs=0")
    return ids, [float(step[tok].logprob) for step, tok in zip(completion.logprobs or [], ids, strict=True)]


class VLLMStepEngine:
    """vLLM's in-process engine core, stepped by `AsyncEngine`.

    Why not `AsyncLLM`: it runs the engine core in another process, where the actor's weights
    cannot be reloaded in place; stepping the in-process `LLMEngine` gives the same continuous
    batching (requests added between steps join the running batch) with the hybrid engine's
    weight sync unchanged. When sampling, each request carries its own seed (what a trajectory
    samples must not depend on which others share its steps); greedy requests need none. Request
    ids carry this call's prefix, so they never collide with a failed call's leftovers."""

    def __init__(self, engine: Any, params: Any, prefix: str, seeded: bool = True, lora_request: Any = None) -> None:
        self.engine = engine
        self.lora_request = lora_request
        self.params = params
        self.prefix = prefix
        self.seeded = seeded

    def add(self, request_id: str, prompt_ids: Any, seed: int, max_tokens: int | None = None) -> None:
        params = self.params
        if self.seeded or max_tokens is not None:
            params = params.clone()
        if self.seeded:
            params.seed = int(seed)
        if max_tokens is not None:
            params.max_tokens = request_max_tokens(request_id, max_tokens, self.params.max_tokens)
        self.engine.add_request(self.prefix + request_id, {"prompt_token_ids": list(prompt_ids)}, params,
                                **lora_kwargs(self.lora_request))

    def has_unfinished(self) -> bool:
        return bool(self.engine.has_unfinished_requests())

    def abort(self, request_ids: Sequence[str]) -> None:
        self.engine.abort_request([self.prefix + request_id for request_id in request_ids])

    def step(self) -> list[tuple[str, Completion]]:
        cut = len(self.prefix)
        return [(out.request_id[cut:], Completion(*sampled_ids_and_log_probs(out)))
                for out in self.engine.step() if out.finished]
