"""A host (CPU) memory plan per node for each phase of a run, from the model's config.json and the config.

    plan = plan_host_memory(cfg)         # cfg: the composed trainer config (no weights)
    plan.phase_gib()                     # {"model_init": 9.1, "training": 145.3, "checkpoint_save": 148.0}
    fits, message = host_fit(plan, 2048) # against trainer.host_memory_gib (GiB per node)

It plans the node of global rank 0, the busiest: it alone reads the model files and stages the HF
export. What a node's host holds, per phase, for its `n_gpus_per_node` worker ranks (GPU workers):

- model_init (verl/utils/model.py, the meta-device loader): every rank builds the model on the meta
  device and materialises only its FSDP shard on its GPU; global rank 0 alone reads the safetensors
  files, mmap'd, one tensor at a time: at most one full tensor as stored (config.json's dtype, mapped
  file pages in use), whose broadcast copy is on its GPU; every other rank receives each tensor into a
  broadcast buffer on its GPU (NCCL), so nothing model-sized on the host (CPU workers: one buffer each,
  in the stored dtype, on the host). No rank holds the whole model. The models are built one after the
  other; the offloaded shards of all of them are counted throughout.
- training (between calls and during them): what `fsdp_config.*_offload` keeps on the host, for every
  training rank of the node: parameter shards (param_offload: fp32, the reference's bf16 on GPU
  workers) and AdamW state (optimizer_offload;
  AdamW creates it at the first step, this is after it). Gradients never: every step ends with
  `zero_grad(set_to_none=True)`, so grad_offload has nothing to move. vLLM's sleep between rollouts
  (verl/workers/rollout/vllm_rollout.py): without LoRA's adapter sync at level 2, no weights on the
  host, only the model's buffers vLLM backs up (the rotary table, max_position_embeddings x head_dim in
  bf16, 4 fp32 scales a layer); with lora_sync=adapter at level 1, the base weights in pinned memory on
  every rank (`level1_backup`: per 2 MiB segment, torch's pinned rounding capped at 16 MiB by the
  workers' PYTORCH_ALLOC_CONF) and the LoRA stacked buffers; at every level vLLM's runtime and CUDA-graph
  pools (`VLLM_RUNTIME_POOLS_ESTIMATE`, an estimate: their size is not known without a GPU).
  A pipelined run's rollout ranks hold no FSDP copy; a push arrives one full tensor at a time, in the
  engine's dtype, into the engine on the GPU.
- checkpoint_save: the saving model's state is onloaded to the GPU (its host copy freed); DCP writes
  each rank's shard through host memory one tensor at a time (torch's CPU loaders: ~1 MB in flight
  plus the tensor; two of the largest shard tensors are counted); with trainer.save_hf_model rank 0
  stages the HF export (verl/utils/checkpoint/hf_export.py): a safetensors file of up to
  `hf_max_shard_mb` in the export dtype plus the tensor that crossed the bound.
- pinned memory: vLLM's sleep backups (pinned: they cannot be swapped). Offload copies go to pageable
  memory. torch's pinned allocator rounds each block up to a power of two by default (Qwen2.5-7B, TP=1:
  26.8 GiB for 14.2 GiB of weights a rank); with level-1 sleep (LoRA, lora_sync=adapter) the workers run
  with PYTORCH_ALLOC_CONF=pinned_max_round_threshold_mb:16,pinned_max_cached_size_mb:16 (merged into the
  user's, verl/trainer/main_ppo.py `pinned_alloc_conf`), so only segments up to 16 MiB are rounded, and
  this plan counts them so; a worker without the setting (Ray started with its own environment) warns.
With CPU workers the device plan (verl/utils/memory_plan.py) is host memory too: each phase adds the
largest per-worker phase x the node's ranks.

Not counted (notes): each worker process's own memory (Python, torch, CUDA and NCCL libraries: a few
GiB each), Ray's object store (shared memory, 30 % of the node's RAM unless set), the page cache of
mmap'd files (reclaimable).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from verl.utils.memory_plan import (
    BF16,
    FP32,
    GIB,
    REF_BYTES,
    ModelShape,
    Phase,
    _shard,
    adamw_state_bytes,
    engine_weights_name,
    largest_moment,
    read_model_config,
)

HOST_KEY = "trainer.host_memory_gib"
# DCP's writer keeps ~1 MB in flight plus the tensor it loaded: at most two tensors of a rank's shard.
DCP_TENSORS_IN_FLIGHT = 2
# vLLM's model buffers per decoder layer that a level-2 sleep backs up besides the rotary table (fp32 scales).
VLLM_SCALES_PER_LAYER = 4
_STORED_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass
class HostPlan:
    """Bytes per phase on one node's host (the node of global rank 0)."""

    train_ranks: int            # training worker ranks (one per GPU) on the node
    rollout_ranks: int          # a pipelined run's rollout-pool ranks on the node
    phases: list[Phase]
    notes: list[str]

    def phase_gib(self) -> dict[str, float]:
        return {p.name: round(p.total / GIB, 2) for p in self.phases}

    def largest(self) -> tuple[str, float]:
        phase = max(self.phases, key=lambda p: p.total)
        return phase.name, round(phase.total / GIB, 2)


