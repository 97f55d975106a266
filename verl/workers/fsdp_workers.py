"""FSDP2 workers: the actor / rollout / reference worker and the critic worker.

The driver builds a worker group of these and calls their registered methods;
each method's docstring names the DataProto keys it reads and writes
(verl/utils/batch_keys.py). Batch sizes in the config are global (per training
step); each worker turns them into per-rank sizes in __init__, veRL style.

    wg = RayWorkerGroup(pool, RayClassWithInitArgs(ActorRolloutRefWorker, config=cfg.actor_rollout_ref,
                                                   role="actor_rollout_ref"))
    wg.init_model()
    out = wg.generate_sequences(prompts); out = out.union(wg.compute_log_prob(out))
    metrics = wg.update_actor(batch).meta_info["metrics"]
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import open_dict
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from verl.protocol import DataProto
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, MeshRank, register
from verl.trainer.ppo.registry import CUSTOM_ALGORITHMS_WORKER_KEY, load_custom_algorithms
from verl.trainer.run_config import default_micro_per_worker
from verl.utils import batch_keys as K
from verl.utils import device as device_utils
from verl.utils import fsdp_utils
from verl.utils.attention import attn_implementation
from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
from verl.utils.checkpoint.shared_dir import RankMarker, write_rank_marker
from verl.utils.device import get_device_name, get_dist_backend
from verl.utils.lora import LoraSpec, adapter_disabled, adapter_state, merged_state
from verl.utils.model import build_causal_lm, build_value_model, get_model_flops_info
from verl.utils.sharded_init import load_sharded_model
from verl.utils.tokenizer import eos_token_ids
from verl.workers.actor.dp_actor import DataParallelPPOActor
from verl.workers.critic.dp_critic import DataParallelPPOCritic
from verl.workers.rollout import HFRollout, build_rollout
from verl.workers.sharding_manager.fsdp_hf import FSDPUnshardedForGeneration
from verl.workers.sp_groups import SPGroups, check_sequence_parallel, scale_token_budgets, sp_size

# actor_ref: the train pool of a pipelined run (trainer.pipeline), whose rollout is another pool's
ROLES = ("actor", "rollout", "ref", "actor_ref", "actor_rollout", "actor_rollout_ref")
# The rollout's data-parallel rank r of a run seeded s samples with s * stride + r (the ranks of
# one tensor-parallel engine share r, so they sample alike).
_SAMPLING_SEED_STRIDE = 1000
ROLLOUT_MESH = "rollout"


def rollout_mesh_rank(rank: int, world_size: int, tensor_parallel_size: int) -> MeshRank:
    """Where worker `rank` sits among the rollout engines: vLLM's tensor-parallel groups are runs of
    `tensor_parallel_size` consecutive ranks (external launcher); the first of each collects."""
    tp = int(tensor_parallel_size)
    if tp < 1 or world_size % tp != 0:
        raise ValueError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} must be >= 1 and divide the "
                         f"{world_size} workers (trainer.nnodes x trainer.n_gpus_per_node)")
    return MeshRank(rank // tp, world_size // tp, rank % tp == 0)


def _per_rank(node: Any, key: str, world_size: int, where: str, multiplier: int = 1) -> None:
    """node[key] = node[key] * multiplier // world_size, refusing sizes that do not divide."""
    total = int(node[key]) * multiplier
    if total % world_size != 0 or total < world_size:
        raise ValueError(f"{where}.{key}={node[key]} (x{multiplier}) is not divisible by the "
                         f"{world_size} data-parallel workers")
    with open_dict(node):
        node[key] = total // world_size


def _micro_per_rank(node: Any, key: str, world_size: int, where: str, default: int) -> None:
    """A micro-batch size, given over all workers (`key`, Search-R1) or per worker (`key`_per_gpu, veRL),
    becomes rows per worker in both keys (in place). Both null: `default` rows per worker."""
    per_gpu_key = f"{key}_per_gpu"
    total, per_gpu = node.get(key), node.get(per_gpu_key)
    if total is not None and per_gpu is not None:
        raise ValueError(f"{where}.{key}={total} and {where}.{per_gpu_key}={per_gpu} are both set: {key} counts "
                         f"rows over all workers, {per_gpu_key} rows per worker; set one of them")
    if per_gpu is not None:
        if isinstance(per_gpu, bool) or not isinstance(per_gpu, int) or per_gpu < 1:
            raise ValueError(f"{where}.{per_gpu_key}={per_gpu!r} must be an int >= 1")
        rows = per_gpu
    elif total is None:
        rows = default
    else:
        _per_rank(node, key, world_size, where)
        rows = int(node[key])
    with open_dict(node):
        node[key] = rows
        node[per_gpu_key] = rows


def _check_micro_divides_mini(node: Any, mini_key: str, micro_key: str, where: str) -> None:
    if node.get("use_dynamic_bsz", False):
        return
    if int(node[mini_key]) % int(node[micro_key]) != 0:
        raise ValueError(f"{where}.{mini_key}={node[mini_key]} per worker is not a multiple of "
                         f"{where}.{micro_key}={node[micro_key]} per worker")


