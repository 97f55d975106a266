#!/usr/bin/env bash
# GRPO with LoRA (rank 64, alpha 32, all linear layers) on Qwen2.5-72B-Instruct on ONE node of 8 x 80 GB GPUs:
# train_grpo.sh's recipe with the adapter as the only trained weights (docs/lora.md). The
# frozen base is sharded in bf16 over the 8 GPUs, the adapter and its AdamW state are small, and the
# reference log-probs come from the actor with the adapter off (no reference weights); vLLM runs with
# tensor parallel 8 on the merged weights. `+trainer.preflight=true` prints the per-phase memory plan.
#
#   BASE_MODEL=Qwen/Qwen2.5-72B-Instruct bash example/lora/train_grpo_lora_72b.sh [extra hydra overrides...]
#
# Environment: that of train_grpo.sh (N_GPUS defaults to 8 here); LORA_RANK (64), LORA_ALPHA (32).
# Starting points planned by preflight, not measured on GPUs here. Extra arguments are Hydra overrides and win.
set -euo pipefail

export BASE_MODEL=${BASE_MODEL:-Qwen/Qwen2.5-72B-Instruct}
export N_GPUS=${N_GPUS:-8}
export ROLLOUT_NAME=${ROLLOUT_NAME:-vllm}   # tensor parallel 8 is vLLM's
exec bash "$(dirname "$0")/../../train_grpo.sh" \
    actor_rollout_ref.model.lora_rank="${LORA_RANK:-64}" \
    actor_rollout_ref.model.lora_alpha="${LORA_ALPHA:-32}" \
    actor_rollout_ref.model.target_modules=all-linear \
    actor_rollout_ref.actor.optim.lr=1e-5 \
    actor_rollout_ref.actor.ppo_micro_batch_size=16 \
    actor_rollout_ref.actor.fsdp_config.param_offload=false \
    actor_rollout_ref.actor.fsdp_config.grad_offload=false \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=false \
    actor_rollout_ref.ref.fsdp_config.param_offload=false \
    actor_rollout_ref.rollout.tensor_model_parallel_size=8 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size=32 \
    actor_rollout_ref.ref.log_prob_micro_batch_size=32 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.5 \
    "$@"
