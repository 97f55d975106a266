#!/usr/bin/env bash
# Search-R1 PPO with Qwen/Qwen2.5-32B on a multi-node Ray cluster (4 nodes x 8 GPUs by default), in the
# style of the original Search-R1 launchers: train_ppo.sh with the settings a model this size needs
# (FSDP offload, gradient checkpointing, vLLM tensor parallel 4), joining the running cluster.
#
#   On the head of a running cluster (example/multinode/start_head.sh / start_worker.sh):
#     bash example/multinode/train_ppo_multinode_32b.sh [hydra overrides...]
#   Under Slurm (starts the cluster and the retrieval server, then runs this):
#     TRAIN_SCRIPT=example/multinode/train_ppo_multinode_32b.sh sbatch --nodes=4 scripts/slurm/train_ppo.sbatch
#
# Environment: BASE_MODEL (default Qwen/Qwen2.5-32B), NNODES (default 4, or SLURM_NNODES), GPUS_PER_NODE (8),
# TP_SIZE (vLLM tensor parallel, default 4), RAY_ADDRESS (default auto), DATA_DIR
# (default data/nq_hotpotqa_train), RETRIEVER_URL, EXPERIMENT_NAME, WAND_PROJECT, and batch sizes
# TRAIN_BATCH_SIZE (512 prompts), PPO_MINI_BATCH_SIZE (256 rollouts), PPO_MICRO_BATCH_SIZE (32),
# LOG_PROB_MICRO_BATCH_SIZE (128). These are starting points for 80 GB GPUs, not measured here
# (docs/multinode.md says what was run). Extra arguments are Hydra overrides and win.
set -euo pipefail
cd "$(dirname "$0")/../.."

export BASE_MODEL=${BASE_MODEL:-Qwen/Qwen2.5-32B}
export DATA_DIR=${DATA_DIR:-data/nq_hotpotqa_train}
NNODES=${NNODES:-${SLURM_NNODES:-4}}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
export N_GPUS=$GPUS_PER_NODE
TP_SIZE=${TP_SIZE:-4}
model_tag=$(basename "$BASE_MODEL" | tr '[:upper:]' '[:lower:]')
export EXPERIMENT_NAME=${EXPERIMENT_NAME:-nq_hotpotqa_train-search-r1-ppo-$model_tag-em-${NNODES}nodes}

exec bash train_ppo.sh \
    trainer.ray_address="${RAY_ADDRESS:-auto}" \
    trainer.nnodes="$NNODES" \
    trainer.n_gpus_per_node="$GPUS_PER_NODE" \
    data.train_batch_size="${TRAIN_BATCH_SIZE:-512}" \
    data.val_batch_size=256 \
    actor_rollout_ref.actor.ppo_mini_batch_size="${PPO_MINI_BATCH_SIZE:-256}" \
    actor_rollout_ref.actor.ppo_micro_batch_size="${PPO_MICRO_BATCH_SIZE:-32}" \
    actor_rollout_ref.rollout.log_prob_micro_batch_size="${LOG_PROB_MICRO_BATCH_SIZE:-128}" \
    actor_rollout_ref.ref.log_prob_micro_batch_size="${LOG_PROB_MICRO_BATCH_SIZE:-128}" \
    actor_rollout_ref.model.enable_gradient_checkpointing=true \
    actor_rollout_ref.actor.fsdp_config.param_offload=true \
    actor_rollout_ref.actor.fsdp_config.grad_offload=true \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=true \
    actor_rollout_ref.ref.fsdp_config.param_offload=true \
    actor_rollout_ref.rollout.tensor_model_parallel_size="$TP_SIZE" \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.5 \
    critic.model.path="$BASE_MODEL" \
    critic.ppo_micro_batch_size="${PPO_MICRO_BATCH_SIZE:-32}" \
    critic.model.enable_gradient_checkpointing=true \
    critic.model.fsdp_config.param_offload=true \
    critic.model.fsdp_config.grad_offload=true \
    critic.model.fsdp_config.optimizer_offload=true \
    "$@"
