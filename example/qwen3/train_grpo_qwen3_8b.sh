#!/usr/bin/env bash
# GRPO with search on Qwen3-8B (or Qwen3-4B: BASE_MODEL=Qwen/Qwen3-4B) on ONE node of 8 x 80 GB GPUs:
# train_grpo.sh's recipe (paper settings: 512 prompts x 5, FSDP offload of actor and reference, vLLM at
# 0.6) with Qwen3's chat template. Qwen3 thinks by default (it writes <think>…</think> itself, which is the
# Search-R1 format); `+data.apply_chat_template_kwargs.enable_thinking=false` (veRL's key) starts each
# answer with an empty reasoning block instead (docs/models.md). `+trainer.preflight=true` prints the
# per-phase memory plan and its verdict without a GPU.
#
#   BASE_MODEL=Qwen/Qwen3-8B bash example/qwen3/train_grpo_qwen3_8b.sh [extra hydra overrides...]
#
# Environment: that of train_grpo.sh (N_GPUS defaults to 8 here). Starting points planned by preflight,
# not measured on GPUs here. Extra arguments are Hydra overrides and win.
set -euo pipefail

export BASE_MODEL=${BASE_MODEL:-Qwen/Qwen3-8B}
export N_GPUS=${N_GPUS:-8}
exec bash "$(dirname "$0")/../../train_grpo.sh" \
    actor_rollout_ref.actor.ppo_micro_batch_size=32 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size=64 \
    actor_rollout_ref.ref.log_prob_micro_batch_size=64 \
    "$@"
