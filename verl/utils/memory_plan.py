"""A per-GPU memory plan for each phase of a training step, from the model's config.json alone.

    plan = plan_memory(cfg)              # cfg: the composed trainer config (no weights, no GPU)
    plan.phase_gib()                     # {"actor_update": 41.2, ...} GiB per GPU
    plan.largest()                       # ("rollout", 52.0)

What the workers hold (verl/workers/fsdp_workers.py, verl/utils/fsdp_utils.py): actor and critic
are loaded in fp32 and sharded with FSDP2 over all workers (bf16 compute, fp32 master copy); the
reference, which nobody trains, in bf16 (`model.frozen_weight_dtype`: the dtype it computes in, no
master copy); AdamW keeps two fp32 states per parameter plus one fp32 `step` tensor per parameter tensor.
A model whose `fsdp_config.*_offload` is set lives on the host between calls and is loaded onto the
GPU for its own phase (`_onload` / `_offload`): offload lowers what the *other* phases see, not its own.

An update has two peaks, and its phase is the larger (`Phase.moments`, `Phase.binding` say which):
- the backward: parameters, gradients and AdamW state, the gathered units, staging, head, activations;
- the optimizer step: torch's AdamW takes its foreach path on CUDA (DTensor is a foreach type), and
  `_multi_tensor_adam` allocates `exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)`, a full fp32
  copy of the local shard, while parameters, gradients, exp_avg and exp_avg_sq are live: 5 x the
  fp32 shard. Measured on an H200 (tests/utils/gpu_measurements/memory_plan_*.json): Qwen2.5-3B's first update
  peaks there (61.79 GB measured, 61.72 planned).
AdamW creates its state inside the first `step()`, so the backward of a model's first update holds
none: `plan_memory(..., first_update=True)` plans that update; the default (what preflight checks)
is every later one, the larger.

Two kinds of numbers, kept apart in every phase:
- certain: parameters, gradients, optimizer states and their shards, the vLLM pool
  (gpu_memory_utilization x device memory: vLLM's own budget for weights + KV cache), the fused
  log-prob head's bytes (`head_bytes`: one chunk's vocabulary-wide temporaries, what it keeps per
  response token, and in the update the lm_head gradient's fp32 accumulator), the HF export's
  staging (one gathered fp32 parameter at a time: the embeddings); exact byte counts for the
  shapes the config gives.
- estimated: activations (per-token per-layer factors, below), labelled `estimated` in each phase.
Ulysses SP (`ulysses_sequence_parallel_size`): a rank of an SP group holds 1/SP of its micro-batch's
tokens (activations), and its log-prob head runs on all of them (every position of the slice, not the
response positions only); micro-batch rows are per data-parallel rank (world / SP).

Mixture-of-experts (Qwen3-MoE, Qwen2-MoE, Mixtral; `ModelShape` reads their config.json): weights,
gradients, AdamW state, the gathered decoder layer (FSDP2 gathers every expert of a layer) and the
HF export's largest tensor (a layer's fused gate_up experts) count the *total* parameters; the
activations count the *active* ones (each token runs `experts_per_token` experts), as do FLOPs and
MFU (verl/utils/flops_counter.py). Qwen3's attention is sized by its own head_dim (heads x head_dim
need not be hidden_size) and has q/k norms.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verl.utils.memory_plan_lora import lora_actor_bytes, lora_counts, lora_note

GIB = 1024 ** 3
FP32, BF16 = 4, 2
# What a GPU needs beyond a plan's bytes, kept free by every verdict (`trainer.gpu_memory_reserve_gib`):
# - the caching allocator's slack, reserved minus allocated at a phase's peak (fragmentation, blocks
#   rounded up): measured on an H200, at most 1.52 GiB (tests/utils/gpu_measurements/memory_plan_*_h200.json,
#   Qwen2.5-3B's update: 63.43 GB reserved, 61.79 GB allocated);
# - memory outside torch's allocator: the CUDA context and its kernels, cuBLAS/cuDNN handles, NCCL's
#   communicator buffers. Not in those files (torch cannot see it): an estimate until a GPU check measures it.
ALLOCATOR_SLACK_GIB = 1.52
OUTSIDE_ALLOCATOR_GIB = 1.0
DEFAULT_GPU_RESERVE_GIB = 2.6     # the two above, rounded up; ppo_trainer.yaml's default
RESERVE_KEY = "trainer.gpu_memory_reserve_gib"
# A card sold as "80 GB" exposes less: torch reports 79.1 GiB total on an H100 80GB (a little more on an
# A100 80GB). `trainer.gpu_memory_gib` given as the marketed figure is read as what the card exposes.
EXPOSED_GIB = {80: 79.1}
# AdamW (torch.optim.AdamW, not fused/capturable) state per parameter tensor: exp_avg and
# exp_avg_sq like the parameter (fp32), and `step`, a 0-dim fp32 tensor.
ADAM_STATES_PER_PARAM, ADAM_STEP_BYTES = 2, 4
# Activation estimate, bytes per token per layer in bf16 (labelled as estimated):
# without gradient checkpointing roughly the attention block's saved tensors (~10 h) and the
# MLP's (~4 intermediate), times 2 bytes; with checkpointing only each layer's input (h x 2 bytes)
# is kept, plus one layer's full set during its recompute.
ACT_FACTOR_H, ACT_FACTOR_I = 10, 4
# The update's optimizer step (foreach AdamW): the fp32 temporary `_foreach_sqrt(exp_avg_sqs)`, one per parameter.
ADAM_STEP_TEMPORARIES = 1
# The reference policy's parameters on a GPU: bf16 (verl/utils/model.py frozen_weight_dtype).
REF_BYTES = BF16
REF_PARAMS = "reference params (bf16 shard)"
# vLLM pads the vocabulary of its embeddings and LM head to a multiple of this (DEFAULT_VOCAB_PADDING_SIZE).
VLLM_VOCAB_PADDING = 64


# Model types whose attention normalises q and k per head (one RMSNorm weight of head_dim each).
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only (Qwen2 / Qwen3 / Llama-style, dense or MoE) config.json that fix its
    tensor sizes. MoE: `num_experts` routed experts of width `moe_intermediate_size` in `moe_layers` of
    the layers (the others dense, width `intermediate_size`), `experts_per_token` of them per token, plus
    a shared expert of width `shared_expert_intermediate_size` (Qwen2-MoE) when it is not 0."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool
    attention_bias: bool = True    # Qwen2: q/k/v projections carry a bias, o_proj does not
    max_position_embeddings: int = 0
    source: str = ""
    explicit_head_dim: int = 0     # config.json's head_dim (Qwen3: 128 at every size); 0: hidden / heads
    qk_norm: bool = False          # Qwen3: RMSNorm on q and k per head
    num_experts: int = 0           # routed experts per MoE layer; 0: a dense model
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    moe_layers: int = 0            # layers whose MLP is the MoE block

    @classmethod
    def from_config(cls, config: dict[str, Any], source: str = "") -> ModelShape:
        missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                               "vocab_size") if k not in config]
        if missing:
            raise ValueError(f"{source or 'config.json'}: missing {missing}; a memory plan needs a decoder "
                             "config with these keys (e.g. example/model_configs/qwen2.5-7b/config.json)")
        model_type = config.get("model_type", "qwen2")
        layers = int(config["num_hidden_layers"])
        experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
        moe_width = int(config.get("moe_intermediate_size") or 0)
        if model_type == "mixtral":   # every layer's MLP is the MoE block; intermediate_size is an expert's width
            moe_width, moe_layers = int(config["intermediate_size"]), layers if experts else 0
        else:
            step = int(config.get("decoder_sparse_step") or 1)
            dense_only = set(config.get("mlp_only_layers") or [])
            moe_layers = sum(1 for i in range(layers) if i not in dense_only and (i + 1) % step == 0) if experts else 0
        return cls(hidden_size=int(config["hidden_size"]), intermediate_size=int(config["intermediate_size"]),
                   num_hidden_layers=layers,
                   num_attention_heads=int(config["num_attention_heads"]),
                   num_key_value_heads=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
                   vocab_size=int(config["vocab_size"]),
                   tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                   attention_bias=bool(config.get("attention_bias", model_type in ("qwen2", "qwen2_moe"))),
                   max_position_embeddings=int(config.get("max_position_embeddings") or 0), source=source,
                   explicit_head_dim=int(config.get("head_dim") or 0), qk_norm=model_type in QK_NORM_MODEL_TYPES,
                   num_experts=experts, experts_per_token=int(config.get("num_experts_per_tok") or 0) if experts else 0,
                   moe_intermediate_size=moe_width if experts else 0,
                   shared_expert_intermediate_size=int(config.get("shared_expert_intermediate_size") or 0)
                   if experts else 0, moe_layers=moe_layers)

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.num_attention_heads

    @property
    def q_width(self) -> int:
        """Output width of q_proj (input of o_proj): heads x head_dim, not always hidden_size (Qwen3-32B)."""
        return self.num_attention_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.moe_layers > 0

    def _attention(self) -> tuple[int, int]:
        """(parameters, tensors) of one layer's attention and its two RMSNorms."""
        h, q, kv = self.hidden_size, self.q_width, self.num_key_value_heads * self.head_dim
        params, tensors = h * q + 2 * h * kv + q * h, 4        # q, k, v, o weights
        if self.attention_bias:
            params, tensors = params + q + 2 * kv, tensors + 3  # q, k, v biases
        if self.qk_norm:
            params, tensors = params + 2 * self.head_dim, tensors + 2
        return params + 2 * h, tensors + 2                     # + input / post-attention RMSNorm

    def _moe_mlp(self, experts: int) -> tuple[int, int]:
        """(parameters, tensors) of one MoE block counting `experts` routed experts: fused gate_up and
        down (2 tensors), the router, and the shared expert with its gate when the model has one."""
        h = self.hidden_size
        params, tensors = experts * 3 * h * self.moe_intermediate_size + self.num_experts * h, 3
        if self.shared_expert_intermediate_size:
            params, tensors = params + 3 * h * self.shared_expert_intermediate_size + h, tensors + 4
        return params, tensors

    def _layer(self, moe: bool = False, active: bool = False) -> tuple[int, int]:
        """(parameters, parameter tensors) of one decoder layer, dense or MoE (`active`: the experts one
        token runs, not all of them)."""
        attn, attn_tensors = self._attention()
        if moe:
            mlp, mlp_tensors = self._moe_mlp(self.experts_per_token if active else self.num_experts)
        else:
            mlp, mlp_tensors = 3 * self.hidden_size * self.intermediate_size, 3   # gate, up, down
        return attn + mlp, attn_tensors + mlp_tensors

    def _layers(self, active: bool = False) -> tuple[int, int]:
        dense = self.num_hidden_layers - self.moe_layers
        d, dt = self._layer(False)
        m, mt = self._layer(True, active) if self.moe_layers else (0, 0)
        return dense * d + self.moe_layers * m, dense * dt + self.moe_layers * mt

    def backbone(self) -> tuple[int, int]:
        """(parameters, tensors) of embeddings + layers + final norm."""
        layers, layer_tensors = self._layers()
        return self.vocab_size * self.hidden_size + layers + self.hidden_size, 2 + layer_tensors

    def active_params(self) -> int:
        """Parameters of the causal LM one token runs through (MoE: `experts_per_token` experts of each
        MoE layer; dense: all): what FLOPs and activations scale with. Counts the head as `causal_lm`."""
        params, _ = self.causal_lm()
        return params - self._layers()[0] + self._layers(active=True)[0]

    @property
    def active_intermediate_size(self) -> int:
        """MLP width one token's activations span in a layer: a dense layer's intermediate_size, an MoE
        layer's experts_per_token expert widths plus the shared expert's (the wider of the two kinds when
        the model mixes them)."""
        moe = self.experts_per_token * self.moe_intermediate_size + self.shared_expert_intermediate_size
        if self.moe_layers == self.num_hidden_layers:
            return moe
        return max(moe, self.intermediate_size) if self.moe_layers else self.intermediate_size

    def causal_lm(self) -> tuple[int, int]:
        """(parameters, tensors) of the policy / reference (XForCausalLM; a tied head adds none)."""
        params, tensors = self.backbone()
        if not self.tie_word_embeddings:
            params, tensors = params + self.vocab_size * self.hidden_size, tensors + 1
        return params, tensors

    def vllm_params(self) -> int:
        """Parameters a vLLM engine holds for the policy (tests/utils/test_memory_plan_vllm.py): the causal
        LM's, fused (qkv_proj, gate_up_proj: the same elements; a tied head held once), but the embeddings
        and an untied head have the vocabulary padded to a multiple of VLLM_VOCAB_PADDING rows."""
        padded = -(-self.vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
        heads = 1 if self.tie_word_embeddings else 2
        return self.causal_lm()[0] + heads * (padded - self.vocab_size) * self.hidden_size

    def value_model(self) -> tuple[int, int]:
        """(parameters, tensors) of the critic (XForTokenClassification: backbone + Linear(h, 1) with bias)."""
        params, tensors = self.backbone()
        return params + self.hidden_size + 1, tensors + 2

    def layer_params(self) -> int:
        """Parameters of the largest decoder layer (FSDP2's unit; an MoE layer with all its experts)."""
        return max(self._layer(False)[0] if self.moe_layers < self.num_hidden_layers else 0,
                   self._layer(True)[0] if self.moe_layers else 0)

    def largest_tensor_params(self) -> int:
        """Elements of the largest single parameter tensor of the model in memory (the embeddings for
        Qwen2.5; an MLP projection for a model with a small vocabulary; an MoE layer's fused gate_up
        experts, num_experts x 2 x moe_intermediate_size x hidden, for Qwen3-30B-A3B): what a
        one-tensor-at-a-time gather holds (the HF export, a weight push)."""
        h = self.hidden_size
        fused = 2 * self.num_experts * self.moe_intermediate_size * h if self.moe_layers else 0
        return max(self.vocab_size * h, self.intermediate_size * h, self.q_width * h, fused)

    def largest_stored_params(self) -> int:
        """Elements of the largest tensor of the model's checkpoint: the sharded load's broadcast unit
        (verl/utils/sharded_init.py). MoE checkpoints store one tensor per expert and projection, so the
        fused experts never travel whole: this is the embeddings for every Qwen3 and Qwen2.5 model."""
        h = self.hidden_size
        dense = self.intermediate_size if self.moe_layers < self.num_hidden_layers else 0
        return max(self.vocab_size * h, dense * h, self.q_width * h, self.moe_intermediate_size * h,
                   self.shared_expert_intermediate_size * h)

    def root_params(self) -> int:
        """Parameters of the causal LM outside its decoder layers (FSDP2's root unit): the embeddings,
        an untied lm_head, the final norm."""
        heads = 1 if self.tie_word_embeddings else 2
        return heads * self.vocab_size * self.hidden_size + self.hidden_size


def moe_note(shape: ModelShape) -> str:
    """The plan's line on a mixture-of-experts model: what counts total, what counts active."""
    total = shape.causal_lm()[0]
    return (f"MoE: {total / 1e9:.2f} B parameters, {shape.active_params() / 1e9:.2f} B active per token "
            f"({shape.experts_per_token} of {shape.num_experts} experts in {shape.moe_layers} layers): weights, "
            "gradients, AdamW state and the gathered layers count all experts; activations (and FLOPs / MFU) "
            "the active ones")


def read_model_config(path: str, cache_dir: str | None = None) -> tuple[dict[str, Any], str]:
    """config.json of a model folder (or of a hub id already in the local HF cache: `cache_dir`, else
    HF_HUB_CACHE); no download. Returns (config, where it was read); raises FileNotFoundError saying what to pass."""
    folder = Path(path)
    if (folder / "config.json").is_file():
        file = folder / "config.json"
        return json.loads(file.read_text()), str(file)
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(str(path), "config.json", cache_dir=cache_dir)
    except Exception:   # not a repo id (e.g. a missing local path): same message as no cache
        cached = None
    if isinstance(cached, str):
        return json.loads(Path(cached).read_text()), cached
    raise FileNotFoundError(f"no config.json at {path} (nor in the local Hugging Face cache): point the key at a "
                            "model folder, or at example/model_configs/<name> for a plan without weights")


def adamw_state_bytes(params: int, tensors: int) -> int:
    """Bytes of torch.optim.AdamW's state for `params` fp32 parameters in `tensors` tensors (after a step)."""
    return ADAM_STATES_PER_PARAM * FP32 * params + ADAM_STEP_BYTES * tensors


def _shard(total: int, world: int) -> int:
    """Per-rank bytes of an FSDP shard (even split, rounded up: FSDP2 pads the last rank)."""
    return -(-total // max(world, 1))


@dataclass
class Phase:
    """One phase's bytes (per GPU, or per node in the host plan): `certain` and `estimated` parts, by name.

    A phase with several peaks (an update: its backward and its optimizer step) lists each in
    `moments`; its own entries are those of the largest, named by `binding`."""

    name: str
    certain: dict[str, int] = field(default_factory=dict)
    estimated: dict[str, int] = field(default_factory=dict)
    moments: dict[str, Phase] = field(default_factory=dict)
    binding: str = ""

    @property
    def total(self) -> int:
        return sum(self.certain.values()) + sum(self.estimated.values())


def largest_moment(name: str, moments: dict[str, Phase]) -> Phase:
    """The phase `name` whose bytes are those of the largest of `moments` (all kept, itemised)."""
    binding = max(moments, key=lambda k: moments[k].total)
    top = moments[binding]
    return Phase(name, dict(top.certain), dict(top.estimated), moments=moments, binding=binding)


@dataclass
class MemoryPlan:
    """Per-GPU plan: phases, the shapes it came from, and the facts a report prints."""

    world: int
    actor_params: int
    actor_tensors: int
    critic_params: int | None
    critic_tensors: int | None
    phases: list[Phase]
    notes: list[str]
    device_gib: float | None
    sequence_length: int
    lora_params: int = 0          # LoRA: the adapter's parameters (actor_params: the frozen base's)
    lora_tensors: int = 0
    actor_active_params: int = 0  # parameters one token runs through (MoE: its experts_per_token experts)

    def phase_gib(self) -> dict[str, float]:
        return {p.name: round(p.total / GIB, 2) for p in self.phases}

    def largest(self) -> tuple[str, float]:
        phase = max(self.phases, key=lambda p: p.total)
        return phase.name, round(phase.total / GIB, 2)

    def checkpoint_bytes(self, save_hf_model: bool) -> int:
        """Bytes on disk of one checkpoint: fp32 params + AdamW state of actor (and critic), plus the
        HF export in bf16 when `trainer.save_hf_model`."""
        if self.lora_params:   # LoRA: the adapter and its AdamW state (the base is model.path's)
            size = FP32 * self.lora_params + adamw_state_bytes(self.lora_params, self.lora_tensors)
            if save_hf_model:   # the export: the adapter alone (fp32)
                size += FP32 * self.lora_params
            save_hf_model = False
        else:
            size = FP32 * self.actor_params + adamw_state_bytes(self.actor_params, self.actor_tensors)
        if self.critic_params is not None and self.critic_tensors is not None:
            size += FP32 * self.critic_params + adamw_state_bytes(self.critic_params, self.critic_tensors)
        if save_hf_model:
            size += BF16 * self.actor_params
        return size


def sequence_length(cfg: Any) -> int:
    """Tokens of one training row at the max lengths: the initial prompt bound plus `response_length_bound`."""
    from verl.trainer.run_config import Protocol

    return Protocol.from_config(cfg).prompt_bound + response_length_bound(cfg)


def response_length_bound(cfg: Any) -> int:
    """The widest a batch's padded response can be. Tag protocol with search, as the original composes
    a row: (max_turns + 1) responses + max_turns observations; otherwise (one turn, or the tool
    protocol, whose data.max_response_length bounds all turns together) data.max_response_length."""
    data = cfg.data
    tool = bool(cfg.actor_rollout_ref.rollout.get("multi_turn", {}).get("enable", False))
    if cfg.do_search and not tool:
        turns = int(cfg.max_turns)
        return (turns + 1) * int(data.max_response_length) + turns * int(data.max_obs_length)
    return int(data.max_response_length)


def _micro_rows(run: Any, key: str, sp: int = 1) -> int:
    """Rows of one micro-batch of `key` per worker (run: run_config.RunConfig); with Ulysses SP the
    rows of a data-parallel rank, over world / sp ranks (every rank of an SP group holds them)."""
    return max(1, run.batches.micro_rows(key) * sp // max(run.pools.world_size, 1))


def sp_size(node: Any, world: int) -> int:
    """A section's ulysses_sequence_parallel_size where it is a valid divisor of the world, else 1."""
    size = node.get("ulysses_sequence_parallel_size", 1)
    return size if isinstance(size, int) and not isinstance(size, bool) and size >= 1 and world % size == 0 else 1


def head_bytes(shape: ModelShape, kept: int, backward: bool, chunk_rows: int | None = None,
               per: str = "response token") -> dict[str, int]:
    """The fused log-prob head's GPU bytes (verl/utils/logprob_head.py) for `kept` positions of one
    micro-batch (the response positions; under Ulysses SP every position of the rank's slice, `per`
    naming which in the key), with bf16 compute (FSDP2 mixed precision).

    - chunk: `chunk_rows` positions (HEAD_CHUNK_ROWS) at a time; at most two (c, V) fp32 tensors
      live together (the logits and logsumexp's / softmax's temporary, forward and backward); in a
      backward over several chunks, also the moment the chunk's bf16 logit gradient and its (V, H)
      bf16 weight-gradient product exist together.
    - per kept position: the output, logsumexp and E_p[z] (16 bytes); in the update also the bf16
      hidden state autograd keeps and the backward's bf16 gradient for it.
    - update: the lm_head weight's gradient buffer, bf16, or fp32 when several chunks add into it.
    """
    from verl.utils.logprob_head import HEAD_CHUNK_ROWS

    rows = max(1, min(kept, chunk_rows or HEAD_CHUNK_ROWS))
    vocab, hidden = shape.vocab_size, shape.hidden_size
    chunk = 2 * FP32 * rows * vocab
    several = backward and kept > rows
    if several:
        chunk = max(chunk, BF16 * rows * vocab + BF16 * vocab * hidden)
    out = {f"log-prob head chunk ({rows} rows x vocab)": chunk,
           f"log-prob head per {per}": kept * (16 + (2 * BF16 * hidden if backward else 0))}
    if backward:
        out["log-prob head lm_head grad"] = (FP32 if several else BF16) * vocab * hidden
    return out


def _activations(shape: ModelShape, tokens: int, checkpointing: bool, backward: bool) -> int:
    """Estimated activation bytes for `tokens` tokens (forward only keeps one layer's at a time)."""
    per_layer = BF16 * tokens * (ACT_FACTOR_H * shape.hidden_size + ACT_FACTOR_I * shape.active_intermediate_size)
    if not backward:
        return per_layer
    if checkpointing:
        return BF16 * tokens * shape.hidden_size * shape.num_hidden_layers + per_layer
    return per_layer * shape.num_hidden_layers


def _update(name: str, model: str, others: dict[str, int], params: int, grads: int, optim: int,
            backward: dict[str, int], activations: int, first_update: bool, trained: int | None = None) -> Phase:
    """`model`'s update phase: the larger of its backward (`backward`: the gathered units, staging and
    head beside its params, grads and, after its first step, AdamW state) and its optimizer step."""
    own = {f"{model} params (fp32 shard)": params, f"{model} grads (fp32 shard)": grads}
    state = {f"{model} AdamW state (shard)": optim}
    # The step: `_multi_tensor_adam`'s `_foreach_sqrt(exp_avg_sqs)`, a full fp32 copy of the shard, beside
    # params, grads and both moments (clip_grad_norm_ scales the grads in place; AdamW's `step` counters
    # are host tensors unless capturable/fused).
    temporary = {f"{model} AdamW step temporary (foreach sqrt of exp_avg_sq, fp32 shard)":
                 ADAM_STEP_TEMPORARIES * (params if trained is None else trained)}   # trained: LoRA's adapter
    return largest_moment(name, {
        "backward": Phase("backward", certain={**others, **own, **({} if first_update else state), **backward},
                          estimated={"activations": activations}),
        "optimizer step": Phase("optimizer step", certain={**others, **own, **state, **temporary})})


def plan_memory(cfg: Any, device_gib: float | None = None, model_config: dict[str, Any] | None = None,
                critic_config: dict[str, Any] | None = None, first_update: bool = False) -> MemoryPlan:
    """The plan for the composed (resolved) trainer config `cfg` over `nnodes x n_gpus_per_node` GPUs
    (with trainer.pipeline: the train pool's phases, and the rollout pool's GPU as phase rollout_pool).

    `model_config` / `critic_config`: the config.json dicts (default: read from
    actor_rollout_ref.model.path / critic.model.path). `device_gib`: the GPU's memory, for the vLLM
    pool (gpu_memory_utilization x it); without it the rollout phases count the vLLM weights only.
    `first_update`: plan each model's first update (no AdamW state yet in its backward) instead of
    the steady state every later update reaches.
    """
    from verl.trainer.run_config import RunConfig

    run = RunConfig.from_config(cfg)
    world = run.pools.world_size
    arr = cfg.actor_rollout_ref
    notes: list[str] = []
    if model_config is None:
        model_config, _ = read_model_config(str(arr.model.path))
    shape = ModelShape.from_config(model_config, str(arr.model.path))
    p, t = shape.causal_lm()
    with_critic = run.algorithm.need_critic
    if with_critic:
        if critic_config is None:
            critic_config, _ = read_model_config(str(cfg.critic.model.path))
        cshape = ModelShape.from_config(critic_config, str(cfg.critic.model.path))
        cp, ct = cshape.value_model()
    with_ref = run.algorithm.need_reference_policy
    seq = sequence_length(cfg)
    response = seq - run.protocol.prompt_bound       # positions the head runs on, per row
    # FSDP2 gathers one decoder layer's unit in bf16 for compute, and the next one beside it: it prefetches
    # one unit ahead in backward (FSDPParamGroup._backward_prefetch) and, in forward, keeps the current
    # all-gather's output until the next unit's copy-in.
    lora = lora_counts(shape, arr.model)   # LoRA: bf16 frozen base, fp32 adapter + AdamW, no reference weights
    layer = shape.layer_params() + (lora.per_layer if lora else 0)
    layers = {"gathered layer (bf16)": BF16 * layer, "gathered next layer (bf16, FSDP2 prefetch)": BF16 * layer}
    if shape.is_moe:   # the gathered unit holds every expert of the layer, not the ones a token runs
        label = f", all {shape.num_experts} experts"
        layers = {k.replace("(bf16", f"(bf16{label}", 1): v for k, v in layers.items()}
        notes.append(moe_note(shape))

    afs = arr.actor.fsdp_config
    actor_params = _shard(FP32 * p, world)
    actor_grads = _shard(FP32 * p, world)
    actor_optim = _shard(adamw_state_bytes(p, t), world)
    adapter = None
    if lora is not None:   # (adapter shard, actor params, grads, AdamW state) per GPU
        adapter, actor_params, actor_grads, actor_optim = lora_actor_bytes(lora, p, world, _shard, adamw_state_bytes)
        notes.append(lora_note(lora, int(arr.model.lora_rank)))
    with_ref_weights = with_ref and lora is None
    # What stays on the GPU between calls (offload moves it to the host).
    resident: dict[str, int] = {}
    if not afs.param_offload:
        resident["actor params (fp32 shard)"] = actor_params
    if not afs.optimizer_offload:
        resident["actor AdamW state (shard)"] = actor_optim
    if with_ref_weights and not arr.ref.fsdp_config.param_offload:
        resident[REF_PARAMS] = _shard(REF_BYTES * p, world)
    if with_critic:
        cfs = cfg.critic.model.fsdp_config
        critic_params = _shard(FP32 * cp, world)
        critic_optim = _shard(adamw_state_bytes(cp, ct), world)
        if not cfs.param_offload:
            resident["critic params (fp32 shard)"] = critic_params
        if not cfs.optimizer_offload:
            resident["critic AdamW state (shard)"] = critic_optim

    def others(*own: str) -> dict[str, int]:
        return {k: v for k, v in resident.items() if not any(k.startswith(o) for o in own)}

    phases: list[Phase] = []
    ckpt = bool(arr.model.enable_gradient_checkpointing)

    def tokens_of(dynamic: bool, max_tokens: int, micro_key: str, sp: int = 1) -> tuple[int, int]:
        """(tokens, head positions) one rank holds of one micro-batch: packed by tokens (use_dynamic_bsz:
        up to max_tokens per rank, all of them possibly response positions), or micro rows at the max
        lengths. Ulysses (sp > 1): the micro-batch is over world / sp data-parallel ranks and each
        rank of an SP group runs 1/sp of its tokens (max_tokens is per rank already, as veRL); the
        log-prob head then runs on every position of the rank's slice, not the response ones only
        (DataParallelPPOActor._head_sequence_parallel labels each with its next token)."""
        if dynamic:
            return max_tokens, max_tokens
        rows = _micro_rows(run, micro_key, sp)
        tokens = -(-rows * seq // sp)
        return tokens, tokens if sp > 1 else rows * response

    # FSDP2's root unit (embeddings, an untied lm_head, the final norm) stays gathered in bf16 through a
    # forward and a backward; the update's reduce-scatter stages one unit's bf16 gradient and its fp32 copy.
    root_bf16 = BF16 * shape.root_params()
    staging = (BF16 + FP32) * max(shape.layer_params(), shape.root_params())
    # actor update: its own params, grads and optimizer on the GPU, one micro-batch's head and activations
    sp = sp_size(arr.actor, world)
    head_per = "response token" if sp == 1 else "position of the SP slice"
    tokens, kept = tokens_of(bool(arr.actor.use_dynamic_bsz), int(arr.actor.ppo_max_token_len_per_gpu),
                             "actor_rollout_ref.actor.ppo_micro_batch_size", sp)
    head = head_bytes(shape, kept, backward=True, per=head_per)
    if lora is not None:   # only the adapter's grads are reduced; the frozen lm_head gets no gradient
        staging = (BF16 + FP32) * lora.per_layer
        head.pop("log-prob head lm_head grad", None)
    phases.append(_update("actor_update", "actor", others("actor"), actor_params, actor_grads, actor_optim, {
        "gathered root unit (bf16)": root_bf16, **layers, "reduce-scatter staging (bf16 + fp32)": staging, **head},
        _activations(shape, tokens, ckpt, backward=True), first_update, trained=adapter))
    # log-prob passes (old policy, and the reference's), each with its own dynamic-batching keys; bypass
    # mode (algorithm.rollout_correction) takes the old log-probs from the engine: no old-policy pass
    if not run.algorithm.bypass:
        lp_tokens, lp_kept = tokens_of(bool(arr.rollout.log_prob_use_dynamic_bsz),
                                       int(arr.rollout.log_prob_max_token_len_per_gpu),
                                       "actor_rollout_ref.rollout.log_prob_micro_batch_size", sp)
        phases.append(Phase("actor_log_prob", certain={
            **others("actor params"), "actor params (fp32 shard)": actor_params,
            "gathered root unit (bf16)": root_bf16, **layers, **head_bytes(shape, lp_kept, backward=False, per=head_per)},
            estimated={"activations": _activations(shape, lp_tokens, ckpt, backward=False)}))
    if with_ref:
        ref_tokens, ref_kept = tokens_of(bool(arr.ref.log_prob_use_dynamic_bsz),
                                         int(arr.ref.log_prob_max_token_len_per_gpu),
                                         "actor_rollout_ref.ref.log_prob_micro_batch_size", sp)
        ref_params = ({REF_PARAMS: _shard(REF_BYTES * p, world)} if with_ref_weights else
                      {"actor params (fp32 shard)": actor_params})   # LoRA: the actor, adapter off
        phases.append(Phase("reference_log_prob", certain={
            **others("reference" if with_ref_weights else "actor params"), **ref_params,
            "gathered root unit (bf16)": root_bf16, **layers, **head_bytes(shape, ref_kept, backward=False, per=head_per)},
            estimated={"activations": _activations(shape, ref_tokens, False, backward=False)}))
    if with_critic:
        critic_cfg = cfg.critic
        c_dyn = bool(critic_cfg.use_dynamic_bsz)
        c_ckpt = bool(critic_cfg.model.enable_gradient_checkpointing)
        c_root = BF16 * (cshape.root_params() - (0 if cshape.tie_word_embeddings else
                                                  cshape.vocab_size * cshape.hidden_size))  # no lm_head
        c_layers = {k: BF16 * cshape.layer_params() for k in layers}
        # the value pass (compute_values), with its own micro-batch keys
        c_sp = sp_size(critic_cfg, world)
        v_tokens, _ = tokens_of(c_dyn, int(critic_cfg.forward_max_token_len_per_gpu), "critic.forward_micro_batch_size",
                                c_sp)
        phases.append(Phase("critic_values", certain={
            **others("critic params"), "critic params (fp32 shard)": critic_params,
            "gathered root unit (bf16)": c_root, **c_layers},
            estimated={"activations": _activations(cshape, v_tokens, False, backward=False)}))
        c_tokens, _ = tokens_of(c_dyn, int(critic_cfg.ppo_max_token_len_per_gpu), "critic.ppo_micro_batch_size", c_sp)
        phases.append(_update("critic_update", "critic", others("critic"), critic_params,
                              _shard(FP32 * cp, world), critic_optim, {
                                  "gathered root unit (bf16)": c_root, **c_layers,
                                  "reduce-scatter staging (bf16 + fp32)":
                                      (BF16 + FP32) * max(cshape.layer_params(), c_root // BF16)},
                              _activations(cshape, c_tokens, c_ckpt, backward=True), first_update))
    phases.extend(_rollout_phases(cfg, shape, resident, device_gib, notes))
    # checkpoint save: the actor's sharded state onloaded, plus (trainer.save_hf_model) the HF export's
    # staging: hf_export.py gathers one full parameter at a time (`full_tensor()`, fp32) on every rank,
    # and rank 0 casts it to the export dtype (bf16 on GPU) before copying it to the host.
    save = {**others("actor"), "actor params (fp32 shard)": actor_params, "actor AdamW state (shard)": actor_optim}
    if cfg.trainer.save_hf_model:
        save["HF export staging (largest full tensor: fp32 + its bf16 copy on rank 0)"] = \
            (FP32 + BF16) * shape.largest_tensor_params()
    phases.append(Phase("checkpoint_save", certain=save))
    return MemoryPlan(world=world, actor_params=p, actor_tensors=t, critic_params=cp if with_critic else None,
                      critic_tensors=ct if with_critic else None, phases=phases, notes=notes,
                      device_gib=device_gib, sequence_length=seq, lora_params=lora.params if lora else 0,
                      lora_tensors=lora.tensors if lora else 0, actor_active_params=shape.active_params())


def engine_weights_name(cfg: Any) -> str:
    """The rollout engine that holds the policy's weights on a GPU: "hf" when rollout.name says so, else
    "vllm" (auto resolves to vLLM on a GPU host)."""
    return "hf" if str(cfg.actor_rollout_ref.rollout.name) == "hf" else "vllm"


def _rollout_phases(cfg: Any, shape: ModelShape, resident: dict[str, int], device_gib: float | None,
                    notes: list[str]) -> list[Phase]:
    """rollout: vLLM's budget (weights + KV pool) beside what the trainer keeps resident; the wake
    (free_cache_engine) runs after the training allocator's cache is emptied, so the same sum.
    trainer.pipeline: the rollout pool's GPU (its engine and one full tensor arriving) and the train
    pool's GPU while it sends (one full tensor at a time in the engine's dtype, bf16 on CUDA)."""
    from verl.trainer.run_config import Pools

    pipelined = Pools.from_config(cfg).pipelined
    rollout = cfg.actor_rollout_ref.rollout
    tp = int(rollout.tensor_model_parallel_size)
    util = float(rollout.gpu_memory_utilization)
    # The engine's parameters in bf16 (vocabulary padded; exact at TP=1). Not counted: its buffers (the rotary
    # table, max_position_embeddings x head_dim in bf16, and 4 fp32 attention scales per layer).
    vllm_weights = _shard(BF16 * shape.vllm_params(), tp)
    largest_engine = BF16 * shape.largest_tensor_params()
    phases: list[Phase] = []
    certain = dict(resident)
    if pipelined:
        # The rollout pool holds no FSDP copy of the policy: a push arrives one full tensor at a time, in
        # the engine's dtype, straight into the engine's weights.
        # every train rank casts its shard of a tensor to the engine's dtype and all-gathers the full tensor
        # (verl/workers/weight_sync.py send_state); rank 0 broadcasts it
        world = Pools.from_config(cfg).world_size
        phases.append(Phase("weight_sync_send", certain={
            **resident, "weight-sync shard cast to bf16 (largest tensor / train ranks)": _shard(largest_engine, world),
            "weight-sync send buffer (largest full tensor, bf16)": largest_engine}))
        certain = {"weight-sync receive buffer (largest full tensor, bf16)": largest_engine}
        if engine_weights_name(cfg) != "hf":
            # vLLM keeps a received tensor until its layer is complete, then rebuilds that layer's TP shard
            certain["vLLM's rebuilt layer shard during a push (largest tensor / TP)"] = _shard(largest_engine, tp)
        if engine_weights_name(cfg) == "hf":
            certain["HF engine weights (one unsharded bf16 copy)"] = BF16 * shape.causal_lm()[0]
            phases.append(Phase("rollout_pool", certain=certain))
            return phases
    if device_gib:
        certain[f"vLLM pool (gpu_memory_utilization={util:g} x {device_gib:g} GiB)"] = int(util * device_gib * GIB)
    else:
        certain["vLLM weights (bf16 / TP)"] = vllm_weights
        notes.append("vLLM's KV pool is gpu_memory_utilization x the GPU's memory: unknown without "
                     "trainer.gpu_memory_gib, so the rollout phase counts the vLLM weights only")
    phases.append(Phase("rollout_pool" if pipelined else "rollout", certain=certain))
    if device_gib and vllm_weights > util * device_gib * GIB:
        notes.append(f"vLLM weights {vllm_weights / GIB:.1f} GiB per GPU exceed its pool "
                     f"{util * device_gib:.1f} GiB: raise actor_rollout_ref.rollout.gpu_memory_utilization or "
                     "tensor_model_parallel_size")
    return phases
