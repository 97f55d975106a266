#!/usr/bin/env bash
# Join this node to a Ray head: bash example/multinode/start_worker.sh HEAD_IP [port]
# Same environment as start_head.sh (GPUS_PER_NODE, RAY_AUTH_MODE).
set -euo pipefail
: "${1:?usage: start_worker.sh HEAD_IP [port]}"
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
gpu_args=()
[ -n "${GPUS_PER_NODE:-}" ] && gpu_args=(--num-gpus="$GPUS_PER_NODE")
ray start --address="$1:${2:-6379}" --disable-usage-stats "${gpu_args[@]}"
