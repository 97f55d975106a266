"""Peak host memory of each of 2 ranks while they initialise one FSDP2 policy: the previous path
(every rank `from_pretrained` in fp32, then FSDP2) against the sharded init (meta device on every
rank, rank 0 streams the checkpoint: verl/utils/sharded_init.py).

Builds a randomly initialised Qwen2 from a config (default ~170M parameters, saved in bf16 like
Qwen2.5's checkpoints: ~340 MB on disk, ~680 MB in fp32), then for each path starts two fresh
gloo ranks on the CPU and reads, per rank, the resident set before init and its peak during init
(VmHWM after resetting it through /proc/self/clear_refs), split into anonymous memory and file
pages (the checkpoint's mapped pages, which the kernel may drop). Prints one JSON object.

    python -m scripts.bench.model_init                     # ~1 min on 2 cores, ~3 GB of RAM at peak
    python -m scripts.bench.model_init --layers 4 --hidden 512 --model_dir /tmp/bench_init_model
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

PATHS = ("from_pretrained", "sharded")


def build_checkpoint(folder: str, hidden: int, layers: int, vocab: int) -> str:
    """A random Qwen2 (tied embeddings, as Qwen2.5's small models) saved in bf16 to `folder`."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if (Path(folder) / "config.json").is_file():
        return folder
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                         num_key_value_heads=max(1, hidden // 256), tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    return folder


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _rank(rank: int, port: int, path: str, which: str, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HF_HUB_OFFLINE="1")
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from verl.utils.fsdp_utils import apply_fsdp2
    from verl.utils.model import build_causal_lm, load_causal_lm
    from verl.utils.sharded_init import load_sharded_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    dist.barrier()
    before = {"rss": _status_kib("VmRSS"), "anon": _status_kib("RssAnon"), "file": _status_kib("RssFile")}
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")   # VmHWM := VmRSS: the peak from here on
    start = time.perf_counter()
    if which == "from_pretrained":
        module = apply_fsdp2(load_causal_lm(path), mesh)
    else:
        module, _ = load_sharded_model(lambda: build_causal_lm(path), path, mesh, "cpu")
    seconds = time.perf_counter() - start
    peak = _status_kib("VmHWM")
    shard = sum(p.to_local().untyped_storage().nbytes() for p in {id(p): p for p in module.parameters()}.values())
    out.put({"rank": rank, "seconds": round(seconds, 2), "rss_before_mib": round(before["rss"] / 1024, 1),
             "peak_rss_mib": round(peak / 1024, 1), "peak_growth_mib": round((peak - before["rss"]) / 1024, 1),
             "rss_after_anon_mib": round(_status_kib("RssAnon") / 1024, 1),
             "rss_after_file_mib": round(_status_kib("RssFile") / 1024, 1),
             "shard_fp32_mib": round(shard / 2**20, 1)})
    dist.barrier()
    dist.destroy_process_group()


def measure(path: str, which: str) -> list[dict[str, Any]]:
    """Each rank's numbers for one init path, from two fresh processes."""
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, path, which, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"a rank of the {which} init exited with {p.exitcode}")
    return sorted(results, key=lambda r: r["rank"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--model_dir", default=None, help="reuse (or build once into) this folder")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_model_init_") as tmp:
        folder = build_checkpoint(args.model_dir or tmp, args.hidden, args.layers, args.vocab)
        import torch
        from safetensors import safe_open

        n_params, largest = 0, 0
        with safe_open(os.path.join(folder, "model.safetensors"), framework="pt") as f:
            for name in f.keys():
                shape = f.get_slice(name).get_shape()
                numel = int(torch.tensor(shape).prod()) if shape else 1
                n_params, largest = n_params + numel, max(largest, numel)
        summary = {"model": {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab,
                             "parameters": n_params, "fp32_mib": round(n_params * 4 / 2**20, 1),
                             "largest_tensor_fp32_mib": round(largest * 4 / 2**20, 1)},
                   **{which: measure(folder, which) for which in PATHS}}
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
