"""Every GPU check of the project in one command, each bounded by its own timeout, with one JSON summary.

    bash scripts/gpu_checks/run_all.sh                      # on a GPU machine (about 12 minutes on one H100)
    bash scripts/gpu_checks/run_all.sh --only memory_plan_0.5b,memory_plan_3b_gc --out /tmp/gpu
    bash scripts/gpu_checks/run_all.sh --list               # the checks, their commands and expected times
    bash scripts/gpu_checks/run_all.sh --dry-run            # parse and compose every check; run nothing (CPU)
    bash scripts/gpu_checks/run_all.sh --cpu                # the same orchestration on CPU with tiny settings

On a lent machine with no network, carry the stack first (docs/testing.md "GPU checks"):
`bash .gpu-carry/enter.sh bash scripts/gpu_checks/run_all.sh --out /path/to/results`.

Each check runs as its own process group from the repository root (stdout and stderr to
`<out>/<name>.log`), killed at its timeout (rc 124). Progress goes to stderr, one line a check; the
summary, printed at the end as ONE JSON object on stdout and written to `<out>/summary.json`, holds
the device, torch and git commit, and per check: name, rc, seconds, expected seconds on one H100,
timed_out, the log, and its key figures (plan vs measured GiB, tokens/s and MFU, validation EM and
seconds per RL step, tests passed). `--max-total-s` stops starting checks whose expected time would
pass the budget (reported as not run). `--cpu` runs each check that has a CPU form with tiny
settings (CUDA-only ones are reported as skipped); `--dry-run` composes each command in this process
(the trainer config of each demo with its config checks, each script's arguments and plan, pytest's
collection) so a command that no longer parses fails on CPU, in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
QWEN_3B = "example/model_configs/qwen2.5-3b/config.json"
QWEN_7B = "example/model_configs/qwen2.5-7b/config.json"
QWEN3_30B_A3B = "example/model_configs/qwen3-30b-a3b/config.json"
BIG_3B = ("--model-config", QWEN_3B, "--rows", "16", "--micro", "4", "--prompt-length", "2048",
          "--response-length", "512", "actor_rollout_ref.model.enable_gradient_checkpointing=true")
TINY = ("--device", "cpu", "--tiny", "--rows", "4", "--micro", "2", "--prompt-length", "16", "--response-length", "8")
DEMO_GPU = ("trainer.device=cuda", "trainer.n_gpus_per_node=1")
# --cpu: one RL step, 40 validation rows (a seeded subsample that holds both sources), the demo's 2 CPU workers
DEMO_CPU = ("trainer.device=cpu", "trainer.total_training_steps=1", "data.val_data_num=40")
GIB = 1024 ** 3


@dataclass(frozen=True)
class Check:
    """One check: `python -m module *args` from the repository root (`{out}` is its output folder)."""

    name: str
    what: str
    module: str
    args: tuple[str, ...]
    cpu_args: tuple[str, ...] | None    # --cpu: tiny settings; None: needs CUDA
    kind: str                           # pytest | script | measure (has --compose-only) | demo
    expected_s: int                     # on one H100 with .gpu-carry's demo data, measured or estimated
    timeout_s: int
    cpu_timeout_s: int                  # --cpu on a 2-core machine (a demo there is minutes)
    figures: Callable[[Path, str], dict[str, Any]] = field(compare=False, repr=False,
                                                           default=lambda out, log: {})


def _pytest_figures(out: Path, log: str) -> dict[str, Any]:
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", log)}
    return counts


def _issue13_figures(out: Path, log: str) -> dict[str, Any]:
    return {"all_ok": "ALL OK" in log, "items": [line for line in log.splitlines() if line.startswith("item")]}


# What the figures read; removed before each run of a check.
FIGURE_FILES = ("report.json", "summary.json")


def _json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _memory_figures(out: Path, log: str) -> dict[str, Any]:
    report = _json(out / "report.json")
    if report is None:
        return {}
    figures: dict[str, Any] = {"device": report.get("device")}
    for name, phase in report.get("phases", {}).items():
        measured = phase.get("measured_peak_bytes")
        figures[name] = {"plan_gib": round(phase["plan_bytes"] / GIB, 4), "binding": phase.get("plan_binding"),
                         "measured_gib": None if measured is None else round(measured / GIB, 4),
                         "measured_over_plan": phase.get("measured_over_plan")}
    return figures


def _packing_figures(out: Path, log: str) -> dict[str, Any]:
    """Per shape (the ones the report holds: it is written after each): packed / padded speedups (by tokens
    is the figure issue 35's 1.5x is judged on: in the padded micro-batches packing can gain at most
    1 / real_fraction), the results' agreement, and per mode what it ran, its memory and per pass tokens/s
    and MFU (`mfu`: the baseline's convention; `mfu_useful`: the head only where it runs); at 3B the padded
    actor on full rows, the 35 % baseline's measurement on this device."""
    report = _json(out / "report.json")
    if not report:
        return {}
    figures: dict[str, Any] = {"device": next(iter(report.values())).get("device")}
    pass_keys = ("tokens_per_s", "mfu", "mfu_useful")
    mode_keys = ("attn_implementation", "build_s", "max_allocated_gib", "allocated_before_build_gib")
    for shape, run in report.items():
        batch = run.get("batch", {})
        figures[shape] = {"speedup": run.get("speedup"), "speedup_by_tokens": run.get("speedup_by_tokens"),
                          **run.get("equal_results", {}), "real_fraction": batch.get("real_fraction"),
                          "micro_batches": batch.get("micro_batches")}
        for mode in ("padded", "packed", "packed_by_tokens"):
            if mode not in run:
                continue
            result = run[mode]
            figures[shape][mode] = {**{k: result.get(k) for k in mode_keys},
                                    **{kind: {k: result[kind].get(k) for k in pass_keys}
                                       for kind in ("log_prob", "update")}}
            if "full_rows" in result:
                full = result["full_rows"]
                figures[shape][mode]["full_rows"] = {
                    "shape": [full["rows"], full["prompt_length"], full["response_length"]],
                    **{kind: {k: full[kind].get(k) for k in pass_keys} for kind in ("log_prob", "update")}}
    return figures


def _demo_figures(out: Path, log: str) -> dict[str, Any]:
    summary = _json(out / "summary.json")
    if summary is None:
        return {}
    steps = int(summary["rl_steps"]) or 1
    return {"val_em_before": round(summary["val_em_before"], 3), "val_em_after": round(summary["val_em_after"], 3),
            "rl_steps": summary["rl_steps"], "rl_seconds": round(summary["rl_seconds"], 1),
            "rl_seconds_per_step": round(summary["rl_seconds"] / steps, 2),
            "wall_seconds": round(summary["wall_seconds"], 1)}


def _async_rollout_figures(out: Path, log: str) -> dict[str, Any]:
    """The bench's JSON line (its stdout is that object alone; stderr holds the build's progress)."""
    for line in reversed(log.splitlines()):
        if line.startswith("{"):
            try:
                report = json.loads(line)
            except ValueError:
                continue
            counters = report.get("counters", {})
            return {"sync_s": report.get("sync_s"), "async_s": report.get("async_s"), "speedup": report.get("speedup"),
                    "forwards_per_token": {m: c.get("forwards_per_generated_token") for m, c in counters.items()}}
    return {}


def _sharded_init_figures(out: Path, log: str) -> dict[str, Any]:
    """The script's indented JSON object, the last thing it prints."""
    start = log.rfind("\n{")
    try:
        report = json.loads(log[start + 1:] if start >= 0 else log)
    except ValueError:
        return {}
    return {"ok": report.get("ok"), "checks": report.get("checks")}


def _measure(name: str, module: str, what: str, big: bool, expected_s: int, figures: Callable) -> Check:
    out = ("--out", "{out}/report.json")
    gpu = (*BIG_3B, *out) if big else out
    cpu = (*TINY, *out, *(("actor_rollout_ref.model.enable_gradient_checkpointing=true",) if big else ()))
    return Check(name, what, module, gpu, cpu, "measure", expected_s, max(240, 3 * expected_s), 300, figures)


def _demo(name: str, what: str, extra: tuple[str, ...], steps: int, expected_s: int) -> Check:
    where = ("demo.output_dir={out}", "trainer.default_local_dir={out}/ckpt")
    return Check(name, what, "scripts.demo.run_demo", (*DEMO_GPU, f"trainer.total_training_steps={steps}", *extra, *where),
                 (*DEMO_CPU, *extra, *where), "demo", expected_s, 2 * expected_s + 60, 900, _demo_figures)


CHECKS: tuple[Check, ...] = (
    Check("pytest_gpu", "tests/gpu: the CUDA paths CPU tests pin by contract", "pytest",
          ("-m", "gpu", "tests/gpu", "-q", "-p", "no:cacheprovider"), ("-m", "gpu", "tests/gpu", "-q", "-p",
                                                                        "no:cacheprovider"),
          "pytest", 30, 180, 300, _pytest_figures),
    Check("issue13", "HF rollout's cached greedy and stops on CUDA, NCCL reduce, prompt-forward memory",
          "scripts.gpu_checks.issue13_rollout_and_reduce", (), None, "script", 25, 180, 0, _issue13_figures),
    Check("sharded_init", "model init on the meta device, rank 0 streaming the checkpoint over NCCL (issue 32 item "
          "2): every shard and buffer on the GPU, the from_pretrained weights and logits, flat host memory",
          "scripts.gpu_checks.sharded_init", (), ("--device", "cpu"), "script", 20, 180, 300, _sharded_init_figures),
    _measure("memory_plan_0.5b", "scripts.gpu_checks.memory_plan_vs_allocated",
             "plan vs max_memory_allocated, Qwen2.5-0.5B shape, first and second update, log-prob pass",
             False, 40, _memory_figures),
    _measure("memory_plan_3b_gc", "scripts.gpu_checks.memory_plan_vs_allocated",
             "the same, Qwen2.5-3B shape with gradient checkpointing, 16 rows of 2048 + 512", True, 55,
             _memory_figures),
    # LoRA (issue 34 item 5): the 7B shape at rank 64, as example/lora/train_grpo_lora_7b.sh trains it on one GPU
    Check("memory_plan_7b_lora64", "the same with LoRA rank 64 on Qwen2.5-7B's shape (bf16 frozen base, fp32 "
          "adapter + AdamW), gradient checkpointing, 8 rows of 2048 + 512; also the reference pass (adapter off)",
          "scripts.gpu_checks.memory_plan_vs_allocated",
          ("--model-config", QWEN_7B, *BIG_3B[2:], "--rows", "8", "--lora-rank", "64", "--out", "{out}/report.json"),
          (*TINY, "--lora-rank", "8", "--out", "{out}/report.json"), "measure", 35, 240, 300, _memory_figures),
    # Issue 47: Qwen3-30B-A3B's shape (128 experts of 768, 8 a token; q/k norms, head_dim 128, vocab 151,936) cut to
    # 2 of its 48 layers (1.9 B parameters: fp32 weights, grads and AdamW ~30 GB on one GPU), gradient
    # checkpointing, 4 rows of 2048 + 512: the MoE plan's total-vs-active split (weights and the gathered layer by
    # all experts, activations by the active ones) against what the allocator holds. Not yet run on a GPU.
    Check("memory_plan_qwen3_30b_a3b", "the same on Qwen3-30B-A3B's layer shape (MoE: 128 experts, 8 active), "
          "2 of its 48 layers, gradient checkpointing, 4 rows of 2048 + 512",
          "scripts.gpu_checks.memory_plan_vs_allocated",
          ("--model-config", QWEN3_30B_A3B, "--num-layers", "2", *BIG_3B[2:], "--rows", "4", "--out",
           "{out}/report.json"),
          ("--device", "cpu", "--tiny-moe", *TINY[3:], "--out", "{out}/report.json"), "measure", 25, 240, 300,
          _memory_figures),
    # Issue 35: replaces the two actor_throughput checks; at 3B its padded actor is also timed on
    # actor_throughput's full rows (the 35 % baseline's shape), so both figures come from one card
    Check("packing_throughput", "padded vs packed actor tokens/s and MFU, packed through torch's varlen_attn (no "
          "flash-attn), in the padded micro-batches and by tokens; Qwen2.5-0.5B and 3B (gradient checkpointing) shapes "
          "on the demo's lengths x 4 (issue 35 wants packed by tokens >= 1.5x padded, the 3B packed update >= 45 % MFU) and "
          "the first pass's max |log-prob difference|",
          "scripts.gpu_checks.packing_throughput", ("--repeats", "2", "--out", "{out}/report.json"),
          ("--device", "cpu", "--tiny", "--repeats", "1", "--out", "{out}/report.json"), "script", 115, 300, 300,
          _packing_figures),
    Check("async_rollout_counters", "the demo's rollout in one process, sync vs async HF engine on CUDA: wall "
          "times (speedup = sync / async, issue 32 item 11 wants >= 1) and the forward / host-sync counters",
          "scripts.bench.async_rollout", ("--counters", "--device", "cuda", "--repeats", "3"),
          ("--counters", "--repeats", "1", "--prompts", "8"), "script", 40, 180, 600, _async_rollout_figures),
    _demo("demo_grpo_sync", "the offline demo on CUDA: GRPO with search, sync rollout", (), 6, 80),
    _demo("demo_grpo_async", "the same with the async rollout (issue 32 item 11: async >= sync)",
          ("actor_rollout_ref.rollout.mode=async",), 4, 75),
    _demo("demo_ppo", "the demo with PPO (GAE + critic)", ("demo.algorithm=ppo",), 6, 85),
    _demo("demo_tool", "the demo in the tool protocol (native tool calls)", ("demo.protocol=tool",), 3, 120),
)


def command(check: Check, out: Path, cpu: bool) -> list[str]:
    """The argv of `check` (its --cpu form with `cpu`), `{out}` filled in."""
    args = check.cpu_args if cpu else check.args
    if args is None:
        raise ValueError(f"{check.name} needs CUDA: it has no --cpu form")
    return [sys.executable, "-m", check.module, *(a.replace("{out}", str(out)) for a in args)]


def child_env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{path}" if path else str(REPO), "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "offline"}


