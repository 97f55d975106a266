#!/usr/bin/env bash
# Start the Ray head on this node: bash example/multinode/start_head.sh [port]
set -euo pipefail
ray start --head --port="${1:-6379}" --num-gpus="${GPUS_PER_NODE:-8}"
