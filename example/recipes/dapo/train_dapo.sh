#!/usr/bin/env bash
# DAPO (arXiv 2503.14476, veRL's recipe keys) for a search agent on the Search-R1 NQ data, one node of 8
# GPUs (80 GB): clip-higher (eps_low 0.2, eps_high 0.28), dynamic sampling (groups whose EM is the
# same for all 8 samples are dropped; generation batches of 384 prompts until 256 prompts' groups are
# kept, at most 10 a step), overlong reward shaping over the last 128 tokens of a turn, token-level
# loss, no KL (no reference policy). The rest is train_grpo.sh's (vLLM, FSDP offload, search).
#
#   BASE_MODEL=Qwen/Qwen2.5-3B bash example/recipes/dapo/train_dapo.sh [extra hydra overrides...]
#   BASE_MODEL=Qwen/Qwen2.5-7B bash example/recipes/dapo/train_dapo.sh
#   bash example/recipes/dapo/train_dapo.sh ... +trainer.preflight=true   # check the config only
#
# Environment: that of train_grpo.sh (DATA_DIR, N_GPUS=8, RETRIEVER_URL, ...); BASE_MODEL defaults to
# Qwen/Qwen2.5-3B here. Extra arguments are Hydra overrides and win. docs/algorithms.md, "DAPO".
set -euo pipefail

export BASE_MODEL=${BASE_MODEL:-Qwen/Qwen2.5-3B}
export EXPERIMENT_NAME=${EXPERIMENT_NAME:-nq-search-r1-dapo-$(basename "$BASE_MODEL" | tr '[:upper:]' '[:lower:]')}

exec bash "$(dirname "$0")/../../../train_grpo.sh" \
    data.train_batch_size=256 \
    data.gen_batch_size=384 \
    actor_rollout_ref.rollout.n_agent=8 \
    actor_rollout_ref.actor.ppo_mini_batch_size=512 \
    actor_rollout_ref.actor.ppo_micro_batch_size=64 \
    actor_rollout_ref.actor.use_kl_loss=false \
    algorithm.use_kl_in_reward=false \
    actor_rollout_ref.actor.clip_ratio_low=0.2 \
    actor_rollout_ref.actor.clip_ratio_high=0.28 \
    actor_rollout_ref.actor.loss_agg_mode=token-mean \
    algorithm.filter_groups.enable=true \
    algorithm.filter_groups.metric=acc \
    algorithm.filter_groups.max_num_gen_batches=10 \
    reward_model.overlong_buffer.enable=true \
    reward_model.overlong_buffer.len=128 \
    reward_model.overlong_buffer.penalty_factor=1.0 \
    reward_model.overlong_buffer.log=true \
    actor_rollout_ref.rollout.top_p=1.0 \
    trainer.total_training_steps=500 \
    "$@"
