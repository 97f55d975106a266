"""FSDP2 workers: the actor / rollout / reference worker (here) and the critic worker
(verl/workers/critic_worker.py, re-exported here: configs, Ray and scripts name both by this path).

The driver builds a worker group of these and calls their registered methods;
each method's docstring names the DataProto keys it reads and writes
(verl/utils/batch_keys.py). Batch sizes in the config are global (per training
step); each worker turns them into per-rank sizes in __init__, veRL style
(verl/workers/worker_config.py).

    wg = RayWorkerGroup(pool, RayClassWithInitArgs(ActorRolloutRefWorker, config=cfg.actor_rollout_ref,
                                                   role="actor_rollout_ref"))
    wg.init_model()
    out = wg.generate_sequences(prompts); out = out.union(wg.compute_log_prob(out))
    metrics = wg.update_actor(batch).meta_info["metrics"]

ActorRolloutRefWorker is assembled from one module per concern: the shared FSDP2 plumbing
(fsdp_base.py), the rollout role (rollout_role.py: engine, generation phases, colocated weight
sync), a pipeline's weight push (weight_push_role.py) and LoRA (lora_role.py); what stays here is
the actor and the reference: building them, log-probs, the update, checkpoints.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from verl.protocol import DataProto
from verl.single_controller.base.decorator import Dispatch, register
from verl.trainer.ppo.registry import CUSTOM_ALGORITHMS_WORKER_KEY, load_custom_algorithms
from verl.utils import batch_keys as K
from verl.utils import fsdp_utils
from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
from verl.utils.checkpoint.shared_dir import RankMarker, write_rank_marker
from verl.utils.model import build_causal_lm, frozen_weight_dtype, get_model_flops_info
from verl.utils.tokenizer import eos_token_ids
from verl.workers.actor.dp_actor import DataParallelPPOActor
from verl.workers.critic_worker import CriticWorker
from verl.workers.fsdp_base import FSDPWorkerBase
from verl.workers.lora_role import LoraRole
from verl.workers.rollout_role import ROLLOUT_MESH, RolloutRole, rollout_mesh_rank
from verl.workers.sp_groups import SPGroups, scale_token_budgets, sp_size
from verl.workers.weight_push_role import WeightPushRole
from verl.workers.worker_config import (
    check_fsdp_size,
    check_supported,
    normalize_actor_batch_sizes,
    normalize_critic_batch_sizes,
)

# The names this module has always exported (configs, scripts and tests import them from here).
_FSDPWorkerBase = FSDPWorkerBase
__all__ = [
    "ROLES", "ROLLOUT_MESH", "ActorRolloutRefWorker", "CriticWorker", "FSDPWorkerBase", "_FSDPWorkerBase",
    "check_fsdp_size", "check_supported", "normalize_actor_batch_sizes", "normalize_critic_batch_sizes",
    "rollout_mesh_rank",
]

# actor_ref: the train pool of a pipelined run (trainer.pipeline), whose rollout is another pool's
ROLES = ("actor", "rollout", "ref", "actor_ref", "actor_rollout", "actor_rollout_ref")


class ActorRolloutRefWorker(RolloutRole, WeightPushRole, LoraRole, FSDPWorkerBase):
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
        self._init_rollout_role(config)

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
        self._init_lora(model_cfg)
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
        self._build_rollout_engine(attn)
        if self._is_ref and self.lora is not None:
            self.ref_policy = self.actor   # compute_ref_log_prob: the actor with its adapter disabled
        elif self._is_ref:
            self.ref_module = self._build_reference(model_cfg, attn, use_rmpad)
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

    def _build_reference(self, model_cfg: Any, attn: str | None, use_rmpad: bool) -> nn.Module:
        """The frozen reference, sharded, its parameters in `frozen_weight_dtype(device)`: bf16 on GPUs
        (half an fp32 copy's memory, on the GPU and under ref.param_offload on the host; the same
        log-probs, FSDP2 computing in bf16 either way), fp32 on CPU."""
        dtype = frozen_weight_dtype(self.device)
        return self._load_sharded(
            lambda: build_causal_lm(model_cfg.path, model_cfg.get("override_config"), attn, use_rmpad, dtype=dtype),
            model_cfg, trainable=False)

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
            log_probs = self._base_ref_log_prob(data)
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
