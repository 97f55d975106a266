"""Cost of a 2-worker Ray group on CPU: start-up (with and without ray.init) and teardown.

Later tests budget their time from these figures. Prints one JSON object.

    python -m scripts.bench.worker_group [--workers 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import ray
import torch.distributed as dist

from verl.single_controller.base import Dispatch, Worker, register
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.utils.device import get_dist_backend


class PingWorker(Worker):
    """Joins the gloo group on its first call, as every real worker's init_model does."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_group(self) -> int:
        if not dist.is_initialized():
            dist.init_process_group(get_dist_backend())
        return self.rank


def start_group(num_workers: int) -> tuple[RayWorkerGroup, RayResourcePool, float]:
    """Start a group and wait for its first answered call (gloo group formed)."""
    t0 = time.perf_counter()
    pool = RayResourcePool(process_on_nodes=[num_workers], use_gpu=False)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(ray.remote(PingWorker)))
    group.init_group()
    return group, pool, time.perf_counter() - t0


def measure(num_workers: int, repeats: int) -> dict[str, float | int]:
    t0 = time.perf_counter()
    ray.init(num_cpus=max(4, num_workers), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    ray_init_s = time.perf_counter() - t0
    starts, teardowns = [], []
    for _ in range(repeats):
        group, pool, start_s = start_group(num_workers)
        t1 = time.perf_counter()
        group.shutdown()
        pool.release()
        teardowns.append(time.perf_counter() - t1)
        starts.append(start_s)
    ray.shutdown()
    return {
        "workers": num_workers,
        "repeats": repeats,
        "ray_init_s": round(ray_init_s, 2),
        "group_start_s_median": round(statistics.median(starts), 2),
        "group_start_s_first": round(starts[0], 2),
        "group_start_with_ray_init_s": round(ray_init_s + starts[0], 2),
        "teardown_s_median": round(statistics.median(teardowns), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps(measure(args.workers, args.repeats)))


if __name__ == "__main__":
    main()