def normalize_actor_batch_sizes(config: Any, role: str, world_size: int) -> None:
    """Global -> per-rank batch sizes for an ActorRolloutRefWorker config (in place).

    `ppo_mini_batch_size` counts rollouts (rows after the driver's n_agent repetition), times
    `rollout.n` (veRL's key, default 1), as in the original Search-R1; `rollout.n_agent` does
    not scale it. Micro-batch sizes count rows: `<key>` over all workers, or veRL's `<key>_per_gpu`
    per worker (one of the two; both null: run_config.default_micro_per_worker); afterwards both
    hold the rows per worker. Call once per config copy: it divides in place.
    """
    if role in ("actor", "actor_ref", "actor_rollout", "actor_rollout_ref"):
        actor = config.actor
        n = int(config.rollout.get("n", 1))
        _per_rank(actor, "ppo_mini_batch_size", world_size, "actor_rollout_ref.actor", multiplier=n)
        _micro_per_rank(actor, "ppo_micro_batch_size", world_size, "actor_rollout_ref.actor",
                        default_micro_per_worker("actor_rollout_ref.actor.ppo_micro_batch_size", world_size))
        _check_micro_divides_mini(actor, "ppo_mini_batch_size", "ppo_micro_batch_size", "actor_rollout_ref.actor")
    if role in ("actor", "actor_ref", "actor_rollout", "actor_rollout_ref"):   # the old log-probs (not a rollout pool's)
        _micro_per_rank(config.rollout, "log_prob_micro_batch_size", world_size, "actor_rollout_ref.rollout",
                        default_micro_per_worker("actor_rollout_ref.rollout.log_prob_micro_batch_size", world_size))
    if role in ("ref", "actor_ref", "actor_rollout_ref"):
        _micro_per_rank(config.ref, "log_prob_micro_batch_size", world_size, "actor_rollout_ref.ref",
                        default_micro_per_worker("actor_rollout_ref.ref.log_prob_micro_batch_size", world_size))


def normalize_critic_batch_sizes(config: Any, world_size: int) -> None:
    """Global -> per-rank batch sizes for a CriticWorker config (in place).

    Same semantics as the actor's: `ppo_mini_batch_size` counts rollouts, times `critic.rollout_n`
    (= `actor_rollout_ref.rollout.n`, default 1). The config must be resolved: an interpolation
    to the actor's mini-batch would read the actor's already divided value in a colocated worker.
    """
    n = int(config.get("rollout_n", 1))
    _per_rank(config, "ppo_mini_batch_size", world_size, "critic", multiplier=n)
    default = default_micro_per_worker("critic.ppo_micro_batch_size", world_size)
    _micro_per_rank(config, "ppo_micro_batch_size", world_size, "critic", default)
    if config.get("forward_micro_batch_size") is None and config.get("forward_micro_batch_size_per_gpu") is None:
        # Neither given (the YAML ties them to the update's pair): the update's micro-batch per worker.
        with open_dict(config):
            config.forward_micro_batch_size_per_gpu = config.ppo_micro_batch_size
    _micro_per_rank(config, "forward_micro_batch_size", world_size, "critic", default)
    _check_micro_divides_mini(config, "ppo_mini_batch_size", "ppo_micro_batch_size", "critic")


def check_supported(node: Any, where: str, world_size: int = 1, model_cfg: Any = None,
                    sequence_parallel: bool = True) -> int:
    """Refuse settings this FSDP2 build does not implement, naming the key, instead of ignoring them;
    returns the Ulysses SP size (verl/workers/sp_groups.py: packing on, divides the world and the
    model's head counts), 1 where the worker trains nothing (`sequence_parallel=False`: a rollout pool)."""
    if node.get("strategy", "fsdp") != "fsdp":
        raise ValueError(f"{where}.strategy={node.strategy!r}: only 'fsdp' (FSDP2) is supported")
    size = sp_size(node, where) if sequence_parallel else 1
    if size > 1:
        use_rmpad = bool(model_cfg.get("use_remove_padding", False)) if model_cfg is not None else False
        hf_config = None
        if model_cfg is not None and use_rmpad and world_size % size == 0:
            from transformers import AutoConfig

            hf_config = AutoConfig.from_pretrained(model_cfg.path)
            for key, value in (model_cfg.get("override_config") or {}).items():
                setattr(hf_config, key, value)
        check_sequence_parallel(size, world_size, use_rmpad, where, hf_config)
    return size


def check_fsdp_size(fsdp_cfg: Any, world_size: int, where: str) -> None:
    size = int(fsdp_cfg.get("fsdp_size", -1))
    if size not in (-1, world_size):
        raise NotImplementedError(f"{where}.fsdp_size={size}: hybrid sharding is not supported; "
                                  f"use -1 (shard over all {world_size} workers)")


