"""The preflight memory plan (verl/utils/memory_plan.py) against what the GPU really allocates.

Builds a Qwen2 policy from a config.json alone (default: Qwen2.5-0.5B's public shape; random weights,
nothing downloaded), wraps it as the actor worker does (the worker's own `_wrap`, `_onload`,
`_offload`: FSDP2 over one rank, bf16 compute on CUDA, fp32 master weights, AdamW), and runs, on a
random full-length batch of the configured shape:

1. a log-prob pass, unmeasured: the old log-probs the update needs (the trainer's order);
2. the actor's first update (one optimizer step), measured: `actor_update_first`, against the plan's
   `plan_memory(..., first_update=True)` (AdamW creates its state inside this step: its backward holds none);
3. a second update on the same batch, measured: `actor_update`, against the steady-state plan
   (what preflight checks: the backward now holds AdamW's state);
4. a log-prob pass, measured: `actor_log_prob`, with AdamW's state resident, as the plan counts it;
5. LoRA (`--lora-rank N`, or actor_rollout_ref.model.lora_rank > 0): the actor is built as the worker
   builds it (PEFT's adapters on every linear, the frozen base in bf16 on CUDA, AdamW over the fp32
   adapter alone, verl/utils/memory_plan_lora.py), the same update and log-prob passes, and with
   `--lora-rank` (use_kl_loss on) the reference pass, measured: `reference_log_prob`, the actor with
   its adapter disabled (no reference weights), unmeasured once before the first update as the trainer does.

Each measured call is bracketed by `torch.cuda.reset_peak_memory_stats()` / `max_memory_allocated()`,
so each update's peak is its own. Prints ONE JSON object: per measured phase the plan's certain and
estimated bytes (by entry and in total), its moments (an update: backward and optimizer step, with
the one that binds), the measured peak and measured / plan; the bytes the actor really holds
(parameter shards, AdamW state) beside the plan's entries for them; what the passes computed;
device, torch and transformers.
Measures the actor alone: a config whose actor phases also count a critic or reference weights is refused.
Not part of any test suite on a GPU; `--device cpu --tiny` runs the same path on CPU with measured
values null (tests/utils/test_memory_plan_gpu_check.py).

    python scripts/gpu_checks/memory_plan_vs_allocated.py                  # on a GPU: 8 rows, micro 4, 1024 + 512
    python scripts/gpu_checks/memory_plan_vs_allocated.py --micro 8 actor_rollout_ref.model.enable_gradient_checkpointing=true
    python scripts/gpu_checks/memory_plan_vs_allocated.py --model-config example/model_configs/qwen2.5-3b/config.json
    python scripts/gpu_checks/memory_plan_vs_allocated.py --model-config example/model_configs/qwen2.5-7b/config.json --lora-rank 64
    python scripts/gpu_checks/memory_plan_vs_allocated.py --device cpu --tiny --prompt-length 16 --response-length 8
    python scripts/gpu_checks/memory_plan_vs_allocated.py --model-config example/model_configs/qwen3-30b-a3b/config.json --num-layers 4
    python scripts/gpu_checks/memory_plan_vs_allocated.py --device cpu --tiny-moe --prompt-length 16 --response-length 8
    python scripts/gpu_checks/memory_plan_vs_allocated.py --compose-only    # parse and plan, build nothing

(from the repository root with the project installed, `pip install -e .`; or
`python -m scripts.gpu_checks.memory_plan_vs_allocated ...`). Trailing `key=value` arguments are
trainer-config overrides, applied after the ones the flags make; `--out FILE` also writes the JSON
there (scripts/gpu_checks/run_all.sh reads it).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import transformers
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM

from verl.protocol import DataProto
from verl.trainer.main_ppo import compose_config
from verl.utils import batch_keys as K
from verl.utils import fsdp_utils
from verl.utils.attention import attn_implementation
from verl.utils.lora import LoraSpec, adapter_disabled, is_adapter_param
from verl.utils.memory_plan import MemoryPlan, Phase, plan_memory, sequence_length
from verl.utils.model import load_model_config
from verl.workers.actor.dp_actor import DataParallelPPOActor
from verl.workers.fsdp_workers import _FSDPWorkerBase, normalize_actor_batch_sizes

T = TypeVar("T")

# Qwen/Qwen2.5-0.5B's config.json (public numbers).
QWEN2_5_0_5B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
    "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
    "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 24, "attention_dropout": 0.0,
    "initializer_range": 0.02, "bos_token_id": 151643, "eos_token_id": 151643, "torch_dtype": "bfloat16",
}
# The same architecture, small enough for a CPU test.
TINY: dict[str, Any] = {**QWEN2_5_0_5B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
                        "max_position_embeddings": 4096, "sliding_window": 4096, "max_window_layers": 2,
                        "bos_token_id": 511, "eos_token_id": 511}
# Qwen3-30B-A3B's layout (q/k norms, head_dim 128, 2 of 4 experts a token here), small enough for a CPU test.
TINY_MOE: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_act": "silu", "hidden_size": 64,
    "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512,
    "max_position_embeddings": 4096, "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "attention_bias": False, "initializer_range": 0.02, "bos_token_id": 511, "eos_token_id": 511,
    "torch_dtype": "bfloat16"}
# plan phases; the update is measured twice; the reference pass only with LoRA (the actor, adapter off)
MEASURED_PHASES = ("actor_update", "actor_log_prob", "reference_log_prob")
# Entries of an actor phase that belong to the actor (the rest would be another model's resident state).
_ACTOR_ENTRY_PREFIXES = ("actor ", "gathered layer", "gathered next layer", "gathered root unit", "reduce-scatter staging",
                         "log-prob head")


@dataclass(frozen=True)
class BatchShape:
    """The batch one update trains on: `rows` rows (one mini-batch, one optimizer step) at the max lengths."""

    rows: int
    micro: int              # rows per micro-batch, in the update and in the log-prob pass
    prompt_length: int
    response_length: int


@dataclass(frozen=True)
class Peak:
    """CUDA allocator statistics of one measured call."""

    allocated_before: int
    peak_allocated: int
    peak_reserved: int


@dataclass
class Actor:
    """What the actor worker holds after init_model: the wrapped module, its optimizer and schedule."""

    module: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    ppo: DataParallelPPOActor
    worker: Any             # the worker-shaped view (device, device_mesh) the worker's methods run on
    config: DictConfig      # actor_rollout_ref, batch sizes per rank


def trainer_overrides(model_path: str, shape: BatchShape, device: str, extra: list[str]) -> list[str]:
    """One GPU, the actor alone (GRPO: no critic; no KL loss or in-reward KL: no reference), no search,
    rows x (prompt + response) tokens, micro-batches of `shape.micro` rows (every pass); then `extra`."""
    arr = "actor_rollout_ref"
    return [
        "trainer.nnodes=1", "trainer.n_gpus_per_node=1", f"trainer.device={device}", "trainer.logger=[console]",
        "do_search=false", "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false",
        f"{arr}.actor.use_kl_loss=false", f"{arr}.model.path={model_path}", f"critic.model.path={model_path}",
        f"data.train_batch_size={shape.rows}", f"data.max_start_length={shape.prompt_length}",
        f"data.max_prompt_length={shape.prompt_length}", f"data.max_response_length={shape.response_length}",
        f"{arr}.actor.ppo_mini_batch_size={shape.rows}", f"{arr}.actor.ppo_micro_batch_size_per_gpu={shape.micro}",
        f"{arr}.rollout.log_prob_micro_batch_size_per_gpu={shape.micro}",
        f"{arr}.ref.log_prob_micro_batch_size_per_gpu={shape.micro}", *extra,   # LoRA's reference pass
    ]


def check_actor_only(plan: MemoryPlan) -> None:
    """Refuse a plan whose measured phases count another model's state: only the actor is built here."""
    for phase in plan.phases:
        if phase.name not in MEASURED_PHASES:
            continue
        entries = [k for moment in (phase, *phase.moments.values()) for k in moment.certain]
        others = sorted({k for k in entries if not k.startswith(_ACTOR_ENTRY_PREFIXES)})
        if others:
            raise ValueError(f"plan phase {phase.name} counts {others}: this check builds the actor alone; keep "
                             "algorithm.adv_estimator=grpo, actor_rollout_ref.actor.use_kl_loss=false and "
                             "algorithm.use_kl_in_reward=false (with LoRA, --lora-rank, the reference is the "
                             "actor with its adapter off: use_kl_loss=true is measured)")


