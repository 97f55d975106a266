#!/usr/bin/env bash
# GSPO (arXiv 2507.18071, veRL's keys) for a search agent on the Search-R1 NQ data, one node of 8 GPUs
# (80 GB): the sequence-level importance ratio (policy_loss.loss_mode=gspo) clipped at 3e-4 / 4e-4,
# the loss averaged per sequence then over sequences (seq-mean-token-mean), no KL, GRPO advantages
# over 5 samples a prompt; 512 prompts a step in 10 mini-batches, as train_grpo.sh.
#
#   BASE_MODEL=Qwen/Qwen2.5-3B bash example/recipes/gspo/train_gspo.sh [extra hydra overrides...]
#   BASE_MODEL=Qwen/Qwen2.5-7B bash example/recipes/gspo/train_gspo.sh
#   bash example/recipes/gspo/train_gspo.sh ... +trainer.preflight=true   # check the config only
#
# Environment: that of train_grpo.sh; BASE_MODEL defaults to Qwen/Qwen2.5-3B here. Extra arguments
# are Hydra overrides and win. docs/algorithms.md, "Algorithm recipes".
set -euo pipefail

export BASE_MODEL=${BASE_MODEL:-Qwen/Qwen2.5-3B}
export EXPERIMENT_NAME=${EXPERIMENT_NAME:-nq-search-r1-gspo-$(basename "$BASE_MODEL" | tr '[:upper:]' '[:lower:]')}

exec bash "$(dirname "$0")/../../../train_grpo.sh" \
    actor_rollout_ref.actor.policy_loss.loss_mode=gspo \
    actor_rollout_ref.actor.clip_ratio_low=0.0003 \
    actor_rollout_ref.actor.clip_ratio_high=0.0004 \
    actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean \
    actor_rollout_ref.actor.use_kl_loss=false \
    algorithm.use_kl_in_reward=false \
    trainer.total_training_steps=500 \
    "$@"
