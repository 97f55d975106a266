#!/usr/bin/env bash
# Full-parameter GRPO with search on Qwen3-30B-A3B (mixture of experts: 30.5 B parameters, 3.3 B active
# per token, 128 experts, 8 a token) on ONE node of 8 x 80 GB GPUs. The sharded loader reads the
# checkpoint's per-expert tensors into transformers 5's fused experts (verl/utils/checkpoint/name_map.py);
# FSDP2 shards each decoder layer, all its experts with it; weights, gradients and AdamW state are those
# of all 30.5 B parameters (offloaded to the host here), activations those of the active ones. vLLM holds
# the experts with tensor parallel 2. `+trainer.preflight=true` prints the per-phase memory plan (docs/models.md).
#
#   BASE_MODEL=Qwen/Qwen3-30B-A3B bash example/qwen3/train_grpo_qwen3_30b_a3b.sh [extra hydra overrides...]
#
# Environment: that of train_grpo.sh (N_GPUS defaults to 8 here). The router's load-balancing loss is off,
# as in veRL's FSDP path; `+actor_rollout_ref.model.override_config.output_router_logits=true` adds it with
# the config's router_aux_loss_coef. Starting points planned by preflight, not measured on GPUs here.
# Extra arguments are Hydra overrides and win.
set -euo pipefail

export BASE_MODEL=${BASE_MODEL:-Qwen/Qwen3-30B-A3B}
export N_GPUS=${N_GPUS:-8}
export ROLLOUT_NAME=${ROLLOUT_NAME:-vllm}   # tensor parallel is vLLM's
exec bash "$(dirname "$0")/../../train_grpo.sh" \
    actor_rollout_ref.actor.ppo_micro_batch_size=16 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size=32 \
    actor_rollout_ref.ref.log_prob_micro_batch_size=32 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.5 \
    "$@"
