#!/usr/bin/env bash
# PPO (GAE + critic) training of a search agent with the paper's recipe, as in the original
# Search-R1 train_ppo.sh: 512 prompts, mini-batches of 256 (2 optimizer steps a training step),
# actor micro-batch 64, FSDP offload of actor, ref and critic, vLLM at gpu_memory_utilization 0.6,
# sampling at temperature 1 with top_p 0.95 (the original's rollout defaults), every validation
# row, validated before training and every 50 steps. Sized for one node of 8 GPUs (80 GB).
# The critic's micro-batch is one row per worker (CRITIC_MICRO_BATCH_SIZE, default the worker
# count N_GPUS x NNODES, or trainer.n_gpus_per_node x trainer.nnodes when passed as overrides: the
# original's 8 on 8 GPUs), so the recipe also divides over 2 x 8 and 4 x 8 (sbatch).
#
#   BASE_MODEL=Qwen/Qwen2.5-3B bash train_ppo.sh [extra hydra overrides...]
#   bash train_ppo.sh ... +trainer.preflight=true   # check the config only (seconds, no GPU time)
#
# Environment: BASE_MODEL, DATA_DIR (default data/nq_search), EXPERIMENT_NAME, N_GPUS (default 8),
# NNODES (default 1), CRITIC_MICRO_BATCH_SIZE, WAND_PROJECT, RETRIEVER_URL, ROLLOUT_NAME (auto: vllm
# with a GPU and vllm installed, else hf; or hf / vllm). Extra arguments are Hydra overrides and win
# over the defaults here.
# With no BASE_MODEL on a machine with no GPU, this runs the small offline CPU demo instead, with PPO
# (GAE + critic; demo.algorithm=ppo, docs/demo.md).
set -euo pipefail
cd "$(dirname "$0")"
# ./.venv's Python when no virtual environment is active; a clear stop when the packages are missing
source scripts/use_venv.sh && require_python_modules torch transformers ray hydra pandas

has_gpu() { python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }

# --- DEMO HOOK (owned by scripts/demo/): no model given and no GPU -> offline CPU demo -------------
if [ -z "${BASE_MODEL:-}" ] && ! has_gpu; then
    exec python3 -m scripts.demo.run_demo demo.algorithm=ppo "$@"
fi
# ----------------------------------------------------------------------------------------------------

export DATA_DIR=${DATA_DIR:-data/nq_search}
export BASE_MODEL=${BASE_MODEL:-Qwen/Qwen2.5-3B}
export EXPERIMENT_NAME=${EXPERIMENT_NAME:-nq-search-r1-ppo-$(basename "$BASE_MODEL" | tr '[:upper:]' '[:lower:]')-em}
N_GPUS=${N_GPUS:-8}
NNODES=${NNODES:-1}
WAND_PROJECT=${WAND_PROJECT:-Search-R1}
RETRIEVER_URL=${RETRIEVER_URL:-http://127.0.0.1:8000/retrieve}
ROLLOUT_NAME=${ROLLOUT_NAME:-auto}  # auto = vllm on a GPU with vllm installed, hf otherwise
# The worker count as the trainer will see it: overrides (e.g. from the sbatch files) win.
for arg in "$@"; do
    case "$arg" in
        trainer.nnodes=*) NNODES=${arg#*=} ;;
        trainer.n_gpus_per_node=*) N_GPUS=${arg#*=} ;;
    esac
done
critic_micro=${CRITIC_MICRO_BATCH_SIZE:-$((N_GPUS * NNODES))}   # one row per worker

# `+trainer.val_*` may be appended only once: leave ours out when the caller passes them.
VAL_FLAGS=()
case " $* " in *"trainer.val_only="*) ;; *) VAL_FLAGS+=("+trainer.val_only=false") ;; esac
case " $* " in *"trainer.val_before_train="*) ;; *) VAL_FLAGS+=("+trainer.val_before_train=true") ;; esac

# max_prompt_length bounds the rolling context: start + (turns-1) responses + turns observations.
PYTHONUNBUFFERED=1 python3 -m verl.trainer.main_ppo \
    data.train_files="$DATA_DIR/train.parquet" \
    data.val_files="$DATA_DIR/test.parquet" \
    data.train_data_num=null \
    data.val_data_num=null \
    data.train_batch_size=512 \
    data.val_batch_size=256 \
    data.max_prompt_length=4096 \
    data.max_response_length=500 \
    data.max_start_length=2048 \
    data.max_obs_length=500 \
    data.shuffle_train_dataloader=True \
    algorithm.adv_estimator=gae \
    actor_rollout_ref.model.path="$BASE_MODEL" \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.model.enable_gradient_checkpointing=true \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.285 \
    actor_rollout_ref.actor.ppo_mini_batch_size=256 \
    actor_rollout_ref.actor.ppo_micro_batch_size=64 \
    actor_rollout_ref.actor.fsdp_config.param_offload=true \
    actor_rollout_ref.actor.fsdp_config.grad_offload=true \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=true \
    actor_rollout_ref.rollout.log_prob_micro_batch_size=128 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.name="$ROLLOUT_NAME" \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.ref.log_prob_micro_batch_size=128 \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    actor_rollout_ref.rollout.n_agent=1 \
    actor_rollout_ref.rollout.temperature=1 \
    actor_rollout_ref.rollout.top_p=0.95 \
    actor_rollout_ref.rollout.top_k=-1 \
    actor_rollout_ref.actor.state_masking=true \
    critic.optim.lr=1e-5 \
    critic.model.use_remove_padding=True \
    critic.optim.lr_warmup_steps_ratio=0.015 \
    critic.model.path="$BASE_MODEL" \
    critic.model.enable_gradient_checkpointing=true \
    critic.ppo_micro_batch_size="$critic_micro" \
    critic.model.fsdp_config.param_offload=true \
    critic.model.fsdp_config.grad_offload=true \
    critic.model.fsdp_config.optimizer_offload=true \
    algorithm.kl_ctrl.kl_coef=0.001 \
    algorithm.no_think_rl=false \
    trainer.critic_warmup=0 \
    trainer.logger="['wandb']" \
    "${VAL_FLAGS[@]}" \
    trainer.default_hdfs_dir=null \
    trainer.n_gpus_per_node="$N_GPUS" \
    trainer.nnodes="$NNODES" \
    trainer.save_freq=100 \
    trainer.test_freq=50 \
    trainer.project_name="$WAND_PROJECT" \
    trainer.experiment_name="$EXPERIMENT_NAME" \
    trainer.total_epochs=15 \
    trainer.total_training_steps=1005 \
    trainer.default_local_dir="verl_checkpoints/$EXPERIMENT_NAME" \
    max_turns=2 \
    retriever.url="$RETRIEVER_URL" \
    retriever.topk=3 \
    "$@" \
    2>&1 | tee "$EXPERIMENT_NAME.log"
