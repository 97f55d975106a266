#!/usr/bin/env bash
# Inside a Slurm allocation: start a Ray cluster over its nodes and a retrieval server, run a
# command on the first node with RAY_ADDRESS and RETRIEVER_URL exported, then stop everything
# it started -- on success, on failure, and when Slurm ends the job (time limit, scancel: SIGTERM).
# Used by the *.sbatch files in this folder:
#
#   bash scripts/slurm/ray_on_slurm.sh bash train_grpo.sh trainer.ray_address=auto trainer.nnodes=$SLURM_NNODES ...
#
# 0. preflight: runs the command once with `+trainer.preflight=true` appended (same launcher, same
#    overrides: the trainer composes and checks the config, imports included, and exits in
#    seconds with no Ray, worker or weights); a config that would not start fails the job here,
#    before any Ray node or retrieval server is started;
# 1. the Ray head on the first node (`srun -w <head> ray start --head --block`), then `ray start
#    --address=<head>:<port> --block` on every other node (srun, one task per node); a head that
#    exits with Ray's "timed out during startup" (its raylet missed Ray's fixed 30 s on a busy node)
#    is started once more;
# 2. waits until all $SLURM_NNODES nodes have joined (at most RAY_JOIN_TIMEOUT_S), else fails
#    naming the nodes that did not;
# 3. unless RETRIEVER_URL is set (a server you run yourself), runs retrieval_launch.sh on
#    RETRIEVER_NODE (default: the head) listening on 0.0.0.0:RETRIEVER_PORT and waits until its
#    /health answers (at most RETRIEVER_WAIT_S); its variables (file_path, index_file,
#    corpus_file, retriever_name, ...) pass through the environment;
# 4. runs the command; its exit status is the job's.
#
# Environment (all optional):
#   PREFLIGHT          1 (default): step 0; 0 skips it (for a COMMAND that is not a main_ppo launcher)
#   SEARCH_R1_VENV     virtualenv whose bin/ goes first on PATH (default: ./.venv when present)
#   RAY_PORT           GCS port (default 6379 + SLURM_JOB_ID % 1000, so jobs sharing a node differ);
#                      the Ray client server takes RAY_PORT+1
#   RAY_TMP_DIR        Ray's --temp-dir on every node (default /tmp/ray_$SLURM_JOB_ID)
#   GPUS_PER_NODE      --num-gpus for `ray start` (default: Ray detects the node's GPUs)
#   RAY_CPUS_PER_NODE  --num-cpus for `ray start` (default: Ray detects)
#   RAY_JOIN_TIMEOUT_S (default 300)   RETRIEVER_WAIT_S (default 900: a wiki-18 index loads for minutes)
#   RETRIEVER_URL | RETRIEVER_NODE, RETRIEVER_PORT (default 8000)
#   RETRIEVER_SERVE    ray: no step 3; the trainer runs the retrieval server as a Ray Serve application
#                      on the cluster, one replica per node (retriever.serve=ray, docs/multinode.md),
#                      over index_file / corpus_file (or file_path), retriever_name, retriever_path:
#                      this script appends those overrides to the command
#   RETRIEVER_CPUS     serve=ray: CPUs of each replica (default 32 for a dense retriever: a wiki-18 e5 Flat
#                      index needs >= 23 to answer a 512-query turn within retriever.timeout, and the config
#                      check says so if too few; 1 for retriever_name=bm25)
#   RAY_AUTH_MODE      exported as is; default "disabled" (token auth needs the same token file
#                      on every node: set RAY_AUTH_MODE=token with a shared ~/.ray/auth_token)
set -euo pipefail

log() { echo "[ray_on_slurm] $(date +%H:%M:%S) $*"; }
die() { log "ERROR: $*" >&2; exit 1; }

[ "$#" -gt 0 ] || die "usage: ray_on_slurm.sh COMMAND [ARGS...]"
: "${SLURM_JOB_NODELIST:?run inside a Slurm allocation (sbatch/salloc)}"
: "${SLURM_JOB_ID:?run inside a Slurm allocation (sbatch/salloc)}"

