#!/usr/bin/env bash
# Launch the Search-R1 retrieval server (POST /retrieve, GET /health).
#
# Same variables as the original Search-R1 script; set them in the environment or edit
# them here. Extra arguments are passed through to the server and override these
# defaults (e.g. `bash retrieval_launch.sh --port 8001 --topk 5`).
#
# With none of the retriever variables set (file_path, index_file, corpus_file,
# retriever_name, retriever_path), this builds a BM25 index of example/corpus.jsonl into a
# cache folder once and serves it offline on 127.0.0.1:8000 -- no download, no GPU:
#
#   bash retrieval_launch.sh
#   curl -s -X POST localhost:8000/retrieve -H 'Content-Type: application/json' \
#        -d '{"queries": ["photosynthesis"], "topk": 3, "return_scores": true}'
#
# The original e5 + FAISS setup (wiki-18): download the index and corpus, then
#   file_path=/data/wiki bash retrieval_launch.sh
# Once any retriever variable is set, a missing index or corpus is an error (exit 2, naming
# the path): never a silent fall-back to the example corpus. Inside a Slurm job (sbatch passes
# only exported variables) the example corpus is served only with SEARCH_R1_EXAMPLE_RETRIEVER=1.
# (These rules live in example/retriever/_common.sh, shared with the example launchers.)
#
# Other variables:
#   faiss_device          auto (default) | gpu | cpu. Dense indexes are searched on GPU when
#                         FAISS has GPU support; on a GPU host with a CPU-only FAISS the launch
#                         fails unless faiss_device=cpu (search_r1/search/faiss_device.py)
#   retrieval_batch_size  queries per encoder call (512, the original's); the encoder runs in
#                         fp16 on a GPU (--no-use_fp16 to turn off), fp32 on CPU
#   SEARCH_R1_DRY_RUN=1   print the commands instead of running them
set -euo pipefail
cd "$(dirname "$0")"
# ./.venv's Python when no virtual environment is active; a clear stop when the packages are missing
source scripts/use_venv.sh && require_python_modules fastapi uvicorn bm25s faiss
source example/retriever/_common.sh

cache_dir=${SEARCH_R1_CACHE:-$HOME/.cache/search_r1}
export SEARCH_R1_CACHE=$cache_dir
retrieval_batch_size=${retrieval_batch_size:-512}

if ! retriever_vars_set; then
    use_example_corpus retrieval_launch.sh
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
    file_path=$cache_dir/example_index
    corpus_file=example/corpus.jsonl
    index_file=$file_path/bm25
    retriever_name=bm25
    retriever_path=none
    if [ ! -f "$index_file/search_r1_bm25.json" ] || [ "$corpus_file" -nt "$index_file/search_r1_bm25.json" ]; then
        run python -m search_r1.search.index_builder --retrieval_method bm25 \
            --corpus_path "$corpus_file" --save_dir "$file_path"
    fi
else
    file_path=${file_path:-/the/path/you/save/corpus}
    index_file=${index_file:-$file_path/e5_Flat.index}
    corpus_file=${corpus_file:-$file_path/wiki-18.jsonl}
    retriever_name=${retriever_name:-e5}
    retriever_path=${retriever_path:-intfloat/e5-base-v2}
    require_paths retrieval_launch.sh "$index_file" "$corpus_file"
fi

# The original always passed --faiss_gpu. The decision is search_r1/search/faiss_device.py's:
# --faiss_gpu when FAISS sees a GPU; exit 2 on a GPU host with a CPU-only FAISS unless faiss_device=cpu.
faiss_gpu_flag=()
if [ "$retriever_name" != "bm25" ]; then
    faiss_where=$(python -m search_r1.search.faiss_device) || exit 2
    if [ "$faiss_where" = gpu ]; then
        faiss_gpu_flag=(--faiss_gpu)
    fi
fi

# --use_fp16 and a batch of 512 as the original server ran e5 (fp16 applies on GPU only).
exec_server python -m search_r1.search.retrieval_server --index_path "$index_file" \
                                                        --corpus_path "$corpus_file" \
                                                        --topk 3 \
                                                        --retriever_name "$retriever_name" \
                                                        --retriever_model "$retriever_path" \
                                                        --use_fp16 \
                                                        --encode_batch_size "$retrieval_batch_size" \
                                                        ${faiss_gpu_flag[@]+"${faiss_gpu_flag[@]}"} \
                                                        "$@"
