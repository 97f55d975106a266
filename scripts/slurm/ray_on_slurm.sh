#!/usr/bin/env bash
# Start a Ray cluster over the nodes of the current Slurm allocation, then run a command
# on the head node with RAY_ADDRESS set so the Search-R1 driver joins it
# (trainer.ray_address=auto). Used by the *.sbatch files in this folder.
#
#   bash scripts/slurm/ray_on_slurm.sh bash train_grpo.sh trainer.nnodes=$SLURM_NNODES ...
set -euo pipefail
: "${SLURM_JOB_NODELIST:?run inside a Slurm allocation (sbatch/salloc)}"
port=${RAY_PORT:-6379}
gpus=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
head=${nodes[0]}
head_ip=$(srun --nodes=1 --ntasks=1 -w "$head" hostname --ip-address | awk '{print $1}')

srun --nodes=1 --ntasks=1 -w "$head" ray start --head --node-ip-address="$head_ip" \
  --port="$port" --num-gpus="$gpus" --block &
sleep "${RAY_HEAD_WAIT:-20}"
for node in "${nodes[@]:1}"; do
  srun --nodes=1 --ntasks=1 -w "$node" ray start --address="$head_ip:$port" --num-gpus="$gpus" --block &
done
sleep "${RAY_WORKER_WAIT:-20}"

export RAY_ADDRESS="$head_ip:$port"
echo "[ray_on_slurm] cluster at $RAY_ADDRESS with ${#nodes[@]} node(s) x $gpus GPU(s)"
"$@"
