#!/usr/bin/env bash
# GRPO training of a search agent (group-normalised EM reward, KL loss) with the paper's recipe, as
# in the original Search-R1 train_grpo.sh: 512 prompts x n_agent=5 samples, mini-batches of 256
# rollouts (10 optimizer steps a training step), micro-batch 64, FSDP offload of actor and ref,
# vLLM at gpu_memory_utilization 0.6, max_obs_length 500, sampling at temperature 1 with top_p
# 0.95 (the original's rollout defaults), every validation row, validated before training and
# every 50 steps. Sized for one node of 8 GPUs (80 GB); it also divides over 2 x 8 (sbatch).
#
#   BASE_MODEL=Qwen/Qwen2.5-3B-Instruct bash train_grpo.sh [extra hydra overrides...]
#   bash example/train_grpo_2gpu.sh                 # a smaller setting for 2 GPUs
#   bash train_grpo.sh ... +trainer.preflight=true  # check the config only (seconds, no GPU time)
#
# Environment: BASE_MODEL, DATA_DIR (default data/nq_search), EXPERIMENT_NAME, N_GPUS (default 8),
# NNODES (default 1), WAND_PROJECT, RETRIEVER_URL, ROLLOUT_NAME (auto: vllm with a GPU and vllm
# installed, else hf; or hf / vllm). Extra arguments are Hydra overrides and win over the defaults here.
# With no BASE_MODEL on a machine with no GPU, this runs the small offline CPU demo instead.
# ppo_mini_batch_size counts rollouts (rows after the n_agent repetition), as in the original:
# 256 of the 2560 rollouts a step, 10 optimizer steps (docs/training.md).
set -euo pipefail
cd "$(dirname "$0")"
# ./.venv's Python when no virtual environment is active; a clear stop when the packages are missing
source scripts/use_venv.sh && require_python_modules torch transformers ray hydra pandas

has_gpu() { python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }

# --- DEMO HOOK (owned by scripts/demo/): no model given and no GPU -> offline CPU demo -------------
if [ -z "${BASE_MODEL:-}" ] && ! has_gpu; then
    exec python3 -m scripts.demo.run_demo "$@"
fi
# ----------------------------------------------------------------------------------------------------

export DATA_DIR=${DATA_DIR:-data/nq_search}
export BASE_MODEL=${BASE_MODEL:-Qwen/Qwen2.5-3B-Instruct}
export EXPERIMENT_NAME=${EXPERIMENT_NAME:-nq-search-r1-grpo-$(basename "$BASE_MODEL" | tr '[:upper:]' '[:lower:]')-em}
N_GPUS=${N_GPUS:-8}
NNODES=${NNODES:-1}
WAND_PROJECT=${WAND_PROJECT:-Search-R1}
RETRIEVER_URL=${RETRIEVER_URL:-http://127.0.0.1:8000/retrieve}
ROLLOUT_NAME=${ROLLOUT_NAME:-auto}  # auto = vllm on a GPU with vllm installed, hf otherwise

# `+trainer.val_*` may be appended only once: leave ours out when the caller passes them.
VAL_FLAGS=()
case " $* " in *"trainer.val_only="*) ;; *) VAL_FLAGS+=("+trainer.val_only=false") ;; esac
case " $* " in *"trainer.val_before_train="*) ;; *) VAL_FLAGS+=("+trainer.val_before_train=true") ;; esac

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
    algorithm.adv_estimator=grpo \
    actor_rollout_ref.model.path="$BASE_MODEL" \
    actor_rollout_ref.model.enable_gradient_checkpointing=true \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.285 \
    actor_rollout_ref.actor.use_kl_loss=true \
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
    actor_rollout_ref.ref.fsdp_config.param_offload=true \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    algorithm.no_think_rl=false \
    actor_rollout_ref.rollout.n_agent=5 \
    actor_rollout_ref.rollout.temperature=1 \
    actor_rollout_ref.rollout.top_p=0.95 \
    actor_rollout_ref.rollout.top_k=-1 \
    actor_rollout_ref.actor.state_masking=true \
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
