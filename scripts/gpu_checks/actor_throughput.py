"""Actor update and log-prob throughput on one GPU, through the project's own worker code, with
model-FLOPs utilisation (MFU).

Builds the actor as scripts/gpu_checks/memory_plan_vs_allocated.py does (a Qwen2 from its config.json
alone, random weights; FSDP2 on one rank, bf16 compute, fp32 master weights, AdamW), warms up with one
log-prob pass and one update, then times `--repeats` log-prob passes and updates on a random
full-length batch and keeps the best of each. Prints ONE JSON object: per pass the seconds, tokens/s
and MFU, with the device, the parameter count and the peak allocated memory.

FLOPs (the usual model-FLOPs count; gradient checkpointing's recompute is not counted, so MFU is
what the model needs, not what the GPU did): per token 6N for an update (forward + backward) and
2N for a log-prob pass, plus attention 12 L h T (update) or 4 L h T (pass) with T the row length;
over every token of the batch (rows x (prompt + response)): `mfu`, the convention of the figures
below. `mfu_useful` counts the output head (V x h) only where the actor runs it, at the positions
that predict a response token, and the input embedding (a lookup) not at all (`pass_flops`). Peak: dense bf16 of the device
(`PEAK_BF16_TFLOPS`, by name: H100 / H200 SXM 989) or `--peak-tflops`; MFU is null for a device
not in the table and on CPU.

    python -m scripts.gpu_checks.actor_throughput                          # Qwen2.5-0.5B shape, 8 rows, micro 4, 1024 + 512
    python -m scripts.gpu_checks.actor_throughput --model-config example/model_configs/qwen2.5-3b/config.json \
        --rows 16 --micro 4 --prompt-length 2048 --response-length 512 \
        actor_rollout_ref.model.enable_gradient_checkpointing=true
    python -m scripts.gpu_checks.actor_throughput --device cpu --tiny --prompt-length 16 --response-length 8

From the repository root. Measured on an H200 on 2026-11-26 (../shared/gpu-measurements): 0.5B
update 36.5k tokens/s (MFU 0.12), log-prob 148k (0.17); 3B with checkpointing update 16.7k (0.35),
log-prob 69.6k (0.49). Trailing `key=value` arguments are trainer-config overrides.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from scripts.gpu_checks import memory_plan_vs_allocated as check
from verl.utils import batch_keys as K
from verl.workers.fsdp_workers import normalize_actor_batch_sizes

# Dense bf16 peak, TFLOP/s, by a substring of torch.cuda.get_device_name() (first match wins).
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("GH200", 989.0), ("B200", 2250.0),
                    ("A100", 312.0), ("L40S", 362.0), ("A10G", 70.0))
# (FLOPs per parameter per token, attention FLOPs per layer x hidden x row length per token)
PASS_FLOPS = {"log_prob": (2, 4), "update": (6, 12)}


def peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a device by its name; None when it is not in PEAK_BF16_TFLOPS."""
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in device_name:
            return tflops
    return None


def model_flops(kind: str, params: int, layers: int, hidden: int, rows: int, row_length: int) -> int:
    """Model FLOPs of one `kind` pass ("update" or "log_prob") over rows x row_length tokens (the
    convention of the 2026-11-26 figures: every parameter at every token)."""
    per_param, attention = PASS_FLOPS[kind]
    tokens = rows * row_length
    return per_param * params * tokens + attention * layers * hidden * row_length * tokens


def param_split(module: torch.nn.Module) -> tuple[int, int]:
    """(body, head) parameter counts of a causal LM: `head` the output projection (V x h), `body` every
    other parameter a token's forward multiplies by, i.e. without the input embedding (a lookup, no FLOPs;
    a tied embedding is the head's weight, counted once)."""
    head = module.get_output_embeddings().weight
    embedding = module.get_input_embeddings().weight
    params = sum(p.numel() for p in module.parameters())
    return params - head.numel() - (0 if embedding is head else embedding.numel()), head.numel()