if [ -n "${SEARCH_R1_VENV:-}" ]; then
    export PATH="$SEARCH_R1_VENV/bin:$PATH"
elif [ -x .venv/bin/python ]; then
    export PATH="$PWD/.venv/bin:$PATH"
fi
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
export RAY_USAGE_STATS_ENABLED=${RAY_USAGE_STATS_ENABLED:-0}
port=${RAY_PORT:-$((6379 + SLURM_JOB_ID % 1000))}
ray_tmp=${RAY_TMP_DIR:-/tmp/ray_$SLURM_JOB_ID}
join_timeout=${RAY_JOIN_TIMEOUT_S:-300}
retriever_wait=${RETRIEVER_WAIT_S:-900}

mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
[ "${#nodes[@]}" -ge 1 ] || die "no nodes in SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST"
head=${nodes[0]}
workers=("${nodes[@]:1}")

# Every background step this script starts: stopped (SIGTERM, which srun passes to its task)
# in reverse order on exit. `ray start --block` stops its node's raylet, GCS and workers on SIGTERM.
step_pids=()
step_names=()
train_pid=""
retriever_health=""

on_node() {  # on_node NODE CMD...: one task on NODE; steps share the allocation's CPUs
    local node=$1
    shift
    srun --overlap --nodes=1 --ntasks=1 -w "$node" "$@"
}

start_step() {  # start_step NAME NODE CMD...: in the background; $! is srun itself (not a subshell)
    local name=$1 node=$2
    shift 2
    srun --overlap --nodes=1 --ntasks=1 -w "$node" "$@" &
    step_pids+=("$!")
    step_names+=("$name on $node")
}

