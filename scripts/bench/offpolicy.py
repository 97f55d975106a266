"""Sync vs pipelined training (trainer.pipeline) on the offline demo, at a given retrieval latency.

The demo's world, BM25 index, warm-started model and GRPO settings (scripts/demo/run_demo.py),
one retrieval server for every run, started here with `--simulate_latency_ms` (a web-search
API's latency; 0 = the local index alone). Runs `trainer.pipeline=sync` and the pipeline
alternately, `--repeats` times each, every run with the same data, seeds and `--steps` steps (no
validation, no checkpoint). A run's seconds per step is the mean of `perf/step_wall_s` (wall time
from one step's end to the next's) over its steps after the first (start-up: the pipeline has
nothing to overlap yet); each mode's figure is the median over its runs.

Prints one JSON object: `sync_s_per_step`, `pipeline_s_per_step`, `speedup` (sync / pipeline),
`max_staleness_seen`, `retrieval_latency_ms`, the pipeline, each run's figures, and both modes'
validation-free reward and search counts as a sanity check. `sync_host_cpu_util` /
`pipeline_host_cpu_util` are the host's busy CPU share over the timed steps (`perf/host_cpu_util`,
all processes: run on an otherwise idle machine). A pipeline only fills the CPU time a sync step
leaves idle; doing the same work on the same cores it needs at least `sync_s_per_step * util` a
step, so `overlap_ceiling` = 1 / `sync_host_cpu_util` bounds its speedup (a pipeline near util 1 is
at that bound: only less work per step would make it faster). A pipelined run's figures also give
its weight pushes: `weight_push_s` and `weight_push_bytes`, per push (train pool -> rollout pool).

    python -m scripts.bench.offpolicy --pipeline one_step_off --retrieval_latency_ms 300
    python -m scripts.bench.offpolicy --pipeline async --max_staleness 2 --retrieval_latency_ms 0
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from scripts.demo.build import split_args
from scripts.demo.run_demo import build_all, retrieval_server, rl_overrides

PIPELINES = ("one_step_off", "async")


def _settings(root: Path) -> Any:
    settings, _ = split_args([f"demo.output_dir={root / 'out'}", f"demo.data_dir={root / 'data'}"])
    return settings


def _one_run(settings: Any, paths: dict[str, Path], url: str, out: Path, pipeline: str,
             args: argparse.Namespace) -> dict[str, Any]:
    from verl.trainer.main_ppo import compose_config, run_ppo

    user = [f"trainer.total_training_steps={args.steps}", "trainer.test_freq=-1", "trainer.save_freq=-1",
            "+trainer.val_before_train=false", "trainer.progress_bar=false",
            f"trainer.default_local_dir={out}", f"data.train_batch_size={args.train_batch_size}",
            # one optimizer step a batch, one micro-batch a worker (divides on any worker count)
            f"actor_rollout_ref.actor.ppo_mini_batch_size={args.train_batch_size * 5}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size={args.train_batch_size * 5}",
            f"trainer.pipeline={pipeline}", *args.override]
    if pipeline == "sync":
        user.append(f"trainer.n_gpus_per_node={args.sync_workers}")
    else:
        user += [f"trainer.n_gpus_per_node={args.pipeline_workers}", f"trainer.rollout_pool={args.rollout_pool}"]
    if pipeline == "async":
        user.append(f"trainer.max_staleness={args.max_staleness}")
    history = run_ppo(compose_config(rl_overrides(settings, paths, user, url)))
    later = history[1:] or history
    return {
        "pipeline": pipeline,
        "s_per_step": statistics.fmean(h["perf/step_wall_s"] for h in later),
        "host_cpu_util": statistics.fmean(h.get("perf/host_cpu_util", float("nan")) for h in later),
        "first_step_s": history[0]["perf/step_wall_s"],
        "max_staleness_seen": max((h.get("pipeline/max_staleness_seen", 0.0) for h in history), default=0.0),
        "score_mean": statistics.fmean(h["critic/score/mean"] for h in history),
        "searches_per_rollout": statistics.fmean(h["env/number_of_valid_search"] for h in history),
        "retrieval_s_per_step": statistics.fmean(h.get("timing_s/gen_retrieval", 0.0) for h in history),
        **_push_figures(history[-1]),
    }


def _push_figures(last: dict[str, float]) -> dict[str, float]:
    """A pipelined run's weight pushes: seconds and bytes per push (the cumulative pipeline/* metrics
    of its last step over its push count); nothing for sync or a run that pushed nothing."""
    pushes = last.get("pipeline/weight_syncs", 0.0)
    if not pushes:
        return {}
    return {"weight_pushes": pushes, "weight_push_s": last["pipeline/weight_sync_s"] / pushes,
            "weight_push_bytes": last["pipeline/weight_sync_bytes"] / pushes}


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(args.workdir or tempfile.mkdtemp(prefix="offpolicy_bench_"))
    settings = _settings(root)
    paths = build_all(settings)
    server_args = ["--simulate_latency_ms", str(args.retrieval_latency_ms)]
    runs: list[dict[str, Any]] = []
    with retrieval_server(None, paths["index"], paths["corpus"], settings.topk, root / "retrieval_server.log",
                          extra_args=server_args) as url:
        for repeat in range(args.repeats):
            order = ("sync", args.pipeline) if repeat % 2 == 0 else (args.pipeline, "sync")
            for pipeline in order:
                runs.append(_one_run(settings, paths, url, root / f"run{len(runs)}", pipeline, args))
                print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    sync = statistics.median(r["s_per_step"] for r in runs if r["pipeline"] == "sync")
    piped = statistics.median(r["s_per_step"] for r in runs if r["pipeline"] != "sync")
    sync_util = statistics.median(r["host_cpu_util"] for r in runs if r["pipeline"] == "sync")
    piped_util = statistics.median(r["host_cpu_util"] for r in runs if r["pipeline"] != "sync")
    return {
        "pipeline": args.pipeline,
        "retrieval_latency_ms": args.retrieval_latency_ms,
        "sync_s_per_step": round(sync, 3),
        "pipeline_s_per_step": round(piped, 3),
        "speedup": round(sync / piped, 3),
        "max_staleness_seen": max(r["max_staleness_seen"] for r in runs),
        # the host's busy CPU share over the timed steps; a pipeline doing sync's work on the same
        # cores is at best sync_s_per_step * util per step: speedup <= 1 / util (overlap_ceiling)
        "sync_host_cpu_util": round(sync_util, 3),
        "pipeline_host_cpu_util": round(piped_util, 3),
        "overlap_ceiling": round(1.0 / sync_util, 3) if sync_util > 0 else None,
        "steps": args.steps, "repeats": args.repeats, "train_batch_size": args.train_batch_size,
        "sync_workers": args.sync_workers, "pipeline_workers": args.pipeline_workers, "rollout_pool": args.rollout_pool,
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipeline", choices=PIPELINES, default="one_step_off")
    parser.add_argument("--max_staleness", type=int, default=2, help="async's trainer.max_staleness")
    parser.add_argument("--retrieval_latency_ms", type=float, default=300.0)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each mode, alternating")
    parser.add_argument("--train_batch_size", type=int, default=8,
                        help="prompts a step, 5 rollouts each (the demo trains on 32)")
    parser.add_argument("--sync_workers", type=int, default=2, help="worker processes of a sync run (the demo's 2)")
    parser.add_argument("--pipeline_workers", type=int, default=3,
                        help="worker processes of a pipelined run: on CPU the rollout process mostly waits, so "
                             "2 train + 1 rollout share the 2 cores sync's 2 workers use")
    parser.add_argument("--rollout_pool", type=int, default=1, help="of them, the rollout pool's")
    parser.add_argument("--workdir", default=None, help="world, index and runs (default: a temporary folder)")
    parser.add_argument("--override", action="append", default=[], help="one more trainer override (repeatable)")
    args = parser.parse_args(argv)
    with contextlib.redirect_stdout(sys.stderr):   # the demo's and the trainer's lines: stdout is the JSON alone
        result = run(args)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
