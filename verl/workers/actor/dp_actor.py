"""Data-parallel PPO actor: log-probs and PPO updates on one (FSDP-sharded) policy.

Every loss term (clipped policy loss, entropy bonus, KL-to-reference loss) is
masked with `response_mask`, the policy-token mask the driver builds, so
retrieved passages and padding never carry gradient.

A mixture-of-experts policy whose config sets `output_router_logits` (off by default; veRL's
`actor_rollout_ref.model.override_config.output_router_logits=true`) adds its router's
load-balancing loss, as transformers computes it (`aux_loss`, over every real token the forward
saw), times the config's `router_aux_loss_coef`, and logs it as `actor/router_aux_loss`. The switch
is read once and the module's config set back to off: transformers would compute the loss in every
forward, where it is wasted (log-probs) or fails (the HF engine's cached decoding); the update's
forwards ask for it.

    actor = DataParallelPPOActor(cfg.actor_rollout_ref.actor, fsdp_module, optimizer)
    log_probs_BR, _ = actor.compute_log_prob(batch)           # meta_info: micro_batch_size, temperature...
    metrics = actor.update_policy(batch)                       # {"actor/pg_loss": [...], ...}
"""

from __future__ import annotations

import math
from collections import defaultdict
from functools import partial
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from verl.trainer.ppo import core_algos
from verl.trainer.ppo.registry import get_policy_loss_fn
from verl.utils import batch_keys as K
from verl.utils import torch_functional as tf
from verl.utils import ulysses
from verl.utils.logprob_head import lm_head_computes_log_probs
from verl.utils.packed_attention import boundary_kwargs
from verl.utils.remove_padding import (
    check_packing_isolates_sequences,
    pack_batch,
)
from verl.utils.seqlen_balancing import get_reverse_idx, split_micro_batches
from verl.workers.actor.base import BasePPOActor

_FORWARD_KEYS = [K.RESPONSES, K.INPUT_IDS, K.ATTENTION_MASK, K.POSITION_IDS]


def _meta(data: Any, key: str) -> Any:
    if key not in data.meta_info:
        raise KeyError(f"meta_info[{key!r}] is required here; the worker sets it from the rollout / ref config")
    return data.meta_info[key]


def clip_and_check_grad(module: nn.Module, grad_clip: float | None) -> tuple[float, bool]:
    """Clip grads to `grad_clip` (when set); returns (total norm, whether it is finite)."""
    params = [p for p in module.parameters() if p.grad is not None]
    max_norm = float(grad_clip) if grad_clip else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm)
    # FSDP2 returns a replicated DTensor; every rank holds the same value.
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    value = float(norm)
    return value, math.isfinite(value)


def shuffle_seed(config: Any, update_calls: int, epoch: int) -> int:
    """Seed of the mini-batch shuffle: new for every update call and epoch, the same across runs."""
    return int(config.get("shuffle_seed", 0)) * 1_000_003 + update_calls * 1_009 + epoch


def _share(micro_mask: torch.Tensor, mini_tokens: float, mini_rows: float, dp_size: int, mode: str) -> float:
    return tf.micro_batch_share(micro_mask, mini_tokens, tf.rows_with_tokens(micro_mask), mini_rows, mode, dp_size)


def loss_mode(config: Any) -> str:
    """actor.policy_loss.loss_mode; vanilla (dual-clip PPO) when the node or the key is absent."""
    node = config.get("policy_loss", None)
    return str((node.get("loss_mode", None) if node is not None else None) or "vanilla")


