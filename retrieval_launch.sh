#!/usr/bin/env bash
# Launch the Search-R1 retrieval server (POST /retrieve, GET /health).
#
# Same variables as the original Search-R1 script; set them in the environment or edit
# them here. Extra arguments are passed through to the server and override these
# defaults (e.g. `bash retrieval_launch.sh --port 8001 --topk 5`).
#
# With no prebuilt index at $index_file (the default on a fresh checkout), this builds a
# BM25 index of example/corpus.jsonl into a cache folder once and serves it offline on
# 127.0.0.1:8000 -- no download, no GPU:
#
#   bash retrieval_launch.sh
#   curl -s -X POST localhost:8000/retrieve -H 'Content-Type: application/json' \
#        -d '{"queries": ["photosynthesis"], "topk": 3, "return_scores": true}'
#
# The original e5 + FAISS setup (wiki-18): download the index and corpus, then
#   file_path=/data/wiki bash retrieval_launch.sh
set -euo pipefail
cd "$(dirname "$0")"

file_path=${file_path:-/the/path/you/save/corpus}
index_file=${index_file:-$file_path/e5_Flat.index}
corpus_file=${corpus_file:-$file_path/wiki-18.jsonl}
retriever_name=${retriever_name:-e5}
retriever_path=${retriever_path:-intfloat/e5-base-v2}
cache_dir=${SEARCH_R1_CACHE:-$HOME/.cache/search_r1}
export SEARCH_R1_CACHE=$cache_dir

if [ ! -e "$index_file" ]; then
    echo "retrieval_launch.sh: no index at $index_file; serving a BM25 index of example/corpus.jsonl" >&2
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
    file_path=$cache_dir/example_index
    corpus_file=example/corpus.jsonl
    index_file=$file_path/bm25
    retriever_name=bm25
    retriever_path=none
    if [ ! -f "$index_file/search_r1_bm25.json" ] || [ "$corpus_file" -nt "$index_file/search_r1_bm25.json" ]; then
        python -m search_r1.search.index_builder --retrieval_method bm25 \
            --corpus_path "$corpus_file" --save_dir "$file_path"
    fi
fi

# The original always passed --faiss_gpu; only do so when a GPU build of FAISS sees a GPU.
faiss_gpu_flag=()
if [ "$retriever_name" != "bm25" ] && python -c "import faiss, sys; sys.exit(0 if getattr(faiss, 'get_num_gpus', lambda: 0)() > 0 else 1)" 2>/dev/null; then
    faiss_gpu_flag=(--faiss_gpu)
fi

exec python -m search_r1.search.retrieval_server --index_path "$index_file" \
                                                 --corpus_path "$corpus_file" \
                                                 --topk 3 \
                                                 --retriever_name "$retriever_name" \
                                                 --retriever_model "$retriever_path" \
                                                 ${faiss_gpu_flag[@]+"${faiss_gpu_flag[@]}"} \
                                                 "$@"