def lora_overrides(rank: int | None, extra: list[str]) -> list[str]:
    """--lora-rank N: LoRA of rank N (alpha 2N) and use_kl_loss on, so the reference pass (the actor with
    its adapter off) is planned and measured; refused beside an explicit lora_rank override."""
    if rank is None:
        return []
    if rank <= 0:
        raise ValueError(f"--lora-rank must be > 0, got {rank} (leave it out for the full-parameter actor)")
    given = [o for o in extra if o.lstrip("+").partition("=")[0] == "actor_rollout_ref.model.lora_rank"]
    if given:
        raise ValueError(f"--lora-rank {rank} and {given[0]} both set actor_rollout_ref.model.lora_rank; pass one")
    return [f"actor_rollout_ref.model.lora_rank={rank}", f"actor_rollout_ref.model.lora_alpha={2 * rank}",
            "actor_rollout_ref.actor.use_kl_loss=true"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_rank(device: str) -> Any:
    """A one-rank process group (NCCL on CUDA, gloo on CPU) and the worker's 1-D FSDP mesh."""
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}",
                            rank=0, world_size=1)
    return init_device_mesh(device, (1,), mesh_dim_names=("fsdp",))


def build_actor(arr: DictConfig, device: str, mesh: Any) -> Actor:
    """The actor as ActorRolloutRefWorker.init_model builds it, from config.json alone (random weights):
    fp32 model, the worker's `_wrap` (checkpointing, FSDP2, bf16 mixed precision on CUDA), AdamW and
    its schedule, DataParallelPPOActor, then the worker's `_offload` (a no-op unless offload is set).
    The random weights are made on `device` (a 3B model's init on the host takes half a minute; where
    they were made changes nothing that is measured: the measured calls start with them on the GPU)."""
    model_cfg = arr.model
    use_rmpad = bool(model_cfg.get("use_remove_padding", False))
    attn = attn_implementation(device, use_rmpad, str(model_cfg.get("packing_kernel", "varlen_attn")))
    config = load_model_config(model_cfg.path, model_cfg.get("override_config"))
    torch.manual_seed(0)
    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if attn:
        kwargs["attn_implementation"] = attn
    with torch.device(device):
        module = AutoModelForCausalLM.from_config(config, **kwargs)
    # The worker's own methods (not a copy), on a view holding the attributes and the method they read.
    worker = SimpleNamespace(device=device, device_mesh=mesh)
    # LoRA: the worker's _prepare injects the adapters (the base frozen, bf16 on CUDA) before FSDP2 wraps
    lora = LoraSpec.from_model_config(model_cfg) if int(model_cfg.get("lora_rank", 0) or 0) > 0 else None
    worker._prepare = lambda *args: _FSDPWorkerBase._prepare(worker, *args, lora)
    module = _FSDPWorkerBase._wrap(worker, module, model_cfg, trainable=True)
    optimizer, scheduler = fsdp_utils.build_optimizer(module, arr.actor.optim)
    ppo = DataParallelPPOActor(arr.actor, module, optimizer, use_remove_padding=use_rmpad)
    _FSDPWorkerBase._offload(worker, module, optimizer, arr.actor.fsdp_config)
    return Actor(module, optimizer, scheduler, ppo, worker, arr)


