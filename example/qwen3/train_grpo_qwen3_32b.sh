#!/usr/bin/env bash
# Full-parameter GRPO with search on Qwen3-32B over a multi-node Ray cluster (4 nodes x 8 x 80 GB GPUs by
# default): the Qwen2.5-32B multi-node launcher's settings (example/multinode/_launch.sh: FSDP offload,
# gradient checkpointing, vLLM tensor parallel 4) with Qwen3's model, joining a running cluster.
# `+trainer.preflight=true` prints the per-phase memory plan and, with RAY_ADDRESS unset, runs nowhere.
#
#   bash example/qwen3/train_grpo_qwen3_32b.sh [hydra overrides...]            # on the head of a cluster
#   TRAIN_SCRIPT=example/qwen3/train_grpo_qwen3_32b.sh sbatch --nodes=4 scripts/slurm/train_grpo.sbatch
#
# Environment: that of example/multinode/_launch.sh (BASE_MODEL defaults to Qwen/Qwen3-32B). Starting
# points planned by preflight, not measured on GPUs here. Extra arguments are Hydra overrides and win.
set -euo pipefail

export BASE_MODEL=${BASE_MODEL:-Qwen/Qwen3-32B}
export NNODES=${NNODES:-${SLURM_NNODES:-4}}
export TP_SIZE=${TP_SIZE:-4}
export PPO_MICRO_BATCH_SIZE=${PPO_MICRO_BATCH_SIZE:-32}
exec bash "$(dirname "$0")/../multinode/_launch.sh" grpo "$@"
