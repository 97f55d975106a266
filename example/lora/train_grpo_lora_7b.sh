#!/usr/bin/env bash
# GRPO with LoRA (rank 64, alpha 32, all linear layers) on Qwen2.5-7B-Instruct on ONE 80 GB GPU:
# train_grpo.sh's recipe with the adapter as the only trained weights (docs/lora.md). The
# frozen base stays in bf16 (15 GB), the adapter and its AdamW state are ~0.6 GB, and the reference
# log-probs come from the actor with the adapter off, so nothing is offloaded. Micro-batches of 8 rows,
# vLLM at gpu_memory_utilization 0.4. `+trainer.preflight=true` prints the per-phase memory plan.
#
#   BASE_MODEL=Qwen/Qwen2.5-7B-Instruct bash example/lora/train_grpo_lora_7b.sh [extra hydra overrides...]
#
# Environment: that of train_grpo.sh (N_GPUS defaults to 1 here); LORA_RANK (64), LORA_ALPHA (32).
# A learning rate for the adapter (1e-5) higher than full fine-tuning's, as is usual for LoRA. Starting
# points planned by preflight, not measured on a GPU here. Extra arguments are Hydra overrides and win.
set -euo pipefail

export BASE_MODEL=${BASE_MODEL:-Qwen/Qwen2.5-7B-Instruct}
export N_GPUS=${N_GPUS:-1}
exec bash "$(dirname "$0")/../../train_grpo.sh" \
    actor_rollout_ref.model.lora_rank="${LORA_RANK:-64}" \
    actor_rollout_ref.model.lora_alpha="${LORA_ALPHA:-32}" \
    actor_rollout_ref.model.target_modules=all-linear \
    actor_rollout_ref.actor.optim.lr=1e-5 \
    actor_rollout_ref.actor.ppo_micro_batch_size=8 \
    actor_rollout_ref.actor.fsdp_config.param_offload=false \
    actor_rollout_ref.actor.fsdp_config.grad_offload=false \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=false \
    actor_rollout_ref.ref.fsdp_config.param_offload=false \
    actor_rollout_ref.rollout.log_prob_micro_batch_size=16 \
    actor_rollout_ref.ref.log_prob_micro_batch_size=16 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.4 \
    "$@"
