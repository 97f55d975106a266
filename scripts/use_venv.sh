# Sourced by the launchers (train_grpo.sh, train_ppo.sh, retrieval_launch.sh,
# scripts/nq_hotpotqa/evaluate.sh, example/tool_recipe/): afterwards `python3` and `python` are a
# Python that has Search-R1's packages.
#
#   source scripts/use_venv.sh && require_python_modules pandas torch
#
# With no virtual environment active, the repository's .venv (what `bash scripts/setup_env.sh` makes)
# goes first on PATH, so a new shell needs no `source .venv/bin/activate`. An active one
# ($VIRTUAL_ENV) is used as it is. require_python_modules stops the launcher (exit 1) with the command
# that fixes it when that Python lacks a module, instead of a ModuleNotFoundError from deep inside an
# import; it only looks the modules up (importlib.util.find_spec), it imports none.

_search_r1_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -z "${VIRTUAL_ENV:-}" ] && [ -x "$_search_r1_root/.venv/bin/python" ]; then
    export PATH="$_search_r1_root/.venv/bin:$PATH"
fi

# require_python_modules MODULE...: exit 1 naming the Python, the missing modules and the fix.
require_python_modules() {
    local py missing
    py=$(command -v python3 || true)
    if [ -z "$py" ]; then
        missing="$*"
    else
        missing=$("$py" - "$@" <<'PYEOF'
import importlib.util
import sys

print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))
PYEOF
        ) || missing="$*"
    fi
    [ -z "$missing" ] && return 0
    local launcher=${0##*/}
    if [ -n "${VIRTUAL_ENV:-}" ]; then
        {
            echo "$launcher: the active virtual environment ($VIRTUAL_ENV) lacks Search-R1's packages: missing $missing."
            echo "Either run \`deactivate\` and then:  bash $_search_r1_root/scripts/setup_env.sh"
            echo "(then run $launcher again: it uses $_search_r1_root/.venv by itself), or install into it:"
            echo "  pip install -e \"$_search_r1_root[retriever]\" -c $_search_r1_root/requirements-lock.txt"
        } >&2
    else
        local where="$_search_r1_root/.venv"
        [ -x "$where/bin/python" ] || where="${py:-python3 (not on PATH)}: no virtual environment is active and $where does not exist"
        {
            echo "$launcher: Search-R1's packages are not installed ($where): missing $missing."
            echo "Install them once with:  bash $_search_r1_root/scripts/setup_env.sh"
            echo "then run $launcher again: it uses $_search_r1_root/.venv/bin/python by itself."
        } >&2
    fi
    exit 1
}