def random_batch(vocab_size: int, shape: BatchShape, seed: int = 0) -> dict[str, torch.Tensor]:
    """Host tensors of full-length rows (no padding: the plan's max lengths), random token ids and
    advantages. Each call below builds its own DataProto from them, as each worker call gets its own."""
    g = torch.Generator().manual_seed(seed)
    seq = shape.prompt_length + shape.response_length
    input_ids_BT = torch.randint(0, vocab_size, (shape.rows, seq), generator=g)
    responses_BR = input_ids_BT[:, shape.prompt_length:].clone()
    return {
        K.INPUT_IDS: input_ids_BT,
        K.ATTENTION_MASK: torch.ones_like(input_ids_BT),
        K.POSITION_IDS: torch.arange(seq).expand(shape.rows, seq).clone(),
        K.RESPONSES: responses_BR,
        K.RESPONSE_MASK: torch.ones_like(responses_BR),
        K.ADVANTAGES: torch.randn(shape.rows, shape.response_length, generator=g),
    }


def compute_log_prob(actor: Actor, tensors: dict[str, torch.Tensor], reference: bool = False) -> torch.Tensor:
    """ActorRolloutRefWorker.compute_log_prob's body: log-probs (B, R) of the responses, on the host;
    `reference`: compute_ref_log_prob's LoRA body (the ref's batch keys, the actor with its adapter off)."""
    keys = actor.config.ref if reference else actor.config.rollout
    data = DataProto.from_dict(tensors=tensors).to(actor.worker.device)
    data.meta_info.update({
        K.META_MICRO_BATCH_SIZE: keys.log_prob_micro_batch_size,
        K.META_MAX_TOKEN_LEN: keys.log_prob_max_token_len_per_gpu,
        K.META_USE_DYNAMIC_BSZ: keys.log_prob_use_dynamic_bsz,
        K.META_TEMPERATURE: actor.config.rollout.temperature,
    })
    fsdp_cfg = actor.config.actor.fsdp_config
    _FSDPWorkerBase._onload(actor.worker, actor.module, None, fsdp_cfg)
    if reference:
        with adapter_disabled(actor.module):
            log_probs_BR, _ = actor.ppo.compute_log_prob(data)
    else:
        log_probs_BR, _ = actor.ppo.compute_log_prob(data)
    _FSDPWorkerBase._offload(actor.worker, actor.module, None, fsdp_cfg)
    return log_probs_BR.cpu()


