#!/usr/bin/env bash
# Dr. GRPO (arXiv 2503.20783, veRL's keys) for a search agent on the Search-R1 NQ data, one node of 8
# GPUs (80 GB): GRPO without the two length and difficulty biases, i.e. advantages not divided by the
# group's std (algorithm.norm_adv_by_std_in_grpo=false) and the loss summed over tokens and divided by
# a constant (seq-mean-token-sum-norm) instead of each sequence's length; no KL. Otherwise
# train_grpo.sh (512 prompts x 5 samples, 10 mini-batches, vLLM, search).
# The constant, actor.loss_scale_factor=2500, is the widest response train_grpo.sh can produce: 3 turns
# of data.max_response_length=500 and 2 observations of data.max_obs_length=500 (max_turns=2); null
# gives the same, set once at start-up. Never the step's padded width: that moves with its longest row.
#
#   BASE_MODEL=Qwen/Qwen2.5-3B bash example/recipes/drgrpo/train_drgrpo.sh [extra hydra overrides...]
#   BASE_MODEL=Qwen/Qwen2.5-7B bash example/recipes/drgrpo/train_drgrpo.sh
#   bash example/recipes/drgrpo/train_drgrpo.sh ... +trainer.preflight=true   # check the config only
#
# Environment: that of train_grpo.sh; BASE_MODEL defaults to Qwen/Qwen2.5-3B here. Extra arguments
# are Hydra overrides and win. docs/algorithms.md, "Algorithm recipes".
set -euo pipefail

export BASE_MODEL=${BASE_MODEL:-Qwen/Qwen2.5-3B}
export EXPERIMENT_NAME=${EXPERIMENT_NAME:-nq-search-r1-drgrpo-$(basename "$BASE_MODEL" | tr '[:upper:]' '[:lower:]')}

exec bash "$(dirname "$0")/../../../train_grpo.sh" \
    algorithm.adv_estimator=grpo \
    algorithm.norm_adv_by_std_in_grpo=false \
    actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm \
    actor_rollout_ref.actor.loss_scale_factor=2500 \
    actor_rollout_ref.actor.use_kl_loss=false \
    algorithm.use_kl_in_reward=false \
    trainer.total_training_steps=500 \
    "$@"