class _FSDPWorkerBase(Worker):
    """Process-group set-up, model wrapping and offload shared by both workers."""

    def _init_distributed(self) -> None:
        if not dist.is_initialized():
            dist.init_process_group(backend=get_dist_backend(), rank=self.rank, world_size=self.world_size)
        self.device = get_device_name()
        if self.device == "cuda":
            # Ray may show each actor only its own GPU, which is then cuda:0.
            torch.cuda.set_device(self.local_rank % torch.cuda.device_count())
        self.device_mesh = init_device_mesh(self.device, (self.world_size,), mesh_dim_names=("fsdp",))

    def _attn_implementation(self, model_cfg: Any) -> str | None:
        """The registered packed attention (verl/utils/attention.py) when the model packs; sdpa otherwise."""
        return attn_implementation(self.device, bool(model_cfg.get("use_remove_padding", False)),
                                   str(model_cfg.get("packing_kernel", "varlen_attn")))

    def _prepare(self, module: nn.Module, model_cfg: Any, trainable: bool, lora: LoraSpec | None = None) -> None:
        """Gradient checkpointing, freezing, LoRA's adapters: what must be set before FSDP2 wraps the
        model. With LoRA the frozen base is kept in the compute dtype (bf16 on GPUs: no fp32 master
        copy of weights nobody trains); the fp32 adapter is all that requires grad."""
        if trainable and model_cfg.get("enable_gradient_checkpointing", False):
            module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if not trainable:
            module.requires_grad_(False)
        elif lora is not None:
            lora.inject(module, frozen_dtype=torch.bfloat16 if self.device == "cuda" else None)

    def _wrap(self, module: nn.Module, model_cfg: Any, trainable: bool) -> nn.Module:
        """An already loaded model: prepared, then FSDP2 over every decoder layer and the root."""
        self._prepare(module, model_cfg, trainable)
        mixed_precision = fsdp_utils.gpu_mixed_precision() if self.device == "cuda" else None
        module = fsdp_utils.apply_fsdp2(module, self.device_mesh, mixed_precision)
        if self.device == "cuda":
            module.to(self.device)
        return module

    def _load_sharded(self, build: Callable[[], nn.Module], model_cfg: Any, trainable: bool,
                      lora: LoraSpec | None = None) -> nn.Module:
        """`build()` on the meta device, prepared and sharded with FSDP2; rank 0 alone reads the
        checkpoint and streams it to every rank's shard (verl/utils/sharded_init.py: no rank ever
        holds the whole model). Weights the checkpoint lacks (the value head) are seeded with 0."""
        mixed_precision = fsdp_utils.gpu_mixed_precision() if self.device == "cuda" else None
        device = torch.device("cuda", torch.cuda.current_device()) if self.device == "cuda" else torch.device("cpu")
        module, _ = load_sharded_model(build, model_cfg.path, self.device_mesh, device,
                                       prepare=lambda m: self._prepare(m, model_cfg, trainable, lora),
                                       mixed_precision=mixed_precision, seed=0, adapter=lora)
        return module

    # Offload: params / grads / optimizer state live on the host between calls when asked.
    def _onload(self, module: nn.Module, optimizer: torch.optim.Optimizer | None, fsdp_cfg: Any) -> None:
        if fsdp_cfg.get("param_offload", False):
            fsdp_utils.load_fsdp_model_to_device(module, self.device)
        if fsdp_cfg.get("grad_offload", False):
            fsdp_utils.load_fsdp_grad(module, self.device)
        if optimizer is not None and fsdp_cfg.get("optimizer_offload", False):
            fsdp_utils.load_fsdp_optimizer(optimizer, self.device)

    def _offload(self, module: nn.Module, optimizer: torch.optim.Optimizer | None, fsdp_cfg: Any) -> None:
        if fsdp_cfg.get("param_offload", False):
            fsdp_utils.offload_fsdp_model_to_cpu(module)
        if fsdp_cfg.get("grad_offload", False):
            fsdp_utils.offload_fsdp_grad(module)
        if optimizer is not None and fsdp_cfg.get("optimizer_offload", False):
            fsdp_utils.offload_fsdp_optimizer(optimizer)
        if any(fsdp_cfg.get(key, False) for key in ("param_offload", "grad_offload", "optimizer_offload")):
            device_utils.empty_cache()   # what moved to host memory is free for other processes now