def run_bounded(argv: list[str], log_path: Path, timeout_s: float) -> tuple[int, bool]:
    """(rc, timed out) of argv run as its own process group, output to log_path; the group is killed
    (TERM, then KILL) at the timeout, rc 124 as timeout(1) says."""
    with log_path.open("w") as log:
        proc = subprocess.Popen(argv, cwd=REPO, env=child_env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s), False
        except subprocess.TimeoutExpired:
            for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
                try:
                    proc.wait(timeout=wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
            return 124, True


def compose_check(check: Check, out: Path) -> dict[str, Any]:
    """--dry-run: parse and compose `check`'s GPU command here, running nothing; figures of what it would do.
    Raises on a command that no longer parses or composes."""
    args = [a.replace("{out}", str(out)) for a in check.args]
    if check.kind == "pytest":
        done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", *args], cwd=REPO,
                              env=child_env(), capture_output=True, text=True, timeout=300)
        collected = re.search(r"(\d+) tests? collected", done.stdout)
        if done.returncode != 0 or not collected:
            raise RuntimeError(f"pytest could not collect {args}: {done.stdout[-2000:]}{done.stderr[-2000:]}")
        return {"collected": int(collected.group(1))}
    module = importlib.import_module(check.module)
    if check.kind == "script":
        return {"module": check.module, "imported": True}
    if check.kind == "measure":
        with contextlib.redirect_stdout(io.StringIO()):
            report = module.main([*args, "--compose-only"])
        return {"plan_gib": report["plan_gib"]}
    return _compose_demo(module, args)


