#!/usr/bin/env bash
# Every GPU check in one command, each bounded, one JSON summary at the end (scripts/gpu_checks/run_all.py).
#   bash scripts/gpu_checks/run_all.sh [--only a,b] [--out DIR] [--max-total-s S]   # on a GPU machine
#   bash scripts/gpu_checks/run_all.sh --list | --dry-run | --cpu                      # anywhere
# On a lent GPU machine with no network: bash .gpu-carry/enter.sh bash scripts/gpu_checks/run_all.sh
# (docs/testing.md "GPU checks"). PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m scripts.gpu_checks.run_all "$@"