def pass_flops(kind: str, body_params: int, head_params: int, layers: int, hidden: int, lengths: torch.Tensor,
               head_positions: int) -> float:
    """The FLOPs one `kind` pass needs: the body at every real token, the output head only at the
    `head_positions` where the actor runs it (those predicting a response token: `logits_to_keep`),
    attention over each sequence's token pairs. model_flops' convention counts the head's work at the
    other positions too: 7.7 % more for the 3B update at 2048 + 512, 19 % more for 0.5B at 1024 + 512."""
    per_param, attention = PASS_FLOPS[kind]
    lengths = lengths.double()
    return float(per_param * (body_params * lengths.sum() + head_params * head_positions)
                 + attention * layers * hidden * (lengths ** 2).sum())


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def best_time(fn: Callable[[], Any], device: str, repeats: int) -> list[float]:
    """Seconds of `repeats` calls of fn, each bracketed by a device synchronisation."""
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


def run_throughput(model_config: dict[str, Any], shape: check.BatchShape, device: str, extra: list[str],
                   repeats: int = 3, peak: float | None = None) -> dict[str, Any]:
    """Build, warm up, time; the report as a JSON-ready dict."""
    row_length = shape.prompt_length + shape.response_length
    layers, hidden = int(model_config["num_hidden_layers"]), int(model_config["hidden_size"])
    out: dict[str, Any] = {"shape": {"rows": shape.rows, "micro": shape.micro, "prompt_length": shape.prompt_length,
                                     "response_length": shape.response_length}, "overrides": extra}
    with tempfile.TemporaryDirectory(prefix="actor_throughput_") as folder:
        _, cfg, _ = check.compose(model_config, shape, device, extra, folder)
        arr = cfg.actor_rollout_ref
        normalize_actor_batch_sizes(arr, "actor_rollout_ref", world_size=1)
        mesh = check.init_single_rank(device)
        try:
            start = time.perf_counter()
            actor = check.build_actor(arr, device, mesh)
            _sync(device)
            out["build_s"] = round(time.perf_counter() - start, 2)
            params = sum(p.numel() for p in actor.module.parameters())
            body, head = param_split(actor.module)
            out.update(params=params, body_params=body, head_params=head)
            tensors = check.random_batch(int(model_config["vocab_size"]), shape)
            tensors[K.OLD_LOG_PROBS] = check.compute_log_prob(actor, tensors)     # warm-up pass
            check.update_actor(actor, tensors)                                      # warm-up update
            device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
            peak = peak if peak is not None else (peak_tflops(device_name) if device == "cuda" else None)
            for kind, fn in (("log_prob", lambda: check.compute_log_prob(actor, tensors)),
                             ("update", lambda: check.update_actor(actor, tensors))):
                times = best_time(fn, device, repeats)
                best = min(times)
                flops = model_flops(kind, params, layers, hidden, shape.rows, row_length)
                needed = pass_flops(kind, body, head, layers, hidden, torch.full((shape.rows,), row_length),
                                    shape.rows * shape.response_length)
                out[kind] = {"s": round(best, 4), "times": [round(t, 4) for t in times],
                             "tokens_per_s": round(shape.rows * row_length / best),
                             "tflops": round(flops / best / 1e12, 2),
                             "mfu": round(flops / best / (peak * 1e12), 4) if peak else None,
                             "mfu_useful": round(needed / best / (peak * 1e12), 4) if peak else None}
            out.update(device=device_name, peak_bf16_tflops=peak, torch=torch.__version__)
            if device == "cuda":
                out["max_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 2)
        finally:
            dist.destroy_process_group()
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    check.add_model_arguments(parser)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls of each pass (the best is kept)")
    parser.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak (default: by its name)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    model_config, shape = check.model_and_shape(args)
    if args.compose_only:
        report = check.composed_report(model_config, shape, args.device, list(args.overrides))
    else:
        if args.device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("no CUDA device here: run on a GPU machine, or pass --device cpu --tiny")
        if args.repeats < 1:
            raise SystemExit(f"--repeats {args.repeats}: must be >= 1")
        report = run_throughput(model_config, shape, args.device, list(args.overrides), args.repeats, args.peak_tflops)
    check.write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
