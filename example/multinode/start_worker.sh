#!/usr/bin/env bash
# Join this node to a Ray head: bash example/multinode/start_worker.sh HEAD_IP [port]
set -euo pipefail
: "${1:?usage: start_worker.sh HEAD_IP [port]}"
ray start --address="$1:${2:-6379}" --num-gpus="${GPUS_PER_NODE:-8}"