class HeadOutputs(NamedTuple):
    """Per response token (B, R): log-probs, and the statistics asked for (None otherwise)."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None = None
    sum_pi_squared: torch.Tensor | None = None   # sum_v pi_v^2: the optimal token baseline's statistic


class DataParallelPPOActor(BasePPOActor):
    """PPO actor over an HF causal LM wrapped by FSDP (or a plain module in one process)."""

    def __init__(self, config: Any, actor_module: nn.Module, actor_optimizer: torch.optim.Optimizer | None = None,
                 use_remove_padding: bool | None = None, sp_group: Any = None) -> None:
        super().__init__(config)
        # Ulysses: the ranks of `sp_group` hold the same micro-batches and split each packed row
        # (verl/utils/ulysses.py); None = no sequence parallelism.
        self.sp_group = sp_group
        # The SP state of the last packed forward, re-entered around its loss's backward (gradient
        # checkpointing recomputes the layers there; ulysses.resumed).
        self._sp_state: ulysses._SPState | None = None
        self.actor_module = actor_module
        self.actor_optimizer = actor_optimizer
        self._packing_checked = False
        self._update_calls = 0   # update_policy calls so far: part of the shuffle seed
        # An MoE's load-balancing losses of the forwards of the loss being built (None: not collecting).
        self._router_aux_losses: list[torch.Tensor] | None = None
        model_config = getattr(actor_module, "config", None)
        self._router_aux = bool(getattr(model_config, "output_router_logits", False))
        if self._router_aux:   # asked for by the update's forwards only (module docstring)
            model_config.output_router_logits = False
        self.use_remove_padding = bool(config.get("use_remove_padding", False)
                                       if use_remove_padding is None else use_remove_padding)
        # looked up now too, so that an unknown loss_mode fails when the worker builds its model
        get_policy_loss_fn(loss_mode(config))

    # ------------------------------------------------------------------ forward
    def _forward_micro_batch(self, micro: Any, temperature: float, calculate_entropy: bool
                             ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(entropy or None, log-probs) of the micro-batch's response tokens (`_forward_outputs`)."""
        out = self._forward_outputs(micro, temperature, calculate_entropy)
        return out.entropy, out.log_probs

    def _forward_outputs(self, micro: Any, temperature: float, calculate_entropy: bool,
                         calculate_sum_pi_squared: bool = False) -> HeadOutputs:
        """Log-probs (B, R) of the response tokens, with their entropy and sum_v pi_v^2 when asked.

        Vocabulary-wide work (lm_head, temperature, log-softmax, entropy) runs on the positions
        that predict a response token only, never on prompt or retrieved-passage positions, and
        through the fused head (`verl.utils.logprob_head`): autograd keeps the hidden states of
        those positions, not their (positions, V) logits."""
        responses = micro[K.RESPONSES]
        input_ids, attention_mask, position_ids = micro[K.INPUT_IDS], micro[K.ATTENTION_MASK], micro[K.POSITION_IDS]
        batch_size, seqlen = input_ids.shape
        response_length = responses.shape[-1]
        device = input_ids.device
        # Position t predicts token t+1: response token j is predicted at position S-R-1+j.
        predicting_R = torch.arange(seqlen - response_length - 1, seqlen - 1, device=device)
        if self.use_remove_padding:
            if not self._packing_checked:
                check_packing_isolates_sequences(self.actor_module, self.actor_module.config.vocab_size)
                self._packing_checked = True
            packed = pack_batch(input_ids, attention_mask, position_ids)
            # Where a predicting position is a real (packed) token, keep that slot only.
            slot_of = torch.full((batch_size * seqlen,), -1, dtype=torch.long, device=device)
            slot_of[packed.indices] = torch.arange(packed.indices.numel(), device=device)
            slots_BR = slot_of[torch.arange(batch_size, device=device)[:, None] * seqlen + predicting_R[None, :]]
            kept = slots_BR >= 0
            if self.sp_group is not None:
                out_M = self._head_sequence_parallel(packed, slots_BR[kept], responses[kept], temperature,
                                                     calculate_entropy, calculate_sum_pi_squared)
            else:
                out_M = self._head(packed.input_ids, packed.position_ids, None, slots_BR[kept], responses[kept][None],
                                   temperature, calculate_entropy, calculate_sum_pi_squared,
                                   boundary_kwargs(packed.position_ids))

            def unpack(values_1M: torch.Tensor | None) -> torch.Tensor | None:
                if values_1M is None:
                    return None
                values = torch.zeros(batch_size, response_length, dtype=torch.float32, device=device)
                values[kept] = values_1M[0]
                return values

            return HeadOutputs(*(unpack(v) for v in out_M))
        return self._head(input_ids, position_ids, attention_mask, predicting_R, responses, temperature,
                          calculate_entropy, calculate_sum_pi_squared)

    def _head(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
              keep: torch.Tensor, labels: torch.Tensor, temperature: float, calculate_entropy: bool,
              calculate_sum_pi_squared: bool = False, model_kwargs: dict[str, Any] | None = None) -> HeadOutputs:
        """Log-probs (and entropy, sum_v pi_v^2 when asked) of `labels` at the kept positions `keep`
        (1-D index into the sequence axis, passed as transformers' `logits_to_keep`, so the head
        runs on those positions alone); each shaped like `labels`. The model's own lm_head call
        computes them (`lm_head_computes_log_probs`), inside the model's forward where FSDP2 has
        unsharded the head's weight. `model_kwargs`: more keywords for the model (a packed row's
        `boundary_kwargs`)."""
        head = self.actor_module.get_output_embeddings()
        with lm_head_computes_log_probs(head, labels, temperature, calculate_entropy,
                                        calculate_sum_pi_squared=calculate_sum_pi_squared) as fused:
            if self._router_aux and self._router_aux_losses is not None:
                model_kwargs = {**(model_kwargs or {}), "output_router_logits": True}
            out = self.actor_module(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                    use_cache=False, logits_to_keep=keep, **(model_kwargs or {}))
        aux_loss = getattr(out, "aux_loss", None)   # an MoE with output_router_logits
        if self._router_aux_losses is not None and aux_loss is not None:
            self._router_aux_losses.append(aux_loss)
        log_probs, entropy = fused.read(out.logits)
        return HeadOutputs(log_probs, entropy,
                           fused.sum_pi_squared(out.logits) if calculate_sum_pi_squared else None)

    def _head_sequence_parallel(self, packed: Any, slots_M: torch.Tensor, labels_M: torch.Tensor,
                                temperature: float, calculate_entropy: bool, calculate_sum_pi_squared: bool = False
                                ) -> HeadOutputs:
        """`_head` over this rank's slice of the packed row: the fused head runs on every position of
        the slice (each labelled with its next token, the response token at the kept slots), the
        slices' results are gathered over the SP group, then the kept slots are read."""
        n = packed.input_ids.shape[-1]
        labels_N = packed.input_ids[0].roll(-1).clone()
        labels_N[slots_M] = labels_M
        with ulysses.sequence_parallel(self.sp_group, packed.position_ids) as self._sp_state:
            ids_1n, pos_1n, pad = ulysses.slice_packed(packed.input_ids, packed.position_ids, self.sp_group)
            chunk = ids_1n.shape[-1]
            start = dist.get_rank(self.sp_group) * chunk
            labels_padded = torch.cat([labels_N, labels_N.new_zeros(pad)])
            keep = torch.arange(chunk, device=ids_1n.device)
            out_1n = self._head(ids_1n, pos_1n, None, keep, labels_padded[start:start + chunk][None], temperature,
                                calculate_entropy, calculate_sum_pi_squared)

        def gather(values_1n: torch.Tensor | None) -> torch.Tensor | None:
            return None if values_1n is None else ulysses.gather_tokens(values_1n[0], self.sp_group)[:n][slots_M][None]

        return HeadOutputs(*(gather(v) for v in out_1n))

    def compute_log_prob(self, data: Any, calculate_entropy: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (B, R) of `responses`, and their entropy or None; reads input_ids,
        attention_mask, position_ids, responses.

        meta_info: micro_batch_size, temperature, use_dynamic_bsz, max_token_len (when dynamic).
        """
        out = self.compute_log_prob_outputs(data, calculate_entropy)
        return out.log_probs, out.entropy

    def compute_log_prob_outputs(self, data: Any, calculate_entropy: bool = False,
                                 calculate_sum_pi_squared: bool = False) -> HeadOutputs:
        """`compute_log_prob`, with sum_v pi_v^2 per token too when asked (veRL's
        `calculate_sum_pi_squared`: the optimal token baseline reads it), in the same forward."""
        temperature = float(_meta(data, K.META_TEMPERATURE))
        use_dynamic_bsz = bool(data.meta_info.get(K.META_USE_DYNAMIC_BSZ, False))
        batch = data.select(batch_keys=_FORWARD_KEYS).batch
        micro_batches, indices = split_micro_batches(
            batch, data.meta_info.get(K.META_MICRO_BATCH_SIZE), use_dynamic_bsz,
            data.meta_info.get(K.META_MAX_TOKEN_LEN))
        parts: list[HeadOutputs] = []
        # Inference: dropout off (update_policy turns training mode back on).
        self.actor_module.eval()
        with torch.no_grad():
            for micro in micro_batches:
                parts.append(self._forward_outputs(micro, temperature, calculate_entropy, calculate_sum_pi_squared))
        reverse = None
        if indices is not None:
            reverse = torch.tensor(get_reverse_idx([i for part in indices for i in part]), dtype=torch.long)

        def joined(values: list[torch.Tensor | None]) -> torch.Tensor | None:
            if values[0] is None:
                return None
            whole = torch.cat(values, dim=0)
            return whole if reverse is None else whole[reverse]

        return HeadOutputs(*(joined(list(column)) for column in zip(*parts, strict=True)))

    # ------------------------------------------------------------------ update
    def _optimizer_step(self) -> tuple[float, bool]:
        grad_norm, finite = clip_and_check_grad(self.actor_module, self.config.get("grad_clip"))
        if finite:
            self.actor_optimizer.step()
        # A non-finite norm means a bad batch (overflow, inf advantage): skip the step
        # rather than poison the weights and Adam moments.
        self.actor_optimizer.zero_grad(set_to_none=True)
        return grad_norm, finite

    def _mini_batches(self, batch: Any, epoch: int) -> list:
        mini_size = int(self.config.ppo_mini_batch_size)
        if self.config.get("shuffle", False):
            generator = torch.Generator().manual_seed(shuffle_seed(self.config, self._update_calls, epoch))
            batch = batch[torch.randperm(batch.batch_size[0], generator=generator)]
        return list(batch.split(mini_size))

    def _micro_batch_loss(self, micro: Any, temperature: float, metrics: dict[str, list[float]],
                          share: Any = None) -> torch.Tensor:
        """Policy loss (actor.policy_loss.loss_mode, from the registry; vanilla: dual-clip PPO) -
        entropy bonus (+ KL-to-reference loss), all over response_mask.

        `share(mode)`: this micro-batch's weight in its mini-batch for a term aggregated by `mode`
        (None: 1); each term is weighted by its own, so a loss that aggregates on its own
        (`fixed_loss_agg_mode`: gspo, sapo, geo_mean) is split like the whole mini-batch too."""
        cfg = self.config
        share = share or (lambda mode: 1.0)
        loss_agg_mode = cfg.get("loss_agg_mode", "token-mean")
        scale = cfg.get("loss_scale_factor", None)
        response_mask = micro[K.RESPONSE_MASK].float()
        self._router_aux_losses = []
        try:
            entropy, log_prob = self._forward_micro_batch(micro, temperature, calculate_entropy=True)
            router_aux = self._router_aux_losses
        finally:
            self._router_aux_losses = None
        is_weights = micro[K.ROLLOUT_IS_WEIGHTS] if K.ROLLOUT_IS_WEIGHTS in micro.keys() else None
        policy_loss_fn = get_policy_loss_fn(loss_mode(cfg))
        pg_loss, pg_metrics = policy_loss_fn(micro[K.OLD_LOG_PROBS], log_prob, micro[K.ADVANTAGES], response_mask,
                                             loss_agg_mode, cfg, rollout_is_weights=is_weights)
        entropy_loss = tf.agg_loss(entropy, response_mask, loss_agg_mode, loss_scale_factor=scale)
        pg_mode = getattr(policy_loss_fn, "fixed_loss_agg_mode", loss_agg_mode)
        policy_loss = (pg_loss * share(pg_mode)
                       - float(cfg.get("entropy_coeff", 0.0)) * entropy_loss * share(loss_agg_mode))
        if cfg.get("use_kl_loss", False):
            kld = core_algos.kl_penalty(log_prob, micro[K.REF_LOG_PROB], cfg.kl_loss_type)
            kl_loss = tf.agg_loss(kld, response_mask, loss_agg_mode, loss_scale_factor=scale)
            policy_loss = policy_loss + float(cfg.kl_loss_coef) * kl_loss * share(loss_agg_mode)
            metrics["actor/kl_loss"].append(kl_loss.item())
            metrics["actor/kl_coef"].append(float(cfg.kl_loss_coef))
        if router_aux:   # the micro-batch's one forward (under Ulysses: this rank's slice of it)
            aux = torch.stack(router_aux).mean()
            coef = float(getattr(self.actor_module.config, "router_aux_loss_coef", 0.0))
            policy_loss = policy_loss + coef * aux * share(loss_agg_mode)
            metrics["actor/router_aux_loss"].append(aux.item())
        metrics["actor/pg_loss"].append(pg_loss.item())
        for name, value in pg_metrics.items():
            metrics[name].append(float(value))
        metrics["actor/entropy"].append(entropy_loss.item())
        return policy_loss

    def update_policy(self, data: Any) -> dict[str, list[float]]:
        """PPO epochs x mini-batches x micro-batches; one optimizer step per mini-batch.

        Reads responses, input_ids, attention_mask, position_ids, old_log_probs,
        advantages, response_mask (+ ref_log_prob when use_kl_loss, + rollout_is_weights when
        present); meta_info temperature.
        """
        if self.actor_optimizer is None:
            raise RuntimeError("update_policy needs an optimizer; this actor was built for inference only")
        self.actor_module.train()
        cfg = self.config
        temperature = float(_meta(data, K.META_TEMPERATURE))
        keys = _FORWARD_KEYS + [K.OLD_LOG_PROBS, K.ADVANTAGES, K.RESPONSE_MASK]
        if cfg.get("use_kl_loss", False):
            keys.append(K.REF_LOG_PROB)
        if K.ROLLOUT_IS_WEIGHTS in data.batch.keys():          # algorithm.rollout_correction.rollout_is
            keys.append(K.ROLLOUT_IS_WEIGHTS)
        batch = data.select(batch_keys=keys).batch
        metrics: dict[str, list[float]] = defaultdict(list)
        grad_nonfinite = 0
        for epoch in range(int(cfg.get("ppo_epochs", 1))):
            for mini in self._mini_batches(batch, epoch):
                micro_batches, _ = split_micro_batches(
                    mini, cfg.get("ppo_micro_batch_size"), bool(cfg.get("use_dynamic_bsz", False)),
                    cfg.get("ppo_max_token_len_per_gpu"))
                self.actor_optimizer.zero_grad(set_to_none=True)
                # Totals over the data-parallel ranks: the update is the global mini-batch's loss
                # (with local totals it would be the mean of the ranks' losses, which depends on
                # how the tokens fell between ranks).
                mini_tokens, mini_rows, dp_size = tf.data_parallel_totals(
                    float(mini[K.RESPONSE_MASK].sum()), tf.rows_with_tokens(mini[K.RESPONSE_MASK]),
                    mini[K.RESPONSE_MASK].device)
                for micro in micro_batches:
                    # each term weighs the micro-batch's share of the mini-batch's tokens (token-mean)
                    # or rows with a loss token (seq-mean modes; a row rejected whole counts in
                    # neither): the sum is the loss of the whole mini-batch, however (dynamic batch
                    # size) the rows were split
                    share = partial(_share, micro[K.RESPONSE_MASK], mini_tokens, mini_rows, dp_size)
                    self._sp_state = None
                    loss = self._micro_batch_loss(micro, temperature, metrics, share)
                    with ulysses.resumed(self._sp_state):   # gradient checkpointing's recompute runs SP too
                        loss.backward()
                grad_norm, finite = self._optimizer_step()
                grad_nonfinite += int(not finite)
                metrics["actor/grad_norm"].append(grad_norm)
        metrics["actor/grad_nonfinite"].append(float(grad_nonfinite))
        self._update_calls += 1
        return dict(metrics)
