#!/usr/bin/env bash
# Shared body of the example/multinode launchers: `_launch.sh grpo|ppo [hydra overrides...]` runs
# train_grpo.sh / train_ppo.sh joined to a running Ray cluster, with the settings a 32B-72B model
# needs (FSDP offload, gradient checkpointing, vLLM tensor parallel). Each launcher sets its own
# defaults (BASE_MODEL, NNODES, TP_SIZE, PPO_MICRO_BATCH_SIZE) and execs this; any of them, and
# GPUS_PER_NODE, RAY_ADDRESS, DATA_DIR, RETRIEVER_URL, EXPERIMENT_NAME, WAND_PROJECT,
# TRAIN_BATCH_SIZE, PPO_MINI_BATCH_SIZE, LOG_PROB_MICRO_BATCH_SIZE, may come from the environment.
# Extra arguments are Hydra overrides and win.
set -euo pipefail
algo=$1
shift
case "$algo" in
    grpo|ppo) ;;
    *) echo "_launch.sh: first argument must be grpo or ppo, got '$algo'" >&2; exit 2 ;;
esac
for var in BASE_MODEL NNODES TP_SIZE PPO_MICRO_BATCH_SIZE; do
    [ -n "${!var:-}" ] || { echo "_launch.sh: $var is not set (run one of the train_*_multinode_*.sh launchers)" >&2; exit 2; }
done
cd "$(dirname "$0")/../.."

export BASE_MODEL DATA_DIR=${DATA_DIR:-data/nq_hotpotqa_train}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
export N_GPUS=$GPUS_PER_NODE
micro=${PPO_MICRO_BATCH_SIZE}
log_prob_micro=${LOG_PROB_MICRO_BATCH_SIZE:-128}
model_tag=$(basename "$BASE_MODEL" | tr '[:upper:]' '[:lower:]')
export EXPERIMENT_NAME=${EXPERIMENT_NAME:-nq_hotpotqa_train-search-r1-$algo-$model_tag-em-${NNODES}nodes}

critic=()
if [ "$algo" = ppo ]; then
    critic=(
        critic.model.path="$BASE_MODEL"
        critic.ppo_micro_batch_size="$micro"
        critic.model.enable_gradient_checkpointing=true
        critic.model.fsdp_config.param_offload=true
        critic.model.fsdp_config.grad_offload=true
        critic.model.fsdp_config.optimizer_offload=true
    )
fi

exec bash "train_$algo.sh" \
    trainer.ray_address="${RAY_ADDRESS:-auto}" \
    trainer.nnodes="$NNODES" \
    trainer.n_gpus_per_node="$GPUS_PER_NODE" \
    data.train_batch_size="${TRAIN_BATCH_SIZE:-512}" \
    data.val_batch_size=256 \
    actor_rollout_ref.actor.ppo_mini_batch_size="${PPO_MINI_BATCH_SIZE:-256}" \
    actor_rollout_ref.actor.ppo_micro_batch_size="$micro" \
    actor_rollout_ref.rollout.log_prob_micro_batch_size="$log_prob_micro" \
    actor_rollout_ref.ref.log_prob_micro_batch_size="$log_prob_micro" \
    actor_rollout_ref.model.enable_gradient_checkpointing=true \
    actor_rollout_ref.actor.fsdp_config.param_offload=true \
    actor_rollout_ref.actor.fsdp_config.grad_offload=true \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=true \
    actor_rollout_ref.ref.fsdp_config.param_offload=true \
    actor_rollout_ref.rollout.tensor_model_parallel_size="$TP_SIZE" \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.5 \
    "${critic[@]}" \
    "$@"
