#!/usr/bin/env bash
# Evaluate a checkpoint: greedy validation only (+trainer.val_only=true); EM, token F1 and (with a
# judge) judge accuracy per data source -> JSON (scripts/nq_hotpotqa/eval_report.py). With --n K, K
# sampled responses per question (rollout.val_kwargs) and ASearcher's avg@K and pass@K per source too.
#
#   BASE_MODEL=verl_checkpoints/my-run/global_step_1000/hf DATA_DIR=data/nq_hotpotqa_train \
#       bash scripts/nq_hotpotqa/evaluate.sh [--n K] [extra Hydra overrides...]
#
# Environment (all optional except BASE_MODEL):
#   BASE_MODEL      HF folder or hub id of the model to evaluate, or a LoRA adapter folder (adapter_config.json:
#                   its base_model_name_or_path is loaded with the adapter, actor_rollout_ref.model.lora_adapter_path)
#   DATA_DIR        folder holding test.parquet (default data/nq_search)
#   OUTPUT_JSON     where to write {"val/test_score/<source>": em, "val/test_f1/<source>": f1, ...,
#                   "overall": em, "overall_f1": f1[, "val/test_judge/<source>", "overall_judge"]}
#                   (default eval_results.json)
#   JUDGE_URL       an OpenAI-compatible server (e.g. http://127.0.0.1:8001/v1) to also report judge
#                   accuracy (reward_model.judge.*); JUDGE_MODEL names its model (required with it)
#   RETRIEVER_URL   a running retrieval server (default http://127.0.0.1:8000/retrieve)
#   N_GPUS          GPUs (or CPU workers) per node (default: all visible GPUs, else 1)
#   ROLLOUT_NAME    rollout engine: auto (default: vllm with a GPU and vllm, else hf) | hf | vllm
#   VAL_TEMPERATURE, VAL_TOP_P   the sampling of --n K > 1 (default 0.6, ASearcher's evaluation temperature, and 1.0)
# Any extra argument is passed to the trainer as a Hydra override (later ones win).
set -euo pipefail
# the repository's .venv when no virtual environment is active; a clear stop when the packages are missing
source "$(dirname "$0")/../use_venv.sh" && require_python_modules torch transformers ray hydra pandas

if [ -z "${BASE_MODEL:-}" ]; then
    echo "evaluate.sh: set BASE_MODEL to the checkpoint to evaluate (an HF folder or hub id)" >&2
    exit 2
fi
DATA_DIR=${DATA_DIR:-data/nq_search}
OUTPUT_JSON=${OUTPUT_JSON:-eval_results.json}
RETRIEVER_URL=${RETRIEVER_URL:-http://127.0.0.1:8000/retrieve}
if [ -z "${N_GPUS:-}" ]; then
    N_GPUS=$(python3 -c "import torch; print(max(torch.cuda.device_count(), 1))")
fi
ROLLOUT=${ROLLOUT_NAME:-auto}
if python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    DEVICE=cuda
else
    DEVICE=cpu
fi

# --n K: K sampled responses per question; every other argument is a Hydra override
N_SAMPLES=1
ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --n) N_SAMPLES=${2:-}; shift $(( $# > 1 ? 2 : 1 )) ;;
        --n=*) N_SAMPLES=${1#--n=}; shift ;;
        *) ARGS+=("$1"); shift ;;
    esac
done
if ! [[ "$N_SAMPLES" =~ ^[1-9][0-9]*$ ]]; then
    echo "evaluate.sh: --n takes the number of responses sampled per question (1 or more), got '${N_SAMPLES}'" >&2
    exit 2
fi
SAMPLE_OVERRIDES=""
if [ "$N_SAMPLES" -gt 1 ]; then
    SAMPLE_OVERRIDES="actor_rollout_ref.rollout.val_kwargs.n=${N_SAMPLES} actor_rollout_ref.rollout.val_kwargs.do_sample=true"
    SAMPLE_OVERRIDES+=" actor_rollout_ref.rollout.val_kwargs.temperature=${VAL_TEMPERATURE:-0.6}"
    SAMPLE_OVERRIDES+=" actor_rollout_ref.rollout.val_kwargs.top_p=${VAL_TOP_P:-1.0}"
fi

JUDGE_OVERRIDES=""
if [ -n "${JUDGE_URL:-}" ]; then
    if [ -z "${JUDGE_MODEL:-}" ]; then
        echo "evaluate.sh: JUDGE_URL is set; set JUDGE_MODEL to the model it serves" >&2
        exit 2
    fi
    JUDGE_OVERRIDES="reward_model.judge.url=${JUDGE_URL} reward_model.judge.model=${JUDGE_MODEL}"
fi

export OUTPUT_JSON
# shellcheck disable=SC2086  # JUDGE_OVERRIDES, SAMPLE_OVERRIDES: zero or more words
python3 - $JUDGE_OVERRIDES $SAMPLE_OVERRIDES ${ARGS[@]+"${ARGS[@]}"} <<PY
import json, os, sys
from verl.trainer.main_ppo import compose_config, run_ppo

overrides = [
    "data.train_files=${DATA_DIR}/test.parquet",   # not trained on; the dataloader needs a file
    "data.val_files=${DATA_DIR}/test.parquet",
    "data.train_batch_size=${N_GPUS}",
    "data.val_batch_size=512",
    "data.max_prompt_length=4096", "data.max_response_length=500",
    "data.max_start_length=2048", "data.max_obs_length=500",
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.model.path=${BASE_MODEL}",
    "actor_rollout_ref.rollout.name=${ROLLOUT}",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=${N_GPUS}",
    "actor_rollout_ref.actor.ppo_micro_batch_size=${N_GPUS}",
    "trainer.device=${DEVICE}",
    "trainer.n_gpus_per_node=${N_GPUS}",
    "trainer.logger=[console]",
    "trainer.resume_mode=disable",
    "trainer.save_freq=-1",
    "trainer.experiment_name=eval",
    "max_turns=4",
    "retriever.url=${RETRIEVER_URL}",
    "retriever.topk=3",
    "+trainer.val_only=true",
]
# A LoRA adapter folder (a LoRA run's global_step_N/hf): its base model, with the adapter loaded on it.
adapter_config = os.path.join("${BASE_MODEL}", "adapter_config.json")
if os.path.isfile(adapter_config):
    with open(adapter_config) as f:
        adapter = json.load(f)
    overrides = [o for o in overrides if not o.startswith("actor_rollout_ref.model.path=")] + [
        f"actor_rollout_ref.model.path={adapter['base_model_name_or_path']}",
        f"actor_rollout_ref.model.lora_rank={int(adapter['r'])}",
        "actor_rollout_ref.model.lora_adapter_path=${BASE_MODEL}"]
extra = sys.argv[1:]
extra_keys = {a.lstrip("+").partition("=")[0] for a in extra}
overrides = [o for o in overrides if o.lstrip("+").partition("=")[0] not in extra_keys] + extra
history = run_ppo(compose_config(overrides))
import pandas as pd
from scripts.nq_hotpotqa.eval_report import summarize
counts = pd.read_parquet("${DATA_DIR}/test.parquet")["data_source"].value_counts().to_dict()
try:
    val = summarize(history, counts)
except ValueError as exc:
    sys.exit(f"evaluate.sh: {exc}")
with open(os.environ["OUTPUT_JSON"], "w") as f:
    json.dump(val, f, indent=2)
print(json.dumps(val, indent=2))
print(f"wrote {os.environ['OUTPUT_JSON']}")
PY