def _compose_demo(run_demo: Any, args: list[str]) -> dict[str, Any]:
    """The demo's trainer config as it would run, checked as on a GPU host (config_check.config_errors)."""
    from omegaconf import OmegaConf

    from scripts.demo.build import split_args
    from verl.trainer.config_check import config_errors

    algorithm, rest = run_demo.split_algorithm(args)
    settings, user = split_args(rest)
    if settings.protocol == "tool":
        # run_demo writes it once its retrieval server answers; the config check reads it
        from scripts.demo.tool_demonstrations import write_tool_config

        write_tool_config(run_demo.tool_config_path(settings), "http://127.0.0.1:8000/retrieve", settings.topk)
    cfg = run_demo.planned_config(algorithm, settings, user)
    OmegaConf.resolve(cfg)
    errors = config_errors(cfg, has_gpu=True)
    if errors:
        raise ValueError("; ".join(errors))
    return {"algorithm": str(cfg.algorithm.adv_estimator), "protocol": settings.protocol,
            "rollout_mode": str(cfg.actor_rollout_ref.rollout.get("mode", "sync")),
            "device": str(cfg.trainer.device), "steps": int(cfg.trainer.total_training_steps)}


def environment() -> dict[str, Any]:
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "python": sys.version.split()[0],
            "commit": commit.stdout.strip() if commit.returncode == 0 else None}


