#!/usr/bin/env bash
# GRPO with LoRA (rank 64, alpha 32, all linear layers) on Qwen3-32B on ONE node of 8 x 80 GB GPUs: the
# Qwen2.5-32B LoRA launcher's settings (example/lora/train_grpo_lora_32b.sh: the frozen base sharded in
# bf16, the adapter and its AdamW state the only trained weights, the reference the actor with the adapter
# off, vLLM tensor parallel 8 on the merged weights) with Qwen3's model. Qwen3-32B's attention is wider
# than its hidden size (64 heads x 128 = 8192 > 5120), which the plan counts. `+trainer.preflight=true`
# prints the per-phase memory plan.
#
#   BASE_MODEL=Qwen/Qwen3-32B bash example/qwen3/train_grpo_qwen3_32b_lora.sh [extra hydra overrides...]
#
# Environment: that of example/lora/train_grpo_lora_32b.sh. Starting points planned by preflight, not
# measured on GPUs here. Extra arguments are Hydra overrides and win.
set -euo pipefail

export BASE_MODEL=${BASE_MODEL:-Qwen/Qwen3-32B}
exec bash "$(dirname "$0")/../lora/train_grpo_lora_32b.sh" "$@"