def stored_bytes(config: dict[str, Any]) -> int:
    """Bytes per element of the checkpoint on disk (config.json's dtype; fp32 when it names none)."""
    name = str(config.get("torch_dtype") or config.get("dtype") or "float32").removeprefix("torch.")
    return _STORED_BYTES.get(name, FP32)


def hf_max_shard_bytes() -> int:
    """The HF export's safetensors file bound (FSDPCheckpointManager's default `hf_max_shard_mb`), in bytes."""
    from verl.utils.checkpoint.hf_export import HF_MAX_SHARD_MB

    return int(HF_MAX_SHARD_MB * 1024 ** 2)


@dataclass(frozen=True)
class _Model:
    """One FSDP model of the run, as the host sees it."""

    name: str                   # "actor", "reference", "critic"
    shape: ModelShape
    params: int
    tensors: int
    stored: int                 # bytes per element on disk
    param_offload: bool
    optimizer_offload: bool     # False for the reference (no optimizer)
    param_bytes: int = FP32     # bytes per parameter element: fp32 masters; the reference bf16 on GPU workers


def _models(cfg: Any, model_config: dict[str, Any] | None, critic_config: dict[str, Any] | None,
            cpu_workers: bool = False) -> list[_Model]:
    from verl.trainer.run_config import Algorithm

    algorithm = Algorithm.from_config(cfg)
    arr = cfg.actor_rollout_ref
    if model_config is None:
        model_config, _ = read_model_config(str(arr.model.path))
    shape = ModelShape.from_config(model_config, str(arr.model.path))
    p, t = shape.causal_lm()
    afs = arr.actor.fsdp_config
    models = [_Model("actor", shape, p, t, stored_bytes(model_config), bool(afs.param_offload),
                     bool(afs.optimizer_offload))]
    if algorithm.need_reference_policy:
        # the reference's parameters: bf16 on GPU workers (model.frozen_weight_dtype), fp32 on CPU ones
        models.append(_Model("reference", shape, p, t, stored_bytes(model_config),
                             bool(arr.ref.fsdp_config.param_offload), False, FP32 if cpu_workers else REF_BYTES))
    if algorithm.need_critic:
        if critic_config is None:
            critic_config, _ = read_model_config(str(cfg.critic.model.path))
        cshape = ModelShape.from_config(critic_config, str(cfg.critic.model.path))
        cp, ct = cshape.value_model()
        cfs = cfg.critic.model.fsdp_config
        models.append(_Model("critic", cshape, cp, ct, stored_bytes(critic_config), bool(cfs.param_offload),
                             bool(cfs.optimizer_offload)))
    return models


def node_ranks(cfg: Any) -> tuple[int, int]:
    """(training ranks, rollout-pool ranks) on the node of global rank 0 (run_config.Pools.layout)."""
    from verl.trainer.run_config import Pools

    layout = Pools.from_config(cfg).layout()
    if "global_pool" in layout:
        return layout["global_pool"][0], 0
    rollout = layout["rollout_pool"][0] if len(layout["train_pool"]) == 1 == len(layout["rollout_pool"]) else 0
    return layout["train_pool"][0], rollout


