"""Padded vs packed (model.use_remove_padding) actor throughput on the demo's length distribution.

Builds the actor three times through the project's own worker code (scripts/gpu_checks/memory_plan_vs_allocated.py's
build_actor: FSDP2 on one rank, AdamW; bf16 mixed precision on CUDA), from the same seed: padded (sdpa over
the padded rows), packed (the registered packed attention, verl/utils/packed_attention.py: per-sequence sdpa
on CPU, torch's varlen_attn on CUDA) in the same micro-batches of rows, and packed_by_tokens (packed, with
use_dynamic_bsz filling each micro-batch up to the tokens a padded one holds: the same activation memory in
fewer micro-batches, as packing is run in practice). All run the same batch: rows whose prompt and
response lengths follow the demo's measured distribution (`DEMO_LENGTHS`), left-padded prompts and
right-padded responses as the rollout makes them, one masked observation span per response (the tag
protocol's <information> block). Prints ONE JSON object: per mode and pass (log_prob, update) the best
seconds, tokens/s over the real tokens (the same count in every mode) and MFU; packed / padded speedups
(`speedup`, `speedup_by_tokens`); and the equality of the results (max |log-prob difference| of the first
pass, the first update's grad norm; the worse of the two packed modes).

FLOPs: per real token 2N (log-prob pass) or 6N (update) plus attention 4 L h (pass) or 12 L h (update)
per token pair within a sequence, i.e. the useful work; the same count for both modes, so MFU compares
them. Peak: the device's measured fp32 matmul peak on CPU (verl.utils.flops_counter), the bf16 table on
CUDA (scripts/gpu_checks/actor_throughput.py), or --peak-tflops.

    python -m scripts.bench.packing                               # CPU, the demo's model (hidden 128, 4 layers)
    python -m scripts.bench.packing --device cuda --model-config example/model_configs/qwen2.5-3b/config.json \
        actor_rollout_ref.model.enable_gradient_checkpointing=true   # scripts/gpu_checks/packing_throughput.py
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

from scripts.gpu_checks import memory_plan_vs_allocated as check
from scripts.gpu_checks.actor_throughput import best_time, param_split, pass_flops, peak_tflops
from verl.utils import batch_keys as K
from verl.utils.seqlen_balancing import num_micro_batches_for
from verl.workers.fsdp_workers import normalize_actor_batch_sizes

# The demo's measured lengths (tag protocol, GRPO on the demo's data: response_length/* and
# prompt_length/* of six training steps' metrics.jsonl): prompts 124-131 tokens; responses mean
# ~70 (57-82 per step), min 13, max 199 (the second search's turn).
DEMO_LENGTHS: dict[str, int] = {"prompt_min": 124, "prompt_max": 131, "response_min": 13, "response_max": 199,
                                "response_mean": 70}
# The demo's model (scripts/demo/build.py's defaults): Qwen2 architecture, hidden 128, 4 layers, 4 heads.
DEMO_MODEL: dict[str, Any] = {**check.QWEN2_5_0_5B, "hidden_size": 128, "intermediate_size": 512,
                              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
                              "vocab_size": 1000, "max_position_embeddings": 2048, "sliding_window": 2048,
                              "max_window_layers": 4, "bos_token_id": 999, "eos_token_id": 999}
PASS_FLOPS = {"log_prob": (2, 4), "update": (6, 12)}


def demo_lengths(rows: int, seed: int = 0, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt lengths, response lengths) of `rows` rows, the demo's distribution (times `scale`).

    Responses: 85% one-search answers (normal, mean 55, sd 20, clipped to [min, 120]) and 15%
    two-search ones (normal around 185, clipped to [150, max]): mean ~70 as measured."""
    g = torch.Generator().manual_seed(seed)
    d = DEMO_LENGTHS
    prompts = torch.randint(d["prompt_min"], d["prompt_max"] + 1, (rows,), generator=g)
    short = (55 + 20 * torch.randn(rows, generator=g)).clamp(d["response_min"], 120)
    long = (185 + 8 * torch.randn(rows, generator=g)).clamp(150, d["response_max"])
    responses = torch.where(torch.rand(rows, generator=g) < 0.15, long, short).round().long()
    return (prompts.float() * scale).round().long().clamp(min=1), (responses.float() * scale).round().long().clamp(min=1)