class ActorRolloutRefWorker(_FSDPWorkerBase):
    """The policy in its roles: trainer (actor), generator (rollout), frozen reference (ref)."""

    def __init__(self, config: Any, role: str) -> None:
        super().__init__()
        if role not in ROLES:
            raise ValueError(f"ActorRolloutRefWorker role {role!r} is not one of {ROLES}")
        self.config = config
        self.role = role
        self._is_actor = role in ("actor", "actor_ref", "actor_rollout", "actor_rollout_ref")
        self._is_rollout = role in ("rollout", "actor_rollout", "actor_rollout_ref")
        self._is_ref = role in ("ref", "actor_ref", "actor_rollout_ref")
        self._weight_sync: Any = None   # WeightSyncGroup of a pipelined run (train rank 0, rollout ranks)
        self._push_manifest: Any = None   # PushManifest: what a push sends, in which dtype (set on joining)
        # role rollout (a pipelined run's rollout pool): the engine alone, fed by pushes (verl/workers/rollout_pool.py)
        self._rollout_pool: Any = None
        # custom_algorithms.path (set here by the driver, `worker_config_with_custom_algorithms`): its
        # policy losses registered in this process before the actor looks its loss_mode up
        load_custom_algorithms(config.get(CUSTOM_ALGORITHMS_WORKER_KEY))
        self._sp_size = check_supported(config.actor, "actor_rollout_ref.actor", self.world_size, config.model,
                                        sequence_parallel=self._is_actor or self._is_ref)
        if self._is_ref and sp_size(config.ref, "actor_rollout_ref.ref") != self._sp_size:
            raise ValueError(f"actor_rollout_ref.ref.ulysses_sequence_parallel_size={config.ref.get('ulysses_sequence_parallel_size')} "
                             f"must equal actor_rollout_ref.actor.ulysses_sequence_parallel_size={self._sp_size} "
                             f"(one SP layout per worker, as veRL)")
        self._sp = SPGroups(1, 0)   # built in init_model (new_group needs the process group)
        check_fsdp_size(config.actor.fsdp_config, self.world_size, "actor_rollout_ref.actor.fsdp_config")
        if self._is_ref:
            check_fsdp_size(config.ref.fsdp_config, self.world_size, "actor_rollout_ref.ref.fsdp_config")
        # Data parallelism is over world / SP: each SP group shares its rows (sp_groups.py).
        normalize_actor_batch_sizes(self.config, role, self.world_size // self._sp_size)
        self._scale_token_budgets()
        tp = int(config.rollout.get("tensor_model_parallel_size", 1)) if self._is_rollout else 1
        self._rollout_tp = tp
        self._rollout_tp_group: Any = None   # gloo group of this rank's TP engine (TP > 1), set in init_model
        self._rollout_rank = rollout_mesh_rank(self.rank, self.world_size, tp)
        if self._is_rollout:
            self.set_mesh_rank(ROLLOUT_MESH, self._rollout_rank)
        # Generation phases (engine awake with current weights): nested opens, counted wakes.
        self._phase_depth = 0
        self._phase_stack: ExitStack | None = None
        self._phases_begun = 0

    def _scale_token_budgets(self) -> None:
        scale_token_budgets(self.config.actor, ("ppo_max_token_len_per_gpu",), self._sp_size)
        scale_token_budgets(self.config.rollout, ("log_prob_max_token_len_per_gpu",), self._sp_size)
        if self._is_ref:
            scale_token_budgets(self.config.ref, ("log_prob_max_token_len_per_gpu",), self._sp_size)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Join the process group, load and shard the models, build optimizer / rollout / ref."""
        self._init_distributed()
        self._sp = SPGroups.build(self.rank, self.world_size, self._sp_size)
        from transformers import AutoTokenizer

        model_cfg = self.config.model
        self.tokenizer = AutoTokenizer.from_pretrained(model_cfg.path)
        use_rmpad = bool(model_cfg.get("use_remove_padding", False))
        attn = self._attn_implementation(model_cfg)
        self.actor_module = self.actor_optimizer = self.actor_lr_scheduler = None
        self._weights_version = 0   # bumped by every change of the actor's weights
        # LoRA (model.lora_rank > 0): PEFT's adapters in the actor; the reference is the actor with them off
        self.lora = LoraSpec.from_model_config(model_cfg) if self._is_actor else None
        self.ref_module = None
        if self._is_actor:   # the rollout pool (role rollout) holds no FSDP copy: its engine is built below
            torch.manual_seed(0)   # as before the sharded load: the same RNG state on every rank after init
            self.actor_module = self._load_sharded(
                lambda: build_causal_lm(model_cfg.path, model_cfg.get("override_config"), attn, use_rmpad),
                model_cfg, trainable=self._is_actor, lora=self.lora)
            if self._is_actor:
                self.actor_optimizer, self.actor_lr_scheduler = fsdp_utils.build_optimizer(
                    self.actor_module, self.config.actor.optim)
            self.actor = DataParallelPPOActor(self.config.actor, self.actor_module, self.actor_optimizer,
                                              use_remove_padding=use_rmpad, sp_group=self._sp.sp_group)
        self.eos_token_ids = eos_token_ids(self.tokenizer, model_cfg.path)
        if self._is_rollout and self._rollout_tp > 1:
            # Every rank creates every group, in the same order (new_group is collective).
            for first in range(0, self.world_size, self._rollout_tp):
                group = dist.new_group(list(range(first, first + self._rollout_tp)), backend="gloo")
                if first <= self.rank < first + self._rollout_tp:
                    self._rollout_tp_group = group
        if self._is_rollout:
            device_index = self.local_device_index() if self.device == "cuda" else None
            if self._is_actor:
                self.rollout = build_rollout(self.config.rollout, self.actor_module, self.tokenizer,
                                             model_path=model_cfg.path, seed=self._sampling_seed(), device=self.device,
                                             device_index=device_index, lora=self.lora)
                self.rollout_sharding_manager = FSDPUnshardedForGeneration(self.actor_module)
            else:
                self._build_rollout_pool_engine(attn, device_index)
        if self._is_ref and self.lora is not None:
            self.ref_policy = self.actor   # compute_ref_log_prob: the actor with its adapter disabled
        elif self._is_ref:
            self.ref_module = self._load_sharded(
                lambda: build_causal_lm(model_cfg.path, model_cfg.get("override_config"), attn, use_rmpad),
                model_cfg, trainable=False)
            self.ref_policy = DataParallelPPOActor(self.config.ref, self.ref_module, None,
                                                   use_remove_padding=use_rmpad, sp_group=self._sp.sp_group)
            self._offload(self.ref_module, None, self.config.ref.fsdp_config)
        if self._is_actor:
            self.checkpoint_manager = FSDPCheckpointManager(
                self.actor_module, self.actor_optimizer, self.actor_lr_scheduler, self.tokenizer,
                lora=self.lora, base_model_path=model_cfg.path)
        if self.actor_module is not None:
            self._offload(self.actor_module, self.actor_optimizer, self.config.actor.fsdp_config)
        # Model building reseeded every rank alike; sampling should differ between data-parallel
        # rollout ranks (and agree within a tensor-parallel engine, whose ranks must sample the same
        # tokens) and follow the run's seed (rollout.seed defaults to trainer.seed).
        torch.manual_seed(self._sampling_seed())

    def _build_rollout_pool_engine(self, attn: str | None, device_index: int | None) -> None:
        """Role rollout: the engine with the model path's weights, in its compute dtype, and nothing else."""
        from verl.workers.rollout_pool import RolloutPoolEngine

        self._rollout_pool = RolloutPoolEngine.build(self.config, self.tokenizer, self.device, attn,
                                                     seed=self._sampling_seed(), device_index=device_index)
        self.rollout = self._rollout_pool.rollout

    def _sampling_seed(self, seed: int | None = None) -> int:
        """`seed` (default: rollout.seed) spread over the rollout's data-parallel ranks."""
        base = int(self.config.rollout.get("seed", 1)) if seed is None else int(seed)
        return base * _SAMPLING_SEED_STRIDE + self._rollout_rank.dp_rank

    def _require(self, flag: bool, method: str) -> None:
        if not flag:
            raise RuntimeError(f"{method} is not available for role {self.role!r}")

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, mesh=ROLLOUT_MESH)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Reads input_ids, attention_mask, position_ids (left-padded prompts) and meta_info
        eos_token_id, pad_token_id, do_sample, temperature, response_length, stop.
        Writes prompts, responses, input_ids, attention_mask, position_ids, rollout_log_probs.

        Rows are split over the rollout engines (a tensor-parallel engine's ranks get the same
        rows; one answers). Inside `rollout_wake_up` .. `rollout_sleep` the engine stays awake;
        a call outside them wakes it for this call only."""
        self._require(self._is_rollout, "generate_sequences")
        prompts = prompts.to(self.device)
        prompts.meta_info.setdefault(K.META_EOS_TOKEN_ID, list(self.eos_token_ids))
        prompts.meta_info.setdefault(K.META_PAD_TOKEN_ID, self.tokenizer.pad_token_id)
        with self._in_generation_phase():
            output = self.rollout.generate_sequences(prompts)
        self._check_tensor_parallel_agreement(output)
        if not self._rollout_rank.collect:
            # The group's collecting rank returns the rows; the others' copies would only travel.
            return DataProto(meta_info=dict(output.meta_info))
        return output.to("cpu")

    def _check_tensor_parallel_agreement(self, output: DataProto) -> None:
        """The ranks of one tensor-parallel engine must have sampled the same ids: compare a checksum
        over the group (CPU, gloo) and stop at once on a mismatch instead of training on one rank's
        rows while the others diverge."""
        if self._rollout_tp_group is None:
            return
        ids = output.batch[K.RESPONSES].detach().to("cpu", torch.int64)
        weights = torch.arange(1, ids.numel() + 1, dtype=torch.int64).reshape(ids.shape)
        mine = torch.tensor([int((ids * weights).sum()), ids.numel()], dtype=torch.int64)
        every = [torch.zeros_like(mine) for _ in range(self._rollout_tp)]
        dist.all_gather(every, mine, group=self._rollout_tp_group)
        if any(not torch.equal(other, mine) for other in every):
            raise RuntimeError(f"rank {self.rank}: the {self._rollout_tp} ranks of one vLLM tensor-parallel engine "
                               f"sampled different ids (checksums {[o.tolist() for o in every]}); their random "
                               "states or schedules diverged")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rollout_wake_up(self, seed: int | None = None) -> int | None:
        """Begin a rollout: the engine wakes with the actor's current weights and stays awake for
        every generate call until `rollout_sleep` (a multi-turn rollout wakes it once, not per turn).
        Calls nest: only the outermost pair wakes and sleeps. Returns (outermost call, vLLM engine)
        the bytes its latest weight sync sent (`rollout/weight_sync_bytes`: the adapter's with
        lora_sync=adapter, else the full weights'); None otherwise.

        `seed` (the driver's, from the run seed and step): a tensor-parallel engine's ranks reseed
        their sampling RNG from it and their data-parallel rank, so they draw the same tokens
        whatever random state each restored from a checkpoint (even one saved with another TP)."""
        self._require(self._is_rollout, "rollout_wake_up")
        if self._phase_depth == 0:
            if seed is not None and self._rollout_tp > 1:
                torch.manual_seed(self._sampling_seed(seed))
            self._phases_begun = 0
            stack = ExitStack()
            stack.enter_context(self._generation_phase())
            self._phase_stack = stack
            self._phase_depth += 1
            return getattr(getattr(self, "rollout", None), "last_sync_bytes", None)
        self._phase_depth += 1
        return None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rollout_sleep(self) -> dict[str, Any] | None:
        """End a rollout begun by `rollout_wake_up`. The outermost call puts the engine to sleep and
        returns the rollout's engine figures: `engine_wake_ups`, how many times it woke during the
        rollout (1 for a whole multi-turn rollout: `rollout/engine_wake_ups`; more means a generate
        call began a phase of its own), and for a vLLM engine that sleeps (GPU) the seconds its
        wake_up and sleep calls took (`rollout_wake_s`, `rollout_sleep_s`) and the bytes its sleep
        backed up to host (`sleep_host_bytes`; vLLMRollout.phase_stats). A nested call returns None."""
        self._require(self._is_rollout, "rollout_sleep")
        if self._phase_depth == 0:
            raise RuntimeError("rollout_sleep without a rollout_wake_up")
        self._phase_depth -= 1
        if self._phase_depth > 0:
            return None
        stack, self._phase_stack = self._phase_stack, None
        stack.close()
        woke, self._phases_begun = self._phases_begun, 0
        stats = getattr(getattr(self, "rollout", None), "phase_stats", None)
        return {"engine_wake_ups": woke, **(stats() if stats is not None else {})}

    @contextmanager
    def _in_generation_phase(self) -> Iterator[None]:
        """The open generation phase, or one for this call alone."""
        if self._phase_depth > 0:
            yield
            return
        with self._generation_phase():
            yield

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, mesh=ROLLOUT_MESH)
    def generate_trajectories(self, prompts: DataProto) -> DataProto:
        """Async rollout of this rank's rows, one coroutine per trajectory (search_r1.llm_agent.async_generation).

        Reads input_ids / attention_mask (the prompts, left-padded) and meta_info: the sampling
        keys of generate_sequences plus 'agent_config' (the driver's GenerationConfig as a dict).
        Writes non-tensors 'agent_rows' (each row's turns, masks and stop reason) and
        'agent_stats' (its counters), and the tensor 'num_turns'."""
        self._require(self._is_rollout, "generate_trajectories")
        if self._rollout_tp > 1:
            raise NotImplementedError(
                "actor_rollout_ref.rollout.mode=async with tensor_model_parallel_size>1: each rank steps its "
                "engine on its own, so the ranks of one engine would diverge; use mode=sync or TP=1")
        from search_r1.llm_agent import generation
        from search_r1.llm_agent.async_generation import run_shard
        from search_r1.llm_agent.tensor_helper import real_tokens

        meta = dict(prompts.meta_info)
        meta.setdefault(K.META_EOS_TOKEN_ID, list(self.eos_token_ids))
        meta.setdefault(K.META_PAD_TOKEN_ID, self.tokenizer.pad_token_id)
        gen_config = generation.GenerationConfig(**meta.pop(generation.META_AGENT_CONFIG))
        ids = real_tokens(prompts.batch[K.INPUT_IDS].long(), prompts.batch[K.ATTENTION_MASK].long())
        # One draw of the rank's seeded RNG per call; each request's seed derives from it.
        call_seed = int(torch.randint(0, 2**31 - 1, (1,)))
        with self._in_generation_phase():
            rows, stats, _ = run_shard(self.tokenizer, gen_config, self.rollout.step_engine(meta), ids, call_seed,
                                       generation.eos_token_ids(meta))
        return DataProto.from_dict(
            tensors={"num_turns": torch.tensor([row.n_turns for row in rows], dtype=torch.long)},
            non_tensors={generation.AGENT_ROWS: rows, generation.AGENT_STATS: [dict(c) for c in stats]},
            meta_info={K.META_ROLLOUT_LOG_PROBS_MATCH_ACTOR: bool(getattr(self.rollout, "log_probs_match_actor", True))})

    @contextmanager
    def _generation_phase(self) -> Iterator[None]:
        """The rollout engine ready with the actor's current weights, in eval mode; put back after."""
        fsdp_cfg = self.config.actor.fsdp_config
        self._phases_begun += 1
        if self._rollout_pool is not None:   # role rollout: the engine already holds the pushed weights
            with self._rollout_pool.generation_phase(self._weights_version):
                yield
            return
        if isinstance(self.rollout, HFRollout):
            self._onload(self.actor_module, None, fsdp_cfg)
            was_training = self.actor_module.training
            self.actor_module.eval()
            try:
                with self.rollout_sharding_manager:
                    yield
            finally:
                self.actor_module.train(was_training)
                self._offload(self.actor_module, None, fsdp_cfg)
        else:
            self.rollout.wake_up(self._load_rollout_weights)
            try:
                yield
            finally:
                self.rollout.sleep()

    def _load_rollout_weights(self) -> None:
        """Load the actor's weights into the engine unless it already has this version. Every rank
        streams the same parameters in the same order (gathering a shard is a collective)."""
        fsdp_cfg = self.config.actor.fsdp_config
        if self.rollout.synced_version != self._weights_version:
            self._onload(self.actor_module, None, fsdp_cfg)
            if getattr(self.rollout, "lora_sync", None) == "adapter":
                # LoRA, lora_sync=adapter: only the adapter travels (the engine keeps the frozen base it loaded)
                self.rollout.sync_adapter(adapter_state(self.actor_module), version=self._weights_version)
            else:
                # LoRA, lora_sync=merged: vLLM loads the merged weights (W + scaling * B @ A)
                state = merged_state(self.actor_module) if self.lora is not None else self.actor_module.state_dict().items()
                self.rollout.sync_weights(state, version=self._weights_version)
            self._offload(self.actor_module, None, fsdp_cfg)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """Reads input_ids, attention_mask, position_ids, responses. Writes old_log_probs."""
        self._require(self._is_actor, "compute_log_prob")
        rollout = self.config.rollout
        data = self._sp.gather(data).to(self.device)
        data.meta_info.update({
            K.META_MICRO_BATCH_SIZE: rollout.log_prob_micro_batch_size,
            K.META_MAX_TOKEN_LEN: rollout.log_prob_max_token_len_per_gpu,
            K.META_USE_DYNAMIC_BSZ: rollout.log_prob_use_dynamic_bsz,
            K.META_TEMPERATURE: rollout.temperature,
        })
        self._onload(self.actor_module, None, self.config.actor.fsdp_config)
        out = self.actor.compute_log_prob_outputs(
            data, calculate_sum_pi_squared=bool(self.config.actor.get("calculate_sum_pi_squared", False)))
        self._offload(self.actor_module, None, self.config.actor.fsdp_config)
        tensors = {K.OLD_LOG_PROBS: out.log_probs.cpu()}
        if out.sum_pi_squared is not None:
            tensors[K.SUM_PI_SQUARED] = out.sum_pi_squared.cpu()
        return self._sp.split(DataProto.from_dict(tensors=tensors))

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """Reads input_ids, attention_mask, position_ids, responses. Writes ref_log_prob."""
        self._require(self._is_ref, "compute_ref_log_prob")
        ref = self.config.ref
        data = self._sp.gather(data).to(self.device)
        data.meta_info.update({
            K.META_MICRO_BATCH_SIZE: ref.log_prob_micro_batch_size,
            K.META_MAX_TOKEN_LEN: ref.log_prob_max_token_len_per_gpu,
            K.META_USE_DYNAMIC_BSZ: ref.log_prob_use_dynamic_bsz,
            K.META_TEMPERATURE: self.config.rollout.temperature,
        })
        if self.lora is not None:   # no reference weights: the actor's base model, adapter bypassed
            self._onload(self.actor_module, None, self.config.actor.fsdp_config)
            with adapter_disabled(self.actor_module):
                log_probs, _ = self.actor.compute_log_prob(data)
            self._offload(self.actor_module, None, self.config.actor.fsdp_config)
        else:
            self._onload(self.ref_module, None, ref.fsdp_config)
            log_probs, _ = self.ref_policy.compute_log_prob(data)
            self._offload(self.ref_module, None, ref.fsdp_config)
        return self._sp.split(DataProto.from_dict(tensors={K.REF_LOG_PROB: log_probs.cpu()}))

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_actor(self, data: DataProto) -> DataProto:
        """Reads responses, input_ids, attention_mask, position_ids, old_log_probs, advantages,
        response_mask (+ ref_log_prob with use_kl_loss). Writes meta_info["metrics"]."""
        self._require(self._is_actor, "update_actor")
        fsdp_cfg = self.config.actor.fsdp_config
        data = self._sp.gather(data).to(self.device)
        data.meta_info[K.META_TEMPERATURE] = self.config.rollout.temperature
        self._onload(self.actor_module, self.actor_optimizer, fsdp_cfg)
        metrics: dict[str, Any] = self.actor.update_policy(data)
        self._weights_version += 1   # the rollout engine reloads before it next generates
        metrics["actor/lr"] = float(self.actor_lr_scheduler.get_last_lr()[0])
        self.actor_lr_scheduler.step()
        self._offload(self.actor_module, self.actor_optimizer, fsdp_cfg)
        return DataProto(meta_info={K.META_METRICS: metrics})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path: str, global_step: int = 0, hf_path: str | None = None,
                        merged_hf_path: str | None = None) -> None:
        """Each rank writes its shard of model + optimizer, and its scheduler / RNG state, into local_path.
        LoRA: `hf_path` gets the adapter, `merged_hf_path` (if given) the merged model."""
        self._require(self._is_actor, "save_checkpoint")
        fsdp_cfg = self.config.actor.fsdp_config
        self._onload(self.actor_module, self.actor_optimizer, fsdp_cfg)
        self.checkpoint_manager.save_checkpoint(local_path, global_step=global_step, hf_path=hf_path,
                                                merged_hf_path=merged_hf_path)
        self._offload(self.actor_module, self.actor_optimizer, fsdp_cfg)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str) -> int:
        """Restore model, optimizer, LR schedule and RNG from local_path; returns the saved step."""
        self._require(self._is_actor, "load_checkpoint")
        fsdp_cfg = self.config.actor.fsdp_config
        self._onload(self.actor_module, self.actor_optimizer, fsdp_cfg)
        step = self.checkpoint_manager.load_checkpoint(local_path)
        self._weights_version += 1
        self._offload(self.actor_module, self.actor_optimizer, fsdp_cfg)
        return step

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def write_checkpoint_probe(self, root: str, probe_id: str) -> RankMarker:
        """Write this rank's marker (rank, host, pid) under `root`: before the first save the driver
        checks that it sees every rank's (verl/utils/checkpoint/shared_dir.py). Needs no model."""
        return write_rank_marker(root, probe_id, self.rank)

    # ---------------------------------------------------------- weight sync (trainer.pipeline)
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weight_sync_endpoint(self) -> tuple[str, int]:
        """(host, free port) for the weight-sync group's store; the driver takes the train rank 0's."""
        from verl.workers.weight_sync import endpoint

        return endpoint()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rollout_weight_dtype(self) -> torch.dtype:
        """Rollout pool: the dtype its engine holds weights in, which a push carries."""
        self._require(self._rollout_pool is not None, "rollout_weight_dtype")
        return self._rollout_pool.dtype

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rollout_push_mode(self) -> str:
        """Rollout pool: what a push must carry to its engine (verl/workers/lora_push.py): `full`,
        or with LoRA `adapter` (vLLM serving the adapter) or `merged`."""
        self._require(self._rollout_pool is not None, "rollout_push_mode")
        return self._rollout_pool.push_mode

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weight_push_manifest(self, dtype: torch.dtype, mode: str = "full") -> Any:
        """Train pool: the PushManifest of what a push of `mode` sends (the actor's weights; with LoRA
        its adapter or its merged weights): names, full shapes, in push order, travelling in `dtype`
        (no collective)."""
        from verl.workers.lora_push import lora_push_manifest

        self._require(self._is_actor, "weight_push_manifest")
        return lora_push_manifest(self.actor_module, dtype, mode)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)   # the two pools' calls run together
    def join_weight_sync(self, host: str, port: int, size: int, manifest: Any) -> None:
        """Join the weight-sync group: the train pool's rank 0 as its rank 0 (the sender), rollout
        rank r as rank 1 + r; the train pool's other ranks only take part in the gathers. Every push
        sends `manifest` (a PushManifest); a rollout rank checks its engine takes it as it comes.
        Blocks until all `size` members joined (the driver calls both pools at once)."""
        from verl.workers.weight_sync import WeightSyncGroup

        if self._is_rollout and self._is_actor:
            raise RuntimeError(f"role {self.role!r} generates from its own weights: no weight sync")
        if self._rollout_pool is not None:
            self._rollout_pool.join(manifest)
        self._push_manifest = manifest
        if self._is_rollout:
            self._weight_sync = WeightSyncGroup(host, port, 1 + self.rank, size, self.device)
        elif self._is_actor and self.rank == 0:
            self._weight_sync = WeightSyncGroup(host, port, 0, size, self.device)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)   # the two pools' calls run together
    def send_weights(self) -> int:
        """Train pool: the actor's full weights (with LoRA: the adapter, or the merged weights, as the
        manifest's mode says), cast to the rollout engine's dtype, to every rollout rank; returns the
        bytes rank 0 sent (0 on the other ranks, which only gather)."""
        from verl.workers.lora_push import lora_push_state
        from verl.workers.weight_sync import send_state

        self._require(self._is_actor and self._push_manifest is not None, "send_weights")
        fsdp_cfg = self.config.actor.fsdp_config
        self._onload(self.actor_module, None, fsdp_cfg)
        manifest = self._push_manifest
        sent = send_state(self._weight_sync, lora_push_state(self.actor_module, manifest.mode), manifest, self.device)
        self._offload(self.actor_module, None, fsdp_cfg)
        return sent

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)   # the two pools' calls run together
    def receive_weights(self) -> int:
        """Rollout pool: the train pool's weights straight into the engine (vLLM's weight load, or
        the HF engine's parameters in place); returns the bytes received. Inside a rollout (a
        partial rollout's push between two turns) the engine stays awake and the next turn
        generates with the new weights."""
        self._require(self._rollout_pool is not None and self._weight_sync is not None, "receive_weights")
        version = self._weights_version + 1
        received = self._rollout_pool.receive(self._weight_sync, self._push_manifest, version)
        self._weights_version = version
        return received

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rollout_pool_state(self) -> Any:
        """Rollout pool: a RolloutPoolState (versions, dtype, engine loads, FSDP modules / DTensors alive,
        the last push's order). For tests and debugging."""
        self._require(self._rollout_pool is not None, "rollout_pool_state")
        return self._rollout_pool.state(self._weights_version)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get_model_flops_info(self) -> Any:
        """Hidden size, layer count, head count, vocab and parameter count of the policy."""
        module = self.actor_module if self.actor_module is not None else self.ref_module
        return get_model_flops_info(module)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def device_peak_flops(self) -> float:
        """Peak FLOP/s of the device this worker trains on (by GPU name, or measured on CPU):
        the MFU denominator comes from where the work runs, not from the driver's machine."""
        from verl.utils.flops_counter import get_device_peak_flops

        device = torch.device("cuda", torch.cuda.current_device()) if self.device == "cuda" else torch.device("cpu")
        return float(get_device_peak_flops(device))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def lora_report(self) -> dict[str, Any]:
        """What LoRA left in this rank's actor (tests, debugging; no collective): the names that require
        grad, the optimizer's parameter count, the frozen ones' dtypes and whether any holds a grad,
        and whether a reference model was built."""
        from verl.utils.lora import is_adapter_param

        self._require(self._is_actor, "lora_report")
        named = list(self.actor_module.named_parameters())
        optimized = {id(p) for group in self.actor_optimizer.param_groups for p in group["params"]}
        return {
            "trainable": sorted(n for n, p in named if p.requires_grad),
            "optimizer_params": sorted(n for n, p in named if id(p) in optimized),
            "optimizer_state_params": sorted(n for n, p in named if p in self.actor_optimizer.state),
            "adapters": sorted(n for n, _ in named if is_adapter_param(n)),
            "frozen_dtypes": sorted({str(p.dtype) for n, p in named if not is_adapter_param(n)}),
            "frozen_with_grad": sorted(n for n, p in named if not is_adapter_param(n) and p.grad is not None),
            "ref_module": self.ref_module is not None,
            # the vLLM engine's side of it (lora_sync, adapters served, weight loads, bytes); None for HF
            "rollout": self.rollout.lora_state() if hasattr(getattr(self, "rollout", None), "lora_state") else None,
        }

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get_state_fingerprint(self) -> dict[str, float]:
        """Sum of each full (gathered) parameter, as this rank sees it: equal on every rank unless
        the ranks diverged. For tests and debugging; a collective, so every rank must call it.
        A rollout pool's HF engine: its module's parameters (the vLLM engine's are not readable here)."""
        if self._rollout_pool is not None:
            if self._rollout_pool.module is None:
                raise NotImplementedError("get_state_fingerprint: the rollout pool's vLLM engine holds its weights "
                                          "inside vLLM; read the HF engine's, or the train pool's")
            return {name: float(p.double().sum()) for name, p in self._rollout_pool.module.named_parameters()}
        module = self.actor_module if self.actor_module is not None else self.ref_module
        self._onload(module, None, self.config.actor.fsdp_config)
        fingerprint = {name: float(fsdp_utils.full_tensor(p).double().sum()) for name, p in module.named_parameters()}
        self._offload(module, None, self.config.actor.fsdp_config)
        return fingerprint


