#!/usr/bin/env bash
# GRPO on one node of 2 GPUs: train_grpo.sh with a smaller setting (one user's Qwen2.5-3B-Instruct run,
# shared/fixtures/seed_grpo_overrides.txt, except the mini-batch): 64 prompts x n_agent=4, mini-batches
# of 128 rollouts (2 optimizer steps a training step), micro-batch 8, no FSDP offload, vLLM at
# gpu_memory_utilization 0.45, 256 validation rows in batches of 64, max_obs_length 2048, no
# validation before training, validation every 100 steps. train_grpo.sh itself ships the paper's
# recipe (8 GPUs).
#
#   BASE_MODEL=Qwen/Qwen2.5-3B-Instruct bash example/train_grpo_2gpu.sh [extra hydra overrides...]
#
# Environment: that of train_grpo.sh (N_GPUS defaults to 2 here). Extra arguments are Hydra
# overrides and win, `+trainer.val_before_train=...` included.
set -euo pipefail

export N_GPUS=${N_GPUS:-2}
val_flags=()
case " $* " in *"trainer.val_before_train="*) ;; *) val_flags+=("+trainer.val_before_train=false") ;; esac

exec bash "$(dirname "$0")/../train_grpo.sh" \
    data.val_data_num=256 \
    data.train_batch_size=64 \
    data.val_batch_size=64 \
    data.max_obs_length=2048 \
    actor_rollout_ref.actor.ppo_mini_batch_size=128 \
    actor_rollout_ref.actor.ppo_micro_batch_size=8 \
    actor_rollout_ref.actor.fsdp_config.param_offload=false \
    actor_rollout_ref.actor.fsdp_config.grad_offload=false \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=false \
    actor_rollout_ref.rollout.log_prob_micro_batch_size=64 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.45 \
    actor_rollout_ref.ref.log_prob_micro_batch_size=64 \
    actor_rollout_ref.rollout.n_agent=4 \
    trainer.test_freq=100 \
    "${val_flags[@]}" \
    "$@"
