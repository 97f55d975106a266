#!/usr/bin/env bash
# veRL upstream's Search-R1 recipe (native tool calls; veRL's
# examples/sglang_multiturn/search_r1_like/run_qwen2.5-3b_instruct_search_multiturn.sh) on this
# project: the same override list, meaning what it means in veRL (docs/training.md, "Tool protocol"),
# except the engine: ROLLOUT_NAME=vllm (default) or hf, as SGLang is not shipped (docs/rollout.md).
# Sized for one node of 8 GPUs. Needs the retrieval server of the tool config running
# (bash retrieval_launch.sh) and rows in veRL's layout (preprocess_search_r1_dataset.py, or
# scripts/data_process with --format tool).
#
#   bash example/tool_recipe/run_qwen2.5-3b_instruct_search_multiturn.sh [extra hydra overrides...]
#   bash example/tool_recipe/run_qwen2.5-3b_instruct_search_multiturn.sh +trainer.preflight=true  # check only
#
# Environment: TRAIN_DATA, VAL_DATA (default veRL's $HOME/data/searchR1_processed_direct/*.parquet),
# TOOL_CONFIG (default the shipped config/tool_config/search_tool_config.yaml), ROLLOUT_NAME.
set -euo pipefail
set -x

ulimit -n 65535 2>/dev/null || true   # veRL raises it for the tool's connections; not every shell may

# The recipe's search path (file://verl/trainer/config) is relative to the repository root.
PROJECT_DIR="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$PROJECT_DIR"
# ./.venv's Python when no virtual environment is active; a clear stop when the packages are missing
source scripts/use_venv.sh && require_python_modules torch transformers ray hydra pandas
CONFIG_PATH="$PROJECT_DIR/example/tool_recipe/config"

TRAIN_DATA=${TRAIN_DATA:-$HOME/data/searchR1_processed_direct/train.parquet}
VAL_DATA=${VAL_DATA:-$HOME/data/searchR1_processed_direct/test.parquet}
TOOL_CONFIG=${TOOL_CONFIG:-$CONFIG_PATH/tool_config/search_tool_config.yaml}
ROLLOUT_NAME=${ROLLOUT_NAME:-vllm}   # vllm | hf (veRL's recipe: sglang)

python3 -m verl.trainer.main_ppo \
    --config-path="$CONFIG_PATH" \
    --config-name='search_multiturn_grpo' \
    algorithm.adv_estimator=grpo \
    data.train_batch_size=512 \
    data.val_batch_size=256 \
    data.max_prompt_length=4096 \
    data.max_response_length=3000 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    data.return_raw_chat=True \
    actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.285 \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.ppo_mini_batch_size=256 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \
    actor_rollout_ref.rollout.max_model_len=15000 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.name="$ROLLOUT_NAME" \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.5 \
    actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    algorithm.use_kl_in_reward=False \
    trainer.critic_warmup=0 \
    trainer.val_before_train=False \
    trainer.logger='["console","wandb"]' \
    trainer.project_name='search_r1_like_async_rl' \
    trainer.experiment_name='qwen2.5-3b-instruct_function_rm-search-async-sgl-multi-w-searchtool-verify-n16' \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.save_freq=100 \
    trainer.test_freq=50 \
    data.train_files="$TRAIN_DATA" \
    data.val_files="$VAL_DATA" \
    actor_rollout_ref.rollout.multi_turn.tool_config_path="$TOOL_CONFIG" \
    trainer.total_epochs=1 "$@"
