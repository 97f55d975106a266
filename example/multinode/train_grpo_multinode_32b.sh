#!/usr/bin/env bash
# Search-R1 GRPO with Qwen/Qwen2.5-32B-Instruct on a multi-node Ray cluster (4 nodes x 8 GPUs by default), in the
# style of the original Search-R1 launchers: train_grpo.sh with the settings a model this size needs
# (FSDP offload, gradient checkpointing, vLLM tensor parallel 4), joining the running cluster.
#
#   On the head of a running cluster (example/multinode/start_head.sh / start_worker.sh):
#     bash example/multinode/train_grpo_multinode_32b.sh [hydra overrides...]
#   Under Slurm (starts the cluster and the retrieval server, then runs this):
#     TRAIN_SCRIPT=example/multinode/train_grpo_multinode_32b.sh sbatch --nodes=4 scripts/slurm/train_grpo.sbatch
#
# Environment: BASE_MODEL (default Qwen/Qwen2.5-32B-Instruct), NNODES (default 4, or SLURM_NNODES), GPUS_PER_NODE (8),
# TP_SIZE (vLLM tensor parallel, default 4), RAY_ADDRESS (default auto), DATA_DIR
# (default data/nq_hotpotqa_train), RETRIEVER_URL, EXPERIMENT_NAME, WAND_PROJECT, and batch sizes
# TRAIN_BATCH_SIZE (512 prompts), PPO_MINI_BATCH_SIZE (256 rollouts), PPO_MICRO_BATCH_SIZE (32),
# LOG_PROB_MICRO_BATCH_SIZE (128). These are starting points for 80 GB GPUs, not measured here
# (docs/multinode.md says what was run). Extra arguments are Hydra overrides and win.
set -euo pipefail

export BASE_MODEL=${BASE_MODEL:-Qwen/Qwen2.5-32B-Instruct}
export NNODES=${NNODES:-${SLURM_NNODES:-4}}
export TP_SIZE=${TP_SIZE:-4}
export PPO_MICRO_BATCH_SIZE=${PPO_MICRO_BATCH_SIZE:-32}
exec bash "$(dirname "$0")/_launch.sh" grpo "$@"