def _offloaded(models: list[_Model], world: int, ranks: int, with_optimizer: bool, skip: str = "") -> dict[str, int]:
    """The node's `ranks` shards that `*_offload` keeps on the host (AdamW's once it exists)."""
    out: dict[str, int] = {}
    for m in models:
        if m.name == skip:
            continue
        if m.param_offload:
            dtype = "fp32" if m.param_bytes == FP32 else "bf16"
            out[f"{m.name} params offloaded ({dtype} shard x {ranks} ranks)"] = \
                ranks * _shard(m.param_bytes * m.params, world)
        if with_optimizer and m.optimizer_offload:
            out[f"{m.name} AdamW state offloaded (shard x {ranks} ranks)"] = \
                ranks * _shard(adamw_state_bytes(m.params, m.tensors), world)
    return out


def meta_loader_init(models: list[_Model], world: int, ranks: int, cpu_workers: bool = False) -> Phase:
    """model_init under the meta-device loader (verl/utils/sharded_init.py): rank 0 reads one tensor at a
    time as stored (mapped file pages) and broadcasts it from its device; the other ranks receive into a
    buffer on their device: the GPU under NCCL (nothing on the host), the host for CPU workers."""
    # The broadcast unit is a stored tensor: an MoE checkpoint's experts travel one per expert, never fused.
    largest = max(models, key=lambda m: m.shape.largest_stored_params() * m.stored)
    n = largest.shape.largest_stored_params()
    certain = {**_offloaded(models, world, ranks, with_optimizer=False),
               f"rank 0: one tensor read (as stored, {largest.stored} B, mapped file pages)": n * largest.stored}
    if ranks > 1 and cpu_workers:
        certain[f"other ranks: one full broadcast buffer (as stored) x {ranks - 1}"] = (ranks - 1) * largest.stored * n
    return Phase("model_init", certain=certain)


def old_loader_init(cfg: Any, model_config: dict[str, Any] | None = None,
                    critic_config: dict[str, Any] | None = None) -> Phase:
    """model_init as the project did it before issue 32 (kept only to show what the meta-device loader
    fixed): every rank called `from_pretrained(dtype=float32)` on the host, so each held the whole model
    in fp32 (the largest model of the run; they are built one after the other): 8 ranks x 291 GB =
    2.3 TB per node for Qwen2.5-72B."""
    models = _models(cfg, model_config, critic_config)
    ranks, _ = node_ranks(cfg)
    largest = max(models, key=lambda m: m.params)
    return Phase("model_init", certain={
        f"every rank: the whole {largest.name} in fp32 x {ranks} ranks (old loader)": ranks * FP32 * largest.params})


MIB = 1024 ** 2
# With level-1 sleep the workers' PYTORCH_ALLOC_CONF carries these (main_ppo.pinned_alloc_conf): torch's
# pinned host allocator then rounds (and caches) only blocks up to 16 MiB, to a power of two; larger ones
# keep their size and are freed, not cached (the round threshold alone would cache exact-size blocks in
# power-of-two buckets and hand one back for a larger request of the same bucket). By default every
# block is rounded: up to 2x on vLLM's level-1 backups (c10/core/AllocatorConfig.h,
# ATen/core/CachingHostAllocator.h).
PINNED_ALLOC_SETTINGS = {"pinned_max_round_threshold_mb": 16, "pinned_max_cached_size_mb": 16}
PINNED_ROUND_THRESHOLD_MB = PINNED_ALLOC_SETTINGS["pinned_max_round_threshold_mb"]

