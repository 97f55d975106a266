#!/usr/bin/env bash
# GRPO with LoRA on Qwen3-30B-A3B's attention (rank 64, alpha 32; q/k/v/o of every layer) on ONE node of
# 8 x 80 GB GPUs: the frozen base (all 128 experts of every layer) sharded in bf16, the adapter and its
# AdamW state the only trained weights, the reference the actor with the adapter off. LoRA on the routed
# experts or the router is refused (docs/models.md: PEFT wraps the fused experts, which the sharded load,
# the merged push and vLLM's adapter path do not take); `all-linear` is refused on an MoE model for that
# reason. `+trainer.preflight=true` prints the per-phase memory plan.
#
#   BASE_MODEL=Qwen/Qwen3-30B-A3B bash example/qwen3/train_grpo_qwen3_30b_a3b_lora.sh [extra hydra overrides...]
#
# Environment: that of train_grpo.sh (N_GPUS defaults to 8 here); LORA_RANK (64), LORA_ALPHA (32).
# Starting points planned by preflight, not measured on GPUs here. Extra arguments are Hydra overrides and win.
set -euo pipefail

export BASE_MODEL=${BASE_MODEL:-Qwen/Qwen3-30B-A3B}
export N_GPUS=${N_GPUS:-8}
export ROLLOUT_NAME=${ROLLOUT_NAME:-vllm}
exec bash "$(dirname "$0")/../../train_grpo.sh" \
    actor_rollout_ref.model.lora_rank="${LORA_RANK:-64}" \
    actor_rollout_ref.model.lora_alpha="${LORA_ALPHA:-32}" \
    "actor_rollout_ref.model.target_modules=[q_proj,k_proj,v_proj,o_proj]" \
    actor_rollout_ref.actor.optim.lr=1e-5 \
    actor_rollout_ref.actor.ppo_micro_batch_size=16 \
    actor_rollout_ref.actor.fsdp_config.param_offload=false \
    actor_rollout_ref.actor.fsdp_config.grad_offload=false \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=false \
    actor_rollout_ref.ref.fsdp_config.param_offload=false \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size=32 \
    actor_rollout_ref.ref.log_prob_micro_batch_size=32 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.5 \
    "$@"
