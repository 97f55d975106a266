#!/usr/bin/env bash
# Start the Ray head on this node: bash example/multinode/start_head.sh [port]
# GPUS_PER_NODE sets --num-gpus (default: Ray detects them). RAY_AUTH_MODE defaults to "disabled":
# with token auth, every node and the driver need RAY_AUTH_MODE=token and the same ~/.ray/auth_token.
set -euo pipefail
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
gpu_args=()
[ -n "${GPUS_PER_NODE:-}" ] && gpu_args=(--num-gpus="$GPUS_PER_NODE")
ray start --head --port="${1:-6379}" --disable-usage-stats "${gpu_args[@]}"
