#!/usr/bin/env bash
# BM25 retrieval server (bm25s; no Java needed). Same variables as the original script.
#
# If $index_file does not exist yet it is built from $corpus_file first (wiki-18: about
# an hour and ~30 GiB RAM on one node). A pyserini/Lucene index folder also works when
# pyserini is installed. Extra arguments go to the server:
#
#   file_path=/data/wiki bash example/retriever/retrieval_launch_bm25.sh --port 8001
#
# With no $file_path set, the example corpus is indexed into a cache folder and served.
set -euo pipefail
cd "$(dirname "$0")/../.."

cache_dir=${SEARCH_R1_CACHE:-$HOME/.cache/search_r1}
export SEARCH_R1_CACHE=$cache_dir
if [ -z "${file_path:-}" ]; then
    file_path=$cache_dir/example_index
    corpus_file=${corpus_file:-example/corpus.jsonl}
fi
index_file=${index_file:-$file_path/bm25}
corpus_file=${corpus_file:-$file_path/wiki-18.jsonl}
retriever_name=bm25

if [ ! -e "$index_file" ] || { [ -f "$index_file/search_r1_bm25.json" ] && [ "$corpus_file" -nt "$index_file/search_r1_bm25.json" ]; }; then
    python -m search_r1.search.index_builder --retrieval_method bm25 \
        --corpus_path "$corpus_file" --save_dir "$(dirname "$index_file")"
fi

exec python -m search_r1.search.retrieval_server --index_path "$index_file" \
                                                 --corpus_path "$corpus_file" \
                                                 --topk 3 \
                                                 --retriever_name "$retriever_name" \
                                                 "$@"