def demo_batch(vocab_size: int, rows: int, seed: int = 0, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Host tensors of a rollout batch with demo_lengths: left-padded prompts, right-padded responses
    (the batch's longest of each), one masked observation span in each response longer than 20 tokens."""
    prompt_lens, response_lens = demo_lengths(rows, seed, scale)
    p_max, r_max = int(prompt_lens.max()), int(response_lens.max())
    g = torch.Generator().manual_seed(seed + 1)
    prompt_mask = (torch.arange(p_max) >= p_max - prompt_lens[:, None]).long()
    resp_mask = (torch.arange(r_max) < response_lens[:, None]).long()
    input_ids = torch.randint(0, vocab_size, (rows, p_max + r_max), generator=g)
    attention_mask = torch.cat([prompt_mask, resp_mask], dim=-1)
    input_ids = input_ids * attention_mask
    response_mask = resp_mask.clone()
    long_rows = response_lens > 20
    response_mask[long_rows, 8:20] = 0          # the <information> block: attended to, not trained on
    return {
        K.INPUT_IDS: input_ids,
        K.ATTENTION_MASK: attention_mask,
        K.POSITION_IDS: (attention_mask.cumsum(-1) - 1).clamp(min=0),
        K.RESPONSES: input_ids[:, p_max:].clone(),
        K.RESPONSE_MASK: response_mask,
        K.ADVANTAGES: torch.randn(rows, r_max, generator=g) * resp_mask,
    }


def useful_flops(kind: str, params: int, layers: int, hidden: int, lengths: torch.Tensor) -> float:
    """Model FLOPs of one pass over sequences of `lengths` real tokens (padding is not useful work)."""
    per_param, attention = PASS_FLOPS[kind]
    lengths = lengths.double()
    return float(per_param * params * lengths.sum() + attention * layers * hidden * (lengths ** 2).sum())


def _peak(device: str, given: float | None) -> float | None:
    if given is not None:
        return given * 1e12
    if device == "cuda":
        tflops = peak_tflops(torch.cuda.get_device_name())
        return tflops * 1e12 if tflops else None
    from verl.utils.flops_counter import get_device_peak_flops

    return get_device_peak_flops("cpu")


# A leftover actor (another mode's 46 GiB at 3B) would put the next build out of an H100's memory.
LEFTOVER_LIMIT_GIB = 1.0


def _timed_passes(actor: Any, batch: dict[str, torch.Tensor], lengths: torch.Tensor, head_positions: int,
                  model_config: dict[str, Any], device: str, repeats: int, peak: float | None) -> dict[str, Any]:
    """Best seconds, tokens/s over the real tokens and MFU of `repeats` log-prob passes and updates:
    `mfu` every parameter at every real token (actor_throughput.model_flops' convention, the baseline's),
    `mfu_useful` the output head only at the positions that predict a response token (`pass_flops`)."""
    params = sum(p.numel() for p in actor.module.parameters())
    body, head = param_split(actor.module)
    layers, hidden = int(model_config["num_hidden_layers"]), int(model_config["hidden_size"])
    out: dict[str, Any] = {}
    for kind, fn in (("log_prob", lambda: check.compute_log_prob(actor, batch)),
                     ("update", lambda: check.update_actor(actor, batch))):
        times = best_time(fn, device, repeats)
        best = min(times)
        flops = useful_flops(kind, params, layers, hidden, lengths)
        needed = pass_flops(kind, body, head, layers, hidden, lengths, head_positions)
        out[kind] = {"s": round(best, 4), "times": [round(t, 4) for t in times],
                     "tokens_per_s": round(int(lengths.sum()) / best, 1),
                     "mfu": round(flops / best / peak, 5) if peak else None,
                     "mfu_useful": round(needed / best / peak, 5) if peak else None}
    return out


def _measure_mode(model_config: dict[str, Any], shape: check.BatchShape, device: str, extra: list[str],
                  tensors: dict[str, torch.Tensor], old_log_probs: torch.Tensor | None, repeats: int,
                  lengths: torch.Tensor, peak: float | None, mesh: Any,
                  full_rows: check.BatchShape | None = None) -> tuple[dict[str, Any], torch.Tensor]:
    """One mode's actor (extra says padded or packed): first log-probs, first update, timed passes; with
    `full_rows`, the same actor timed again on a batch of full rows of that shape (actor_throughput's
    measurement, on the same device)."""
    out: dict[str, Any] = {}
    if device == "cuda":
        leftover = torch.cuda.memory_allocated() / 2 ** 30
        out["allocated_before_build_gib"] = round(leftover, 2)
        if leftover > LEFTOVER_LIMIT_GIB:
            raise RuntimeError(f"{leftover:.1f} GiB still allocated before building the next actor: the previous "
                               "mode's actor was not freed")
    with tempfile.TemporaryDirectory(prefix="bench_packing_") as folder:
        _, cfg, _ = check.compose(model_config, shape, device, extra, folder)
        arr = cfg.actor_rollout_ref
        normalize_actor_batch_sizes(arr, "actor_rollout_ref", world_size=1)
        start = time.perf_counter()
        actor = check.build_actor(arr, device, mesh)
        out.update(attn_implementation=actor.module.config._attn_implementation,
                   build_s=round(time.perf_counter() - start, 2))
        first = check.compute_log_prob(actor, tensors)
        batch = {**tensors, K.OLD_LOG_PROBS: first if old_log_probs is None else old_log_probs}
        metrics = check.update_actor(actor, batch)
        out["first_update_grad_norm"] = float(metrics["actor/grad_norm"][0])
        out["first_update_pg_loss"] = float(metrics["actor/pg_loss"][0])
        head_positions = int(tensors[K.ATTENTION_MASK][:, -tensors[K.RESPONSES].shape[1]:].sum())
        out.update(_timed_passes(actor, batch, lengths, head_positions, model_config, device, repeats, peak))
        if device == "cuda":
            out["max_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 2)
        if full_rows is not None:
            out["full_rows"] = _full_rows(actor, full_rows, model_config, device, repeats, peak)
        actor = None   # free its memory before the next mode builds its own
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return out, first


def _full_rows(actor: Any, shape: check.BatchShape, model_config: dict[str, Any], device: str, repeats: int,
               peak: float | None) -> dict[str, Any]:
    """actor_throughput's measurement with this actor: a warm-up, then timed passes over full rows."""
    batch = check.random_batch(int(model_config["vocab_size"]), shape)
    batch[K.OLD_LOG_PROBS] = check.compute_log_prob(actor, batch)
    check.update_actor(actor, batch)
    lengths = torch.full((shape.rows,), shape.prompt_length + shape.response_length)
    out: dict[str, Any] = {"rows": shape.rows, "micro": shape.micro, "prompt_length": shape.prompt_length,
                           "response_length": shape.response_length}
    out.update(_timed_passes(actor, batch, lengths, shape.rows * shape.response_length, model_config, device,
                             repeats, peak))
    if device == "cuda":
        out["max_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 2)
    return out


def run_bench(model_config: dict[str, Any], rows: int, micro: int, device: str, extra: list[str],
              repeats: int = 3, peak_tflops_given: float | None = None, scale: float = 1.0,
              seed: int = 0, full_rows: check.BatchShape | None = None) -> dict[str, Any]:
    """Padded, packed, packed by tokens; the report as a JSON-ready dict. `full_rows`: the padded actor
    is also timed on full rows of that shape (`padded.full_rows`)."""
    tensors = demo_batch(int(model_config["vocab_size"]), rows, seed, scale)
    mask = tensors[K.ATTENTION_MASK]
    lengths = mask.sum(-1)
    r_max = tensors[K.RESPONSES].shape[1]
    shape = check.BatchShape(rows, micro, mask.shape[1] - r_max, r_max)
    peak = _peak(device, peak_tflops_given)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
        "threads": torch.get_num_threads(), "peak_tflops": round(peak / 1e12, 3) if peak else None,
        "model": {k: model_config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                               "num_key_value_heads", "intermediate_size", "vocab_size")},
        "batch": {"rows": rows, "micro": micro, "padded_row_length": int(mask.shape[1]),
                  "real_tokens": int(lengths.sum()), "padded_tokens": int(mask.numel()),
                  "real_fraction": round(float(lengths.sum() / mask.numel()), 3),
                  "response_length": {"mean": round(float(tensors[K.ATTENTION_MASK][:, -r_max:].sum(-1).float().mean()), 1),
                                      "min": int(mask[:, -r_max:].sum(-1).min()),
                                      "max": int(mask[:, -r_max:].sum(-1).max())},
                  "length_scale": scale},
        "overrides": extra,
    }
    # packed_by_tokens: packed micro-batches filled up to the tokens a padded micro-batch holds (the same
    # activation memory), as veRL users run packing (use_dynamic_bsz): fewer, fuller micro-batches.
    budget = micro * int(mask.shape[1])
    report["batch"]["by_tokens_budget"] = budget
    report["batch"]["micro_batches"] = {"fixed": -(-rows // micro),
                                        "by_tokens": num_micro_batches_for(lengths.tolist(), budget)}
    modes = {"padded": ["actor_rollout_ref.model.use_remove_padding=false"],
             "packed": ["actor_rollout_ref.model.use_remove_padding=true"],
             "packed_by_tokens": ["actor_rollout_ref.model.use_remove_padding=true",
                                  "actor_rollout_ref.actor.use_dynamic_bsz=true",
                                  f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}"]}
    results: dict[str, dict[str, Any]] = {}
    log_probs: dict[str, torch.Tensor] = {}
    mesh = check.init_single_rank(device)
    try:
        for mode, settings in modes.items():
            results[mode], log_probs[mode] = _measure_mode(
                model_config, shape, device, [*extra, *settings], tensors, log_probs.get("padded"), repeats, lengths,
                peak, mesh, full_rows if mode == "padded" else None)
    finally:
        dist.destroy_process_group()
    real = mask[:, -r_max:].bool()
    padded = results["padded"]
    report.update(results)
    report["speedup"] = {kind: round(results["packed"][kind]["tokens_per_s"] / padded[kind]["tokens_per_s"], 3)
                         for kind in PASS_FLOPS}
    report["speedup_by_tokens"] = {
        kind: round(results["packed_by_tokens"][kind]["tokens_per_s"] / padded[kind]["tokens_per_s"], 3)
        for kind in PASS_FLOPS}
    report["equal_results"] = {
        "max_abs_log_prob_diff": max(float((log_probs[m][real] - log_probs["padded"][real]).abs().max())
                                     for m in ("packed", "packed_by_tokens")),
        "grad_norm_rel_diff": max(abs(results[m]["first_update_grad_norm"] - padded["first_update_grad_norm"])
                                  for m in ("packed", "packed_by_tokens")) / max(padded["first_update_grad_norm"], 1e-12),
    }
    return report


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model-config", help="a config.json (default: the demo's model; --tiny: hidden 64)")
    parser.add_argument("--tiny", action="store_true", help="hidden 64, 2 layers, vocab 512 (the CPU test)")
    parser.add_argument("--rows", type=int, default=32, help="rows of the update (one mini-batch)")
    parser.add_argument("--micro", type=int, default=8, help="rows per micro-batch")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls of each pass (the best is kept)")
    parser.add_argument("--length-scale", type=float, default=1.0, help="multiply the demo's lengths")
    parser.add_argument("--peak-tflops", type=float, help="the device's peak (default: measured / by name)")
    parser.add_argument("--out", help="also write the JSON report to this file")
    parser.add_argument("overrides", nargs="*", help="trainer-config overrides, key=value")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import json
    from pathlib import Path

    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run on a GPU machine, or pass --device cpu")
    if args.repeats < 1 or args.rows < 1 or args.micro < 1:
        raise SystemExit("--repeats, --rows and --micro must be >= 1")
    if args.model_config and args.tiny:
        raise SystemExit("--tiny and --model-config choose the model both; pass one")
    model_config = (json.loads(Path(args.model_config).read_text()) if args.model_config
                    else check.TINY if args.tiny else DEMO_MODEL)
    report = run_bench(model_config, args.rows, args.micro, args.device, list(args.overrides), args.repeats,
                       args.peak_tflops, args.length_scale)
    check.write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