def pinned_alloc_missing(environ: Mapping[str, str]) -> list[str]:
    """The PINNED_ALLOC_SETTINGS keys torch will not read from `environ` (it reads PYTORCH_ALLOC_CONF, else
    PYTORCH_CUDA_ALLOC_CONF): what a level-1-sleeping worker lacks when Ray was started with its own environment."""
    value = environ.get("PYTORCH_ALLOC_CONF", environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    return [key for key in PINNED_ALLOC_SETTINGS if key not in value]


CUMEM_GRANULARITY = 2 * MIB          # cuMem maps (and so vLLM backs up) segments in 2 MiB units
# vLLM backs up its "runtime" and "cudagraph" pools to pinned host memory at every sleep level
# (sleep_mode_backend.py). Their size is not known without a GPU: a stated estimate per rank.
VLLM_RUNTIME_POOLS_ESTIMATE = {"cuda graphs": 2 * 1024 * MIB, "enforce_eager": 512 * MIB}
_PACKED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
           "up_proj": "gate_up_proj", "o_proj": "o_proj", "down_proj": "down_proj"}


def pinned_backup_bytes(nbytes: int, threshold_mb: int | None = PINNED_ROUND_THRESHOLD_MB) -> int:
    """Host bytes that a level-1 backup of a `nbytes` segment holds: the segment in 2 MiB units, then torch's
    pinned rounding (a power of two up to the threshold; `None`: torch's default, every block)."""
    segment = -(-nbytes // CUMEM_GRANULARITY) * CUMEM_GRANULARITY
    if threshold_mb is None or segment <= threshold_mb * MIB:
        return 1 << (segment - 1).bit_length()
    return segment


def vllm_rank_tensors(shape: ModelShape, tp: int) -> list[int]:
    """Elements of each weight tensor one vLLM engine rank holds (fused qkv_proj / gate_up_proj, the
    vocabulary padded to a multiple of 64 rows, column / row-parallel layers split over `tp`)."""
    from verl.utils.memory_plan import VLLM_VOCAB_PADDING

    h, inter, d = shape.hidden_size, shape.intermediate_size, shape.head_dim
    q, kv = shape.num_attention_heads * d, shape.num_key_value_heads * d
    vocab = -(-shape.vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
    split = lambda n: -(-n // tp)  # noqa: E731
    attention = [split(q + 2 * kv) * h, split(q) * h, h, h] + ([d, d] if shape.qk_norm else [])
    if shape.attention_bias:
        attention.append(split(q + 2 * kv))
    dense = attention + [split(2 * inter) * h, h * split(inter)]
    # MoE (tensor parallel, no expert parallel): every expert's width split over the ranks, w13 and w2 one tensor
    # each; the router replicated; a shared expert like a dense MLP, with its one-output gate.
    e, width, shared = shape.num_experts, shape.moe_intermediate_size, shape.shared_expert_intermediate_size
    moe = attention + [e * split(2 * width) * h, e * h * split(width), e * h]
    if shared:
        moe += [split(2 * shared) * h, h * split(shared), h]
    heads = 1 if shape.tie_word_embeddings else 2
    return ([split(vocab) * h] * heads + dense * (shape.num_hidden_layers - shape.moe_layers)
            + moe * shape.moe_layers + [h])


def lora_target_names(target: Any) -> set[str]:
    """vLLM's LoRA-wrapped (fused) modules for PEFT target_modules ('all-linear' or names): a fused module
    gets the stacked buffers of all its slices when any of them is targeted."""
    if isinstance(target, str):
        return set(_PACKED.values()) if target == "all-linear" else {_PACKED.get(target.rsplit(".", 1)[-1], "")} - {""}
    return {_PACKED[n.rsplit(".", 1)[-1]] for n in (target or []) if n.rsplit(".", 1)[-1] in _PACKED}


def lora_stacked_bytes(shape: ModelShape, tp: int, max_lora_rank: int, target: Any, max_loras: int = 1) -> int:
    """Bytes (bf16) of one engine rank's LoRA stacked buffers: max_loras x max_lora_rank x (in + out) of every
    targeted (fused) linear of every layer, A split over tp in a row-parallel layer, B in a column-parallel one."""
    h, inter, d = shape.hidden_size, shape.intermediate_size, shape.head_dim
    q, kv = shape.num_attention_heads * d, shape.num_key_value_heads * d
    split = lambda n: -(-n // tp)  # noqa: E731
    per_module = {"qkv_proj": 3 * h + split(q + 2 * kv), "o_proj": split(q) + h,
                  "gate_up_proj": 2 * h + split(2 * inter), "down_proj": split(inter) + h}
    per_layer = sum(per_module[m] for m in lora_target_names(target))
    return BF16 * max_loras * max_lora_rank * per_layer * shape.num_hidden_layers


def level1_backup(cfg: Any, shape: ModelShape) -> dict[str, int]:
    """Per engine rank, what vLLM's level-1 sleep (lora_sync=adapter) backs up to pinned host memory:
    the base weights segment by segment (2 MiB units, torch's rounding up to 16 MiB; tensors under
    1 MiB share 2 MiB segments), the LoRA stacked buffers (in the weights pool)."""
    from verl.workers.rollout.vllm_lora import vllm_max_lora_rank

    rollout, model = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model
    tp = int(rollout.get("tensor_model_parallel_size", 1))
    sizes = [BF16 * n for n in vllm_rank_tensors(shape, tp)]
    small = sum(b for b in sizes if b < MIB)
    weights = sum(pinned_backup_bytes(b) for b in sizes if b >= MIB) + pinned_backup_bytes(small)
    target = model.get("target_modules", "all-linear")
    adapter_path = model.get("lora_adapter_path")
    rank = int(model.get("lora_rank", 0) or 0)
    if adapter_path:                      # a continued adapter's own r and targets are what the engine serves
        from verl.utils.lora import read_adapter_config

        saved = read_adapter_config(str(adapter_path))
        rank, target = int(saved["r"]), saved.get("target_modules", target)
    return {"weights": weights,
            "lora": lora_stacked_bytes(shape, tp, vllm_max_lora_rank(rank), target)}


def runtime_pools_estimate(cfg: Any) -> tuple[str, int]:
    """(what, bytes per rank): the estimate of vLLM's runtime + cudagraph pools backed up at every sleep."""
    eager = bool(cfg.actor_rollout_ref.rollout.get("enforce_eager", False))
    what = "enforce_eager" if eager else "cuda graphs"
    return what, VLLM_RUNTIME_POOLS_ESTIMATE[what]


def _vllm_sleep_buffers(cfg: Any, shape: ModelShape, ranks: int) -> tuple[dict[str, int], dict[str, int]]:
    """(certain, estimated) host items of the node's engines asleep."""
    rollout = cfg.actor_rollout_ref.rollout
    if engine_weights_name(cfg) != "vllm" or not bool(rollout.get("free_cache_engine", True)):
        return {}, {}
    per_rank = BF16 * shape.max_position_embeddings * shape.head_dim + FP32 * VLLM_SCALES_PER_LAYER * shape.num_hidden_layers
    what, pools = runtime_pools_estimate(cfg)
    estimated = {f"vLLM runtime + cudagraph pools backed up at every sleep ({what}, "
                 f"{pools / GIB:.1f} GiB a rank, an estimate) x {ranks} ranks": ranks * pools}
    lora = int(cfg.actor_rollout_ref.model.get("lora_rank", 0) or 0) > 0
    if lora and str(rollout.get("lora_sync", "adapter")) == "adapter":
        # LoRA served as an adapter: level-1 sleep keeps the frozen base (never sent again) in pinned host memory
        tp = int(rollout.get("tensor_model_parallel_size", 1))
        backup = level1_backup(cfg, shape)
        return {f"vLLM level-1 sleep (LoRA, lora_sync=adapter): the base weights (bf16, 1/{tp}, per 2 MiB "
                f"segment, pinned) and buffers kept x {ranks} ranks": ranks * (per_rank + backup["weights"]),
                f"vLLM LoRA stacked buffers (max_lora_rank, bf16, pinned at level 1) x {ranks} ranks":
                    ranks * backup["lora"]}, estimated
    return ({f"vLLM level-2 sleep: its buffers backed up (rotary table, scales) x {ranks} ranks": ranks * per_rank},
            estimated)


def plan_host_memory(cfg: Any, model_config: dict[str, Any] | None = None, critic_config: dict[str, Any] | None = None,
                     cpu_workers: bool = False, device_plan: Any = None) -> HostPlan:
    """The host plan of the node of global rank 0 for the composed (resolved) config `cfg`.

    `cpu_workers`: the workers compute on the host; `device_plan` (a memory_plan.MemoryPlan, required then)
    gives each rank's bytes, added to every phase as its largest phase x the node's ranks."""
    from verl.trainer.run_config import Pools

    pools = Pools.from_config(cfg)
    models = _models(cfg, model_config, critic_config, cpu_workers)
    world = pools.world_size
    ranks, rollout_ranks = node_ranks(cfg)
    actor = models[0]
    notes = ["not counted: each worker process's own memory (Python, torch, CUDA/NCCL libraries: a few GiB each), "
             "Ray's object store (shared memory, 30 % of the node's RAM unless set), the page cache of mmap'd files"]
    engine_ranks = rollout_ranks if pools.pipelined else ranks     # colocated: every rank runs an engine
    sleep, sleep_estimated = ({}, {}) if cpu_workers else _vllm_sleep_buffers(cfg, actor.shape, engine_ranks)
    phases = [meta_loader_init(models, world, ranks, cpu_workers),
              Phase("training", certain={**_offloaded(models, world, ranks, with_optimizer=True), **sleep},
                    estimated=dict(sleep_estimated))]
    saves: dict[str, Phase] = {}            # the actor and the critic save one after the other
    for m in models:
        if m.name == "reference":
            continue
        largest_shard = _shard(FP32 * m.shape.largest_tensor_params(), world)
        save = {**_offloaded(models, world, ranks, with_optimizer=True, skip=m.name), **sleep,
                f"{m.name} DCP write staging ({DCP_TENSORS_IN_FLIGHT} tensors of a shard x {ranks} ranks)":
                    ranks * DCP_TENSORS_IN_FLIGHT * largest_shard}
        if m.name == "actor" and cfg.trainer.save_hf_model:
            # rank 0: the pending safetensors file (< hf_max_shard_mb) plus the tensor that crossed it, in the
            # export dtype (bf16 on GPU: FSDP2's param_dtype; fp32 on CPU workers)
            export = FP32 if cpu_workers else BF16
            save["rank 0: HF export file staged (hf_max_shard_mb + one tensor)"] = \
                hf_max_shard_bytes() + export * m.shape.largest_tensor_params()
        saves[f"{m.name} save"] = Phase(f"{m.name} save", certain=save, estimated=dict(sleep_estimated))
    phases.append(largest_moment("checkpoint_save", saves))
    if cpu_workers:
        if device_plan is None:
            raise ValueError("plan_host_memory(cpu_workers=True) needs the device plan (memory_plan.plan_memory)")
        name, _ = device_plan.largest()
        per_rank = max(p.total for p in device_plan.phases)
        for phase in phases:
            phase.certain[f"CPU workers: each rank's {name} x {ranks + rollout_ranks} ranks"] = \
                (ranks + rollout_ranks) * per_rank
        notes.append("CPU workers: their training state is host memory; offload moves nothing")
    return HostPlan(train_ranks=ranks, rollout_ranks=rollout_ranks, phases=phases, notes=notes)


def host_fit(phases: list[Phase], host_gib: float | None) -> tuple[bool | None, str]:
    """(fits, message) of a node's host phases against `trainer.host_memory_gib` (None: no verdict)."""
    largest = max(phases, key=lambda p: p.total)
    need = largest.total / GIB
    if host_gib is None:
        return None, (f"largest host phase {largest.name} {need:.1f} GiB per node; set {HOST_KEY} (GiB per node) "
                      "for a verdict")
    if need <= host_gib:
        return True, f"largest host phase {largest.name} {need:.1f} GiB <= {HOST_KEY}={host_gib:g} per node"
    parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in sorted(largest.certain.items(), key=lambda kv: -kv[1])[:3])
    return False, (f"host memory per node: phase {largest.name} needs {need:.1f} GiB > {HOST_KEY}={host_gib:g} "
                   f"({parts} GiB): offload less (fsdp_config.*_offload), fewer ranks per node, or more host memory")