cleanup() {
    local rc=$? i pid
    trap - EXIT INT TERM
    set +e
    log "shutting down (exit status $rc)"
    if [ -n "$train_pid" ] && kill -0 "$train_pid" 2>/dev/null; then
        kill -TERM "$train_pid" 2>/dev/null
    fi
    if [ -n "$retriever_health" ]; then
        log "retrieval server at the end: $(curl_health "$retriever_health")"
    fi
    for ((i = ${#step_pids[@]} - 1; i >= 0; i--)); do
        pid=${step_pids[$i]}
        if kill -0 "$pid" 2>/dev/null; then
            log "stopping ${step_names[$i]}"
            kill -TERM "$pid" 2>/dev/null
        fi
    done
    for ((i = ${#step_pids[@]} - 1; i >= 0; i--)); do
        pid=${step_pids[$i]}
        # 10 s each: a Ray node drains for up to 30 s on SIGTERM, and Slurm's KillWait (often 30 s)
        # bounds this whole trap after a time limit.
        for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        if kill -0 "$pid" 2>/dev/null; then
            log "${step_names[$i]} still running after 10s: SIGKILL"
            kill -KILL "$pid" 2>/dev/null
        fi
        wait "$pid" 2>/dev/null
    done
    # A head that died on its own (e.g. a port taken) leaves its worker processes behind until they
    # notice; on this node, end every process still running from this job's Ray temp dir.
    if pkill -TERM -f -- "$ray_tmp/session_" 2>/dev/null; then
        for _ in $(seq 20); do pgrep -f -- "$ray_tmp/session_" >/dev/null || break; sleep 0.5; done
        pkill -KILL -f -- "$ray_tmp/session_" 2>/dev/null
        log "stopped the job's leftover Ray processes on $(hostname)"
    fi
    rm -f "${head_out:-}"
    log "stopped"
    exit "$rc"
}
trap cleanup EXIT
trap 'log "caught SIGTERM (time limit or scancel)"; exit 143' TERM
trap 'log "caught SIGINT"; exit 130' INT

curl_health() {  # curl_health URL: the /health JSON, or an empty string
    python3 - "$1" <<'EOF' 2>/dev/null || true
import sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=5) as r:
    print(r.read().decode().strip())
EOF
}

node_ip() { on_node "$1" hostname --ip-address | awk '{print $1}'; }

# RETRIEVER_SERVE=ray: the command gets the retriever.serve overrides (defaults as retrieval_launch.sh's)
if [ "${RETRIEVER_SERVE:-}" = ray ]; then
    [ -z "${RETRIEVER_URL:-}" ] || die "RETRIEVER_SERVE=ray and RETRIEVER_URL both set: choose one retriever"
    serve_cpus=${RETRIEVER_CPUS:-32}
    [ "${retriever_name:-e5}" = bm25 ] && serve_cpus=${RETRIEVER_CPUS:-1}
    serve_index=${index_file:-${file_path:+$file_path/e5_Flat.index}}
    serve_corpus=${corpus_file:-${file_path:+$file_path/wiki-18.jsonl}}
    [ -n "$serve_index" ] && [ -n "$serve_corpus" ] || die "RETRIEVER_SERVE=ray needs index_file and corpus_file (or file_path) in the environment"
    set -- "$@" retriever.serve=ray "+retriever.server_args.index_path=$serve_index" \
        "+retriever.server_args.corpus_path=$serve_corpus" "+retriever.server_args.retriever_name=${retriever_name:-e5}" \
        "+retriever.server_args.retriever_model=${retriever_path:-intfloat/e5-base-v2}" \
        "retriever.replica_resources.num_cpus=$serve_cpus" "retriever.health_wait_s=$retriever_wait"
elif [ -n "${RETRIEVER_SERVE:-}" ]; then
    die "RETRIEVER_SERVE=${RETRIEVER_SERVE}: the only value is ray (unset it for the job's own retrieval server)"
fi

# --- 0. preflight: the command's own config check, before any node or server starts ----------
if [ "${PREFLIGHT:-1}" != 0 ]; then
    log "preflight: $* +trainer.preflight=true"
    # Unless RETRIEVER_URL is set, this job starts the retrieval server after preflight (step 3):
    # preflight then checks the index / corpus paths it will load instead of asking the server.
    preflight_retriever=job
    [ -n "${RETRIEVER_URL:-}" ] && preflight_retriever=url
    SEARCH_R1_PREFLIGHT_RETRIEVER=$preflight_retriever "$@" +trainer.preflight=true || die "preflight failed (exit status $?): the config above would not start; no Ray node or retrieval server was started"
    log "preflight passed"
fi

# --- 1. the Ray cluster ---------------------------------------------------------------------
head_ip=$(node_ip "$head")
[ -n "$head_ip" ] || die "no IP address for the head node $head"
export RAY_ADDRESS="$head_ip:$port"
node_args=(--block --temp-dir="$ray_tmp" --disable-usage-stats)
[ -n "${GPUS_PER_NODE:-}" ] && node_args+=(--num-gpus="$GPUS_PER_NODE")
[ -n "${RAY_CPUS_PER_NODE:-}" ] && node_args+=(--num-cpus="$RAY_CPUS_PER_NODE")
log "job $SLURM_JOB_ID: ${#nodes[@]} node(s): ${nodes[*]}; Ray head on $head ($RAY_ADDRESS)"
head_out=$(mktemp)
start_head() {  # the head's output goes to the job log and to $head_out (read if it exits)
    : >"$head_out"
    start_step "ray head" "$head" ray start --head --node-ip-address="$head_ip" --port="$port" \
        --ray-client-server-port="$((port + 1))" --include-dashboard=false "${node_args[@]}" \
        > >(tee -a "$head_out") 2>&1
}
start_head
head_starts=1

steps_alive() {  # dies naming the first background step (Ray node, server) that has exited
    local i
    for i in "${!step_pids[@]}"; do
        kill -0 "${step_pids[$i]}" 2>/dev/null || die "${step_names[$i]} exited; see its output above"
    done
}

ray_nodes_alive() {  # prints the IPs of the live Ray nodes, one a line (nothing while the GCS is down)
    # The probe is given up as soon as the head's step exits: a client of a GCS that went away
    # waits for it to come back, and the head's own error is what the log should end with.
    local out probe
    out=$(mktemp)
    timeout 60 python3 - "$RAY_ADDRESS" >"$out" 2>/dev/null <<'EOF' &
import sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
for node in ray.nodes():
    if node["Alive"]:
        print(node["NodeManagerAddress"])
EOF
    probe=$!
    while kill -0 "$probe" 2>/dev/null; do
        kill -0 "${step_pids[0]}" 2>/dev/null || kill "$probe" 2>/dev/null
        sleep 1
    done
    wait "$probe" 2>/dev/null || true
    cat "$out"
    rm -f "$out"
}

head_timed_out() {  # the head's step has exited with Ray's own startup timeout in its output
    kill -0 "${step_pids[0]}" 2>/dev/null && return 1
    wait "${step_pids[0]}" 2>/dev/null || true
    for _ in 1 2 3 4; do  # tee may still be writing the last lines
        grep -q "timed out during startup" "$head_out" && return 0
        sleep 0.5
    done
    return 1
}

deadline=$((SECONDS + join_timeout))
until [ -n "$(ray_nodes_alive)" ]; do
    # `ray start` waits a fixed 30 s for its raylet to register with the GCS; on a node busy enough to
    # miss that it exits ("timed out during startup"). Such a head is started once more, after its
    # processes are ended (they would hold the port). Any other exit (a port taken) fails the job at once.
    if [ "$head_starts" -eq 1 ] && head_timed_out; then
        log "the Ray head on $head timed out during startup (a busy node); starting it again"
        on_node "$head" pkill -KILL -f -- "$ray_tmp/[s]ession_" || true
        step_pids=()
        step_names=()
        start_head
        head_starts=2
        continue
    fi
    steps_alive
    [ "$SECONDS" -lt "$deadline" ] || die "the Ray head on $head did not come up within ${join_timeout}s"
    sleep 3
done
for node in "${workers[@]}"; do
    start_step "ray node" "$node" ray start --address="$RAY_ADDRESS" "${node_args[@]}"
done
while true; do
    mapfile -t joined < <(ray_nodes_alive)
    steps_alive
    [ "${#joined[@]}" -ge "${#nodes[@]}" ] && break
    if [ "$SECONDS" -ge "$deadline" ]; then
        missing=()
        for node in "${workers[@]}"; do
            ip=$(node_ip "$node")
            case " ${joined[*]} " in *" $ip "*) ;; *) missing+=("$node ($ip)") ;; esac
        done
        die "${#joined[@]} of ${#nodes[@]} Ray nodes joined within ${join_timeout}s; missing: ${missing[*]:-?}"
    fi
    sleep 3
done
log "Ray cluster up: ${#joined[@]} node(s) joined at $RAY_ADDRESS"

# --- 2. the retrieval server -------------------------------------------------------------------
if [ "${RETRIEVER_SERVE:-}" = ray ]; then
    log "retrieval: the trainer starts it on Ray Serve (retriever.serve=ray, index $serve_index)"
elif [ -n "${RETRIEVER_URL:-}" ]; then
    log "using the retrieval server at $RETRIEVER_URL (RETRIEVER_URL is set)"
else
    retriever_node=${RETRIEVER_NODE:-$head}
    retriever_port=${RETRIEVER_PORT:-8000}
    retriever_ip=$(node_ip "$retriever_node")
    start_step "retrieval server" "$retriever_node" bash retrieval_launch.sh --host 0.0.0.0 --port "$retriever_port"
    retriever_health="http://$retriever_ip:$retriever_port/health"
    deadline=$((SECONDS + retriever_wait))
    until health=$(curl_health "$retriever_health") && [ -n "$health" ]; do
        steps_alive
        [ "$SECONDS" -lt "$deadline" ] || die "no retrieval server at $retriever_health after ${retriever_wait}s"
        sleep 2
    done
    export RETRIEVER_URL="http://$retriever_ip:$retriever_port/retrieve"
    log "retrieval server up on $retriever_node at $RETRIEVER_URL: $health"
fi

# --- 3. the command (in the background, so that a SIGTERM runs the trap at once) ---------------
log "running: $*"
"$@" &
train_pid=$!
set +e
wait "$train_pid"
rc=$?
set -e
train_pid=""
log "command exited with status $rc"
exit "$rc"