def update_actor(actor: Actor, tensors: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """ActorRolloutRefWorker.update_actor's body: one update_policy call, the schedule stepped."""
    fsdp_cfg = actor.config.actor.fsdp_config
    data = DataProto.from_dict(tensors=tensors).to(actor.worker.device)
    data.meta_info[K.META_TEMPERATURE] = actor.config.rollout.temperature
    _FSDPWorkerBase._onload(actor.worker, actor.module, actor.optimizer, fsdp_cfg)
    metrics = actor.ppo.update_policy(data)
    actor.scheduler.step()
    _FSDPWorkerBase._offload(actor.worker, actor.module, actor.optimizer, fsdp_cfg)
    return metrics


def run_measured(device: str, fn: Callable[[], T]) -> tuple[T, Peak | None]:
    """fn(), and on CUDA the allocator's peak during it (None on CPU: no allocator statistics)."""
    if device != "cuda":
        return fn(), None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    return result, Peak(before, torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _nbytes(tensor: torch.Tensor) -> int:
    local = _local(tensor)
    return local.numel() * local.element_size()


def fingerprint(module: nn.Module) -> dict[str, float]:
    """Sum of each parameter (float64): tells which parameter tensors an update changed."""
    return {name: float(_local(p.detach()).double().sum()) for name, p in module.named_parameters()}


def held_bytes(actor: Actor) -> dict[str, int]:
    """Bytes the actor holds on this rank: parameter shards, AdamW state (all of it, and the part on
    the training device: torch keeps AdamW's `step` on the host unless capturable/fused); with LoRA
    the adapter's and the frozen base's shares of the parameters too."""
    state = [v for s in actor.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    on_device = [v for v in state if _local(v).device.type == actor.worker.device]
    held = {"actor params (fp32 shard)": sum(_nbytes(p) for p in actor.module.parameters()),
            "actor AdamW state (shard)": sum(_nbytes(v) for v in state),
            "actor AdamW state on the training device": sum(_nbytes(v) for v in on_device)}
    named = list(actor.module.named_parameters())
    if any(is_adapter_param(n) for n, _ in named):
        held["actor adapter params (shard)"] = sum(_nbytes(p) for n, p in named if is_adapter_param(n))
        held["actor frozen base params (shard)"] = sum(_nbytes(p) for n, p in named if not is_adapter_param(n))
    return held


def lora_summary(actor: Actor, plan: MemoryPlan) -> dict[str, Any] | None:
    """The adapter the built actor holds beside the plan's count of it (None without LoRA)."""
    named = list(actor.module.named_parameters())
    adapter = [(n, p) for n, p in named if is_adapter_param(n)]
    if not adapter:
        return None
    frozen = [p for n, p in named if not is_adapter_param(n)]
    return {"rank": int(actor.config.model.lora_rank), "alpha": float(actor.config.model.lora_alpha),
            "parameters": sum(_local(p).numel() for _, p in adapter), "parameter_tensors": len(adapter),
            "plan_parameters": plan.lora_params, "plan_parameter_tensors": plan.lora_tensors,
            "trainable_only_adapter": all(p.requires_grad == is_adapter_param(n) for n, p in named),
            "frozen_dtypes": sorted({str(p.dtype) for p in frozen}),
            "adapter_dtypes": sorted({str(p.dtype) for _, p in adapter})}


def phase_report(phase: Phase, peak: Peak | None) -> dict[str, Any]:
    certain, estimated = sum(phase.certain.values()), sum(phase.estimated.values())
    report: dict[str, Any] = {
        "plan_certain": dict(phase.certain), "plan_estimated": dict(phase.estimated),
        "plan_certain_bytes": certain, "plan_estimated_bytes": estimated, "plan_bytes": phase.total,
        "plan_binding": phase.binding or None,
        "plan_moments_bytes": {name: moment.total for name, moment in phase.moments.items()},
        "measured_peak_bytes": None, "measured_over_plan": None, "measured_minus_certain_bytes": None,
        "allocated_before_bytes": None, "peak_reserved_bytes": None,
    }
    if peak is not None:
        report.update(measured_peak_bytes=peak.peak_allocated,
                      measured_over_plan=round(peak.peak_allocated / phase.total, 4),
                      measured_minus_certain_bytes=peak.peak_allocated - certain,
                      allocated_before_bytes=peak.allocated_before, peak_reserved_bytes=peak.peak_reserved)
    return report


def compose(model_config: dict[str, Any], shape: BatchShape, device: str, extra: list[str],
            folder: str) -> tuple[list[str], DictConfig, MemoryPlan]:
    """(overrides, the resolved trainer config, its steady-state plan) for a model whose config.json is
    written into `folder`; refuses a config whose measured phases count another model."""
    (Path(folder) / "config.json").write_text(json.dumps(model_config))
    overrides = trainer_overrides(folder, shape, device, extra)
    cfg = compose_config(overrides)
    OmegaConf.resolve(cfg)
    plan = plan_memory(cfg, model_config=model_config)
    check_actor_only(plan)
    return overrides, cfg, plan


def run_check(model_config: dict[str, Any], shape: BatchShape, device: str, extra: list[str]) -> dict[str, Any]:
    """Plan, build, run and measure; the report as a JSON-ready dict."""
    with tempfile.TemporaryDirectory(prefix="memory_plan_check_") as folder:
        overrides, cfg, plan = compose(model_config, shape, device, extra, folder)
        first_plan = plan_memory(cfg, model_config=model_config, first_update=True)
        arr = cfg.actor_rollout_ref
        normalize_actor_batch_sizes(arr, "actor_rollout_ref", world_size=1)
        with_ref = any(p.name == "reference_log_prob" for p in plan.phases)   # LoRA with use_kl_loss only
        mesh = init_single_rank(device)
        try:
            actor = build_actor(arr, device, mesh)
            tensors = random_batch(int(model_config["vocab_size"]), shape)
            tensors[K.OLD_LOG_PROBS] = compute_log_prob(actor, tensors)
            if with_ref:   # the trainer's order: old log-probs, the reference's, then the update
                tensors[K.REF_LOG_PROB] = compute_log_prob(actor, tensors, reference=True)
            before = fingerprint(actor.module)
            metrics, first_peak = run_measured(device, lambda: update_actor(actor, tensors))
            after = fingerprint(actor.module)
            second, update_peak = run_measured(device, lambda: update_actor(actor, tensors))
            log_probs_BR, log_prob_peak = run_measured(device, lambda: compute_log_prob(actor, tensors))
            ref_BR, ref_peak = run_measured(device, lambda: compute_log_prob(actor, tensors, reference=True)) \
                if with_ref else (None, None)
            held = held_bytes(actor)
            lora = lora_summary(actor, plan)
            # the model's own parameters (with LoRA: the frozen base's; the plan counts the adapter apart)
            base = [p for n, p in actor.module.named_parameters() if not is_adapter_param(n)]
            parameters, parameter_tensors = sum(_local(p).numel() for p in base), len(base)
        finally:
            dist.destroy_process_group()
    phases = {p.name: p for p in plan.phases}
    first_update = next(p for p in first_plan.phases if p.name == "actor_update")
    measured = {"actor_update_first": phase_report(first_update, first_peak),
                "actor_update": phase_report(phases["actor_update"], update_peak),
                "actor_log_prob": phase_report(phases["actor_log_prob"], log_prob_peak)}
    if with_ref:
        measured["reference_log_prob"] = phase_report(phases["reference_log_prob"], ref_peak)
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "model": {"config": model_config, "parameters": parameters, "parameter_tensors": parameter_tensors,
                  "plan_parameters": plan.actor_params, "plan_parameter_tensors": plan.actor_tensors},
        "shape": {**asdict(shape), "sequence_length": sequence_length(cfg)},
        "overrides": overrides,   # the model path in them named a temporary folder, gone now
        "plan_phases": [p.name for p in plan.phases], "plan_gib": plan.phase_gib(), "plan_notes": plan.notes,
        "phases": measured, "held_bytes": held, "lora": lora,
        "update": {"pg_loss": metrics["actor/pg_loss"], "grad_norm": metrics["actor/grad_norm"],
                   "grad_nonfinite": metrics["actor/grad_nonfinite"],
                   "response_tokens": int(tensors[K.RESPONSE_MASK].sum()),
                   "parameter_tensors_changed": sum(before[k] != after[k] for k in before),
                   "frozen_tensors_changed": sum(before[k] != after[k] for k in before if lora and not is_adapter_param(k)),
                   "parameter_tensors": len(before)},
        "second_update": {"pg_loss": second["actor/pg_loss"], "grad_norm": second["actor/grad_norm"],
                          "grad_nonfinite": second["actor/grad_nonfinite"]},
        "log_prob": {"shape": list(log_probs_BR.shape), "mean": float(log_probs_BR.mean()),
                     "finite": bool(torch.isfinite(log_probs_BR).all())},
        # the adapter off: the base model's log-probs, apart from the trained actor's after two updates
        "reference_log_prob": None if ref_BR is None else {
            "shape": list(ref_BR.shape), "mean": float(ref_BR.mean()), "finite": bool(torch.isfinite(ref_BR).all()),
            "max_abs_diff_from_actor": float((ref_BR - log_probs_BR).abs().max())},
    }


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, batch shape and device flags this check and actor_throughput.py share."""
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="hidden 64, 2 layers, vocab 512 (for the CPU test)")
    parser.add_argument("--tiny-moe", action="store_true", help="the same, Qwen3-MoE with 4 experts (CPU test)")
    parser.add_argument("--model-config", help="a config.json to use instead of Qwen2.5-0.5B's shape")
    parser.add_argument("--num-layers", type=int, default=None,
                        help="keep this many decoder layers of the model's shape (a 30B MoE's layers on one GPU)")
    parser.add_argument("--rows", type=int, default=8, help="rows of the update (one mini-batch, one step)")
    parser.add_argument("--micro", type=int, default=4, help="rows per micro-batch (update and log-prob pass)")
    parser.add_argument("--prompt-length", type=int, default=1024)
    parser.add_argument("--response-length", type=int, default=512)
    parser.add_argument("--out", help="also write the JSON report to this file")
    parser.add_argument("--compose-only", action="store_true",
                        help="parse, compose the trainer config and plan it; build and run nothing (any device)")
    parser.add_argument("overrides", nargs="*", help="trainer-config overrides, key=value")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--lora-rank", type=int, default=None,
                        help="LoRA of this rank (alpha 2x) with use_kl_loss: also measures the reference pass")
    return parser.parse_args(argv)


def model_and_shape(args: argparse.Namespace) -> tuple[dict[str, Any], BatchShape]:
    """The config.json dict (--model-config, --tiny or Qwen2.5-0.5B's) and the batch shape the flags give."""
    tiny_moe = getattr(args, "tiny_moe", False)
    if sum(map(bool, (args.model_config, args.tiny, tiny_moe))) > 1:
        raise SystemExit("--tiny, --tiny-moe and --model-config choose the model each; pass one")
    model_config = json.loads(Path(args.model_config).read_text()) if args.model_config else (
        TINY if args.tiny else TINY_MOE if tiny_moe else QWEN2_5_0_5B)
    layers = getattr(args, "num_layers", None)
    if layers is not None:   # the same layers, fewer of them: every per-layer tensor keeps its shape
        if layers < 1:
            raise SystemExit(f"--num-layers {layers}: must be >= 1")
        model_config = {**model_config, "num_hidden_layers": layers,
                        **({"max_window_layers": layers} if "max_window_layers" in model_config else {})}
    return model_config, BatchShape(args.rows, args.micro, args.prompt_length, args.response_length)


def composed_report(model_config: dict[str, Any], shape: BatchShape, device: str, extra: list[str]) -> dict[str, Any]:
    """--compose-only: what the check would plan (nothing built): overrides and GiB per phase."""
    with tempfile.TemporaryDirectory(prefix="memory_plan_check_") as folder:
        overrides, cfg, plan = compose(model_config, shape, device, extra, folder)
        names = {p.name for p in plan.phases}
        return {"composed": True, "overrides": overrides, "plan_gib": plan.phase_gib(),
                "sequence_length": sequence_length(cfg), "lora_params": plan.lora_params,
                # what run_check would measure: the update twice, the log-prob pass, the LoRA reference pass
                "measured_phases": ["actor_update_first", *(n for n in MEASURED_PHASES if n in names)]}


def write_report(report: dict[str, Any], out: str | None, echo: bool = True) -> None:
    """Print the one JSON object (`echo`) and write it to `out`."""
    text = json.dumps(report, indent=1, allow_nan=True)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
    if echo:
        print(text)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    model_config, shape = model_and_shape(args)
    try:
        extra = [*lora_overrides(args.lora_rank, list(args.overrides)), *args.overrides]
    except ValueError as err:
        raise SystemExit(str(err)) from err
    if args.compose_only:
        report = composed_report(model_config, shape, args.device, extra)
    else:
        if args.device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("no CUDA device here: run on a GPU machine, or pass --device cpu --tiny")
        report = run_check(model_config, shape, args.device, extra)
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
