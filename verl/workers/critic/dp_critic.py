"""Data-parallel PPO critic: token values and clipped value-loss updates.

The critic is a token-classification head (one label) on the policy's backbone;
the value of response token j is read at the position that predicts it, i.e.
values[:, P-1:T-1], the same alignment as the actor's log-probs. The value loss
is masked with `response_mask` (policy tokens only).

    critic = DataParallelPPOCritic(cfg.critic, fsdp_module, optimizer)
    values_BR = critic.compute_values(batch)
    metrics = critic.update_critic(batch)
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn

from verl.trainer.ppo import core_algos
from verl.utils import batch_keys as K
from verl.utils import torch_functional as tf
from verl.utils import ulysses
from verl.utils.packed_attention import boundary_kwargs
from verl.utils.remove_padding import check_packing_isolates_sequences, pack_batch, unpack_to_padded
from verl.utils.seqlen_balancing import get_reverse_idx, split_micro_batches
from verl.workers.actor.dp_actor import clip_and_check_grad, shuffle_seed

_FORWARD_KEYS = [K.RESPONSES, K.INPUT_IDS, K.ATTENTION_MASK, K.POSITION_IDS]


class DataParallelPPOCritic:
    """PPO critic over a one-label token-classification model (FSDP-wrapped or plain)."""

    def __init__(self, config: Any, critic_module: nn.Module, critic_optimizer: torch.optim.Optimizer | None,
                 use_remove_padding: bool | None = None, sp_group: Any = None) -> None:
        self.config = config
        self.sp_group = sp_group   # Ulysses over these ranks (same micro-batches), as DataParallelPPOActor
        self._sp_state: ulysses._SPState | None = None   # the last packed forward's, for its backward
        self.critic_module = critic_module
        self.critic_optimizer = critic_optimizer
        if use_remove_padding is None:
            use_remove_padding = config.get("model", {}).get("use_remove_padding", False)
        self._packing_checked = False
        self._update_calls = 0   # update_critic calls so far: part of the shuffle seed
        self.use_remove_padding = bool(use_remove_padding)

    def _forward_micro_batch(self, micro: Any) -> torch.Tensor:
        """(B, R) values of the response tokens, zero on response padding."""
        input_ids, attention_mask, position_ids = micro[K.INPUT_IDS], micro[K.ATTENTION_MASK], micro[K.POSITION_IDS]
        response_length = micro[K.RESPONSES].shape[-1]
        if self.use_remove_padding:
            if not self._packing_checked:
                check_packing_isolates_sequences(self.critic_module, self.critic_module.config.vocab_size)
                self._packing_checked = True
            packed = pack_batch(input_ids, attention_mask, position_ids)
            if self.sp_group is not None:
                out_N = self._packed_values_sequence_parallel(packed)
            else:
                out_N = self.critic_module(input_ids=packed.input_ids, position_ids=packed.position_ids,
                                           attention_mask=None, use_cache=False,
                                           **boundary_kwargs(packed.position_ids)).logits.squeeze(0)
            values_BT = unpack_to_padded(out_N.squeeze(-1).float(), packed)
        else:
            values_BT = self.critic_module(input_ids=input_ids, attention_mask=attention_mask,
                                           position_ids=position_ids, use_cache=False).logits.squeeze(-1).float()
        values = values_BT[:, -response_length - 1:-1]
        return values * attention_mask[:, -response_length:].to(values.dtype)

    def _packed_values_sequence_parallel(self, packed: Any) -> torch.Tensor:
        """(N, 1) values of the packed row: this rank's slice through the model, gathered over the group."""
        n = packed.input_ids.shape[-1]
        with ulysses.sequence_parallel(self.sp_group, packed.position_ids) as self._sp_state:
            ids_1n, pos_1n, _ = ulysses.slice_packed(packed.input_ids, packed.position_ids, self.sp_group)
            out_n = self.critic_module(input_ids=ids_1n, position_ids=pos_1n, attention_mask=None,
                                       use_cache=False).logits.squeeze(0)
        return ulysses.gather_tokens(out_n, self.sp_group)[:n]

    def _loss_mask(self, micro: Any) -> torch.Tensor:
        """response_mask (policy tokens); with critic.state_masking=False, every real response token."""
        if self.config.get("state_masking", True):
            return micro[K.RESPONSE_MASK].float()
        response_length = micro[K.RESPONSES].shape[-1]
        return micro[K.ATTENTION_MASK][:, -response_length:].float()

    def compute_values(self, data: Any) -> torch.Tensor:
        """Values (B, R); reads input_ids, attention_mask, position_ids, responses.

        meta_info: micro_batch_size, use_dynamic_bsz, max_token_len (when dynamic).
        """
        batch = data.select(batch_keys=_FORWARD_KEYS).batch
        micro_batches, indices = split_micro_batches(
            batch, data.meta_info.get(K.META_MICRO_BATCH_SIZE), bool(data.meta_info.get(K.META_USE_DYNAMIC_BSZ, False)),
            data.meta_info.get(K.META_MAX_TOKEN_LEN))
        self.critic_module.eval()
        with torch.no_grad():
            values = torch.cat([self._forward_micro_batch(micro) for micro in micro_batches], dim=0)
        if indices is not None:
            reverse = torch.tensor(get_reverse_idx([i for part in indices for i in part]), dtype=torch.long)
            values = values[reverse]
        return values

    def update_critic(self, data: Any) -> dict[str, list[float]]:
        """Clipped value regression; one optimizer step per mini-batch.

        Reads responses, input_ids, attention_mask, position_ids, values, returns, response_mask.
        """
        if self.critic_optimizer is None:
            raise RuntimeError("update_critic needs an optimizer")
        cfg = self.config
        self.critic_module.train()
        batch = data.select(batch_keys=_FORWARD_KEYS + [K.VALUES, K.RETURNS, K.RESPONSE_MASK]).batch
        loss_agg_mode = cfg.get("loss_agg_mode", "token-mean")
        metrics: dict[str, list[float]] = defaultdict(list)
        grad_nonfinite = 0
        for epoch in range(int(cfg.get("ppo_epochs", 1))):
            if cfg.get("shuffle", False):
                generator = torch.Generator().manual_seed(shuffle_seed(cfg, self._update_calls, epoch))
                batch = batch[torch.randperm(batch.batch_size[0], generator=generator)]
            for mini in batch.split(int(cfg.ppo_mini_batch_size)):
                micro_batches, _ = split_micro_batches(
                    mini, cfg.get("ppo_micro_batch_size"), bool(cfg.get("use_dynamic_bsz", False)),
                    cfg.get("ppo_max_token_len_per_gpu"))
                self.critic_optimizer.zero_grad(set_to_none=True)
                mini_mask = self._loss_mask(mini)
                # Totals over the data-parallel ranks: the update is the global mini-batch's loss.
                mini_tokens, mini_rows, dp_size = tf.data_parallel_totals(
                    float(mini_mask.sum()), tf.rows_with_tokens(mini_mask), mini_mask.device)
                for micro in micro_batches:
                    response_mask = self._loss_mask(micro)
                    self._sp_state = None
                    vpreds = self._forward_micro_batch(micro)
                    vf_loss, vf_clipfrac = core_algos.compute_value_loss(
                        vpreds, micro[K.RETURNS], micro[K.VALUES], response_mask,
                        float(cfg.cliprange_value), loss_agg_mode, cfg.get("loss_scale_factor"))
                    # Token share (token-mean) or row share (seq-mean modes) of the mini-batch.
                    share = tf.micro_batch_share(response_mask, mini_tokens, tf.rows_with_tokens(response_mask),
                                                 mini_rows, loss_agg_mode, dp_size)
                    with ulysses.resumed(self._sp_state):   # gradient checkpointing's recompute runs SP too
                        (vf_loss * share).backward()
                    metrics["critic/vf_loss"].append(vf_loss.item())
                    metrics["critic/vf_clipfrac"].append(vf_clipfrac.item())
                    metrics["critic/vpred_mean"].append(tf.masked_mean(vpreds, response_mask).item())
                grad_norm, finite = clip_and_check_grad(self.critic_module, cfg.get("grad_clip"))
                if finite:
                    self.critic_optimizer.step()
                self.critic_optimizer.zero_grad(set_to_none=True)
                grad_nonfinite += int(not finite)
                metrics["critic/grad_norm"].append(grad_norm)
        metrics["critic/grad_nonfinite"].append(float(grad_nonfinite))
        self._update_calls += 1
        return dict(metrics)
