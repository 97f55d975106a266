#!/usr/bin/env bash
# BM25 retrieval server (bm25s; no Java needed). Same variables as the original script.
#
# If $index_file does not exist yet it is built from $corpus_file first (wiki-18: about
# an hour and ~30 GiB RAM on one node). A pyserini/Lucene index folder also works when
# pyserini is installed. Extra arguments go to the server:
#
#   file_path=/data/wiki bash example/retriever/retrieval_launch_bm25.sh --port 8001
#
# With none of the retriever variables set (file_path, index_file, corpus_file,
# retriever_name, retriever_path), the example corpus is indexed into a cache folder and
# served. Once one is set, a missing corpus stops the launch (exit 2, naming it; see
# example/retriever/_common.sh). SEARCH_R1_DRY_RUN=1 prints the commands instead of running them.
set -euo pipefail
cd "$(dirname "$0")/../.."
source example/retriever/_common.sh

cache_dir=${SEARCH_R1_CACHE:-$HOME/.cache/search_r1}
export SEARCH_R1_CACHE=$cache_dir
if ! retriever_vars_set; then
    use_example_corpus retrieval_launch_bm25.sh
    file_path=$cache_dir/example_index
    corpus_file=example/corpus.jsonl
fi
file_path=${file_path:-/the/path/you/save/corpus}
index_file=${index_file:-$file_path/bm25}
corpus_file=${corpus_file:-$file_path/wiki-18.jsonl}
retriever_name=bm25
require_paths retrieval_launch_bm25.sh "$corpus_file"

if [ ! -e "$index_file" ] || { [ -f "$index_file/search_r1_bm25.json" ] && [ "$corpus_file" -nt "$index_file/search_r1_bm25.json" ]; }; then
    # index_builder writes {save_dir}/bm25; any other name could not be served afterwards.
    if [ "$(basename "$index_file")" != bm25 ]; then
        echo "retrieval_launch_bm25.sh: no BM25 index at $index_file; to build one from $corpus_file" \
             "name it .../bm25 (index_file=$(dirname "$index_file")/bm25)" >&2
        exit 2
    fi
    run python -m search_r1.search.index_builder --retrieval_method bm25 \
        --corpus_path "$corpus_file" --save_dir "$(dirname "$index_file")"
fi

exec_server python -m search_r1.search.retrieval_server --index_path "$index_file" \
                                                        --corpus_path "$corpus_file" \
                                                        --topk 3 \
                                                        --retriever_name "$retriever_name" \
                                                        "$@"