def run_checks(checks: list[Check], out: Path, mode: str, max_total_s: float | None = None) -> dict[str, Any]:
    """Run (mode gpu | cpu) or compose (dry-run) each check in order; the summary dict."""
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    results = []
    for i, check in enumerate(checks, 1):
        folder = out / check.name
        folder.mkdir(parents=True, exist_ok=True)
        result: dict[str, Any] = {"name": check.name, "rc": None, "seconds": 0.0, "expected_s": check.expected_s,
                                  "timed_out": False, "figures": {}}
        elapsed = time.monotonic() - start
        began = time.monotonic()
        if mode == "cpu" and check.cpu_args is None:
            result["skipped"] = "needs CUDA"
        elif mode != "dry-run" and max_total_s is not None and elapsed + check.expected_s > max_total_s:
            result["skipped"] = f"budget: {elapsed:.0f} s spent, {check.expected_s} s expected, --max-total-s {max_total_s:g}"
        elif mode == "dry-run":
            try:
                result["figures"] = compose_check(check, folder)
                result["rc"] = 0
            except (Exception, SystemExit) as exc:   # every failure is the check's result, named
                result["rc"], result["error"] = 1, f"{type(exc).__name__}: {exc}"[:2000]
            result["command"] = " ".join(command(check, folder, cpu=False)[1:])
        else:
            argv = command(check, folder, cpu=mode == "cpu")
            log = folder / "output.log"
            for stale in FIGURE_FILES:     # a rerun into the same --out must not show the last run's figures
                (folder / stale).unlink(missing_ok=True)
            result["rc"], result["timed_out"] = run_bounded(argv, log, check.cpu_timeout_s if mode == "cpu"
                                                            else check.timeout_s)
            result["log"] = str(log)
            text = log.read_text(errors="replace")
            try:   # a failed check's partial report still gives what it measured; a malformed one costs its figures only
                result["figures"] = check.figures(folder, text)
            except Exception as exc:
                result["figures_error"] = f"{type(exc).__name__}: {exc}"[:500]
            if result["rc"] != 0:
                result["tail"] = text[-1500:]
        result["seconds"] = round(time.monotonic() - began, 1)
        results.append(result)
        status = result.get("skipped") or f"rc {result['rc']}" + (" (timed out)" if result["timed_out"] else "")
        print(f"[{i}/{len(checks)}] {check.name}: {status} in {result['seconds']:.0f} s", file=sys.stderr, flush=True)
    failed = [r["name"] for r in results if r["rc"] not in (0, None)]
    summary = {"mode": mode, **environment(), "out": str(out), "total_seconds": round(time.monotonic() - start, 1),
               "expected_total_s": sum(c.expected_s for c in checks), "failed": failed, "checks": results}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def select(only: str | None) -> list[Check]:
    if not only:
        return list(CHECKS)
    names = [n.strip() for n in only.split(",") if n.strip()]
    known = {c.name: c for c in CHECKS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"--only: unknown check(s) {unknown}; known: {', '.join(known)}")
    return [known[n] for n in names]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--cpu", action="store_true", help="run the checks that have a CPU form, tiny, on CPU")
    mode.add_argument("--dry-run", action="store_true", help="parse and compose every check; run nothing")
    mode.add_argument("--list", action="store_true", help="list the checks, their commands and expected times")
    parser.add_argument("--only", help="comma-separated check names (default: all, in order)")
    parser.add_argument("--out", help="output folder (default: outputs/gpu_checks/<UTC time>)")
    parser.add_argument("--max-total-s", type=float, help="do not start a check expected to end past this budget")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    checks = select(args.only)
    out = Path(args.out or REPO / "outputs" / "gpu_checks" / time.strftime("%Y%m%d-%H%M%S", time.gmtime())).absolute()
    if args.list:
        for c in checks:
            print(f"{c.name:24} ~{c.expected_s:4d} s (timeout {c.timeout_s} s): {c.what}\n"
                  f"{'':24} python -m {' '.join(command(c, out / c.name, cpu=False)[2:])}")
        print(f"expected in all: ~{sum(c.expected_s for c in checks)} s on one H100")
        return 0
    mode = "cpu" if args.cpu else "dry-run" if args.dry_run else "gpu"
    if mode == "gpu":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("run_all: no CUDA device here; --cpu runs the CPU forms, --dry-run composes every check")
    summary = run_checks(checks, out, mode, args.max_total_s)
    print(json.dumps(summary, indent=1))
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