class CriticWorker(_FSDPWorkerBase):
    """The value model: token-classification head with one label, trained by clipped value loss."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self._sp_size = check_supported(config, "critic", self.world_size, config.model)
        self._sp = SPGroups(1, 0)   # built in init_model (new_group needs the process group)
        check_fsdp_size(config.model.fsdp_config, self.world_size, "critic.model.fsdp_config")
        normalize_critic_batch_sizes(self.config, self.world_size // self._sp_size)   # data-parallel: world / SP
        scale_token_budgets(self.config, ("ppo_max_token_len_per_gpu", "forward_max_token_len_per_gpu"), self._sp_size)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Join the process group, load the critic (value head), shard it, build its optimizer."""
        self._init_distributed()
        self._sp = SPGroups.build(self.rank, self.world_size, self._sp_size)
        from transformers import AutoTokenizer

        model_cfg = self.config.model
        self.tokenizer = AutoTokenizer.from_pretrained(model_cfg.get("tokenizer_path") or model_cfg.path)
        use_rmpad = bool(model_cfg.get("use_remove_padding", False))
        attn = self._attn_implementation(model_cfg)
        torch.manual_seed(0)   # the RNG state the critic's shuffles start from: the same on every rank
        self.critic_module = self._load_sharded(
            lambda: build_value_model(model_cfg.path, model_cfg.get("override_config"), attn, use_rmpad),
            model_cfg, trainable=True)
        self.critic_optimizer, self.critic_lr_scheduler = fsdp_utils.build_optimizer(
            self.critic_module, self.config.optim)
        self.critic = DataParallelPPOCritic(self.config, self.critic_module, self.critic_optimizer,
                                            use_remove_padding=use_rmpad, sp_group=self._sp.sp_group)
        self.checkpoint_manager = FSDPCheckpointManager(
            self.critic_module, self.critic_optimizer, self.critic_lr_scheduler, self.tokenizer)
        self._offload(self.critic_module, self.critic_optimizer, model_cfg.fsdp_config)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:
        """Reads input_ids, attention_mask, position_ids, responses. Writes values."""
        data = self._sp.gather(data).to(self.device)
        data.meta_info.update({
            K.META_MICRO_BATCH_SIZE: self.config.forward_micro_batch_size,
            K.META_MAX_TOKEN_LEN: self.config.forward_max_token_len_per_gpu,
            K.META_USE_DYNAMIC_BSZ: self.config.use_dynamic_bsz,
        })
        fsdp_cfg = self.config.model.fsdp_config
        self._onload(self.critic_module, None, fsdp_cfg)
        values = self.critic.compute_values(data)
        self._offload(self.critic_module, None, fsdp_cfg)
        return self._sp.split(DataProto.from_dict(tensors={K.VALUES: values.cpu()}))

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_critic(self, data: DataProto) -> DataProto:
        """Reads responses, input_ids, attention_mask, position_ids, values, returns, response_mask.
        Writes meta_info["metrics"]."""
        fsdp_cfg = self.config.model.fsdp_config
        data = self._sp.gather(data).to(self.device)
        self._onload(self.critic_module, self.critic_optimizer, fsdp_cfg)
        metrics: dict[str, Any] = self.critic.update_critic(data)
        metrics["critic/lr"] = float(self.critic_lr_scheduler.get_last_lr()[0])
        self.critic_lr_scheduler.step()
        self._offload(self.critic_module, self.critic_optimizer, fsdp_cfg)
        return DataProto(meta_info={K.META_METRICS: metrics})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path: str, global_step: int = 0, hf_path: str | None = None) -> None:
        """Each rank writes its shard of model + optimizer, and its scheduler / RNG state, into local_path."""
        fsdp_cfg = self.config.model.fsdp_config
        self._onload(self.critic_module, self.critic_optimizer, fsdp_cfg)
        self.checkpoint_manager.save_checkpoint(local_path, global_step=global_step, hf_path=hf_path)
        self._offload(self.critic_module, self.critic_optimizer, fsdp_cfg)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str) -> int:
        """Restore model, optimizer, LR schedule and RNG from local_path; returns the saved step."""
        fsdp_cfg = self.config.model.fsdp_config
        self._onload(self.critic_module, self.critic_optimizer, fsdp_cfg)
        step = self.checkpoint_manager.load_checkpoint(local_path)
        self._offload(self.critic_module, self.critic_optimizer, fsdp_cfg)
        return step

