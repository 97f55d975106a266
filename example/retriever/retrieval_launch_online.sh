#!/usr/bin/env bash
# Web search behind the /retrieve API, so training can use a live search engine:
#
#   export SERP_API_KEY=...                          # search_engine=serpapi (default)
#   export GOOGLE_API_KEY=... GOOGLE_CSE_ID=...      # search_engine=google
#   export BRAVE_API_KEY=...                         # search_engine=brave
#   search_engine=serpapi bash example/retriever/retrieval_launch_online.sh --port 8000
#
# Keys are read from the environment only (never a flag: flags show up in `ps` and in
# shell history) and are never logged. Extra arguments go to
# search_r1.search.online_search_server (e.g. --topk 5 --concurrency 16, or
# --search_url to point at a proxy).
set -euo pipefail
cd "$(dirname "$0")/../.."

search_engine=${search_engine:-serpapi}
case "$search_engine" in
    serpapi) required=(SERP_API_KEY) ;;
    google)  required=(GOOGLE_API_KEY GOOGLE_CSE_ID) ;;
    brave)   required=(BRAVE_API_KEY) ;;
    *) echo "search_engine must be serpapi, google or brave (got '$search_engine')" >&2; exit 2 ;;
esac
for name in "${required[@]}"; do
    if [ -z "${!name:-}" ]; then
        echo "environment variable $name is not set; export it before launching ($search_engine)" >&2
        exit 2
    fi
done

exec python -m search_r1.search.online_search_server --search_engine "$search_engine" \
                                                     --topk 3 \
                                                     "$@"
