# Shell functions shared by the retrieval launchers (retrieval_launch.sh,
# example/retriever/retrieval_launch_bm25.sh, retrieval_launch_ann.sh). Sourced, not run.
#
# The rule they share: the example corpus is served only when none of the original
# launcher's retriever variables (file_path, index_file, corpus_file, retriever_name,
# retriever_path) is set. Once one is set, a missing index or corpus stops the launch
# (exit 2, naming the path) instead of quietly serving a toy corpus that answers /health.

# True when the user set any retriever variable (empty counts as unset).
retriever_vars_set() {
    [ -n "${file_path:-}${index_file:-}${corpus_file:-}${retriever_name:-}${retriever_path:-}" ]
}

# Announce the example corpus, or refuse it inside a Slurm job: there no variable usually
# means they were not exported before sbatch, not that a toy corpus is wanted.
use_example_corpus() {  # $1: launcher name
    if [ -n "${SLURM_JOB_ID:-}" ] && [ "${SEARCH_R1_EXAMPLE_RETRIEVER:-0}" != 1 ]; then
        echo "$1: none of file_path, index_file, corpus_file, retriever_name, retriever_path reached" \
             "Slurm job $SLURM_JOB_ID (sbatch passes only exported variables: export file_path=...);" \
             "set SEARCH_R1_EXAMPLE_RETRIEVER=1 to serve the example corpus" >&2
        exit 2
    fi
    echo "$1: no retriever variable set (file_path, index_file, corpus_file, retriever_name," \
         "retriever_path); serving the example corpus" >&2
}

# Exit 2 naming the first of the paths that does not exist.
require_paths() {  # $1: launcher name, then paths
    local name=$1 path
    shift
    for path in "$@"; do
        if [ ! -e "$path" ]; then
            echo "$name: $path does not exist (file_path=${file_path:-}, index_file=${index_file:-}," \
                 "corpus_file=${corpus_file:-}); fetch or build it (python scripts/download.py --save_path DIR" \
                 "for wiki-18 and e5_Flat.index; python -m search_r1.search.index_builder for other indexes)" \
                 "or fix the variable. Unset every retriever variable to serve the example corpus." >&2
            exit 2
        fi
    done
}

# Run a command, or only print it when SEARCH_R1_DRY_RUN=1.
run() {
    if [ "${SEARCH_R1_DRY_RUN:-0}" = 1 ]; then
        printf '%q ' "$@"
        echo
    else
        "$@"
    fi
}

# Replace this shell with the server, or print its command line when SEARCH_R1_DRY_RUN=1.
exec_server() {
    if [ "${SEARCH_R1_DRY_RUN:-0}" = 1 ]; then
        run "$@"
        exit 0
    fi
    exec "$@"
}
