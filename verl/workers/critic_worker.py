"""The critic worker: the value model (a token-classification head with one label) under FSDP2,
trained by the clipped value loss (verl/workers/critic/dp_critic.py).

    wg = RayWorkerGroup(pool, RayClassWithInitArgs(CriticWorker, config=cfg.critic))
    wg.init_model(); values = wg.compute_values(batch); metrics = wg.update_critic(batch)
"""

from __future__ import annotations

from typing import Any

import torch

from verl.protocol import DataProto
from verl.single_controller.base.decorator import Dispatch, register
from verl.utils import batch_keys as K
from verl.utils import fsdp_utils
from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
from verl.utils.model import build_value_model
from verl.workers.critic.dp_critic import DataParallelPPOCritic
from verl.workers.fsdp_base import FSDPWorkerBase
from verl.workers.sp_groups import SPGroups, scale_token_budgets
from verl.workers.worker_config import check_fsdp_size, check_supported, normalize_critic_batch_sizes


class CriticWorker(FSDPWorkerBase):
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
