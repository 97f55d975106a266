"""Issue 32 item 2 on a real CUDA device: the sharded init (verl/utils/sharded_init.py) puts every
shard, buffer and broadcast buffer on the GPU, loads exactly the weights `from_pretrained` reads,
computes the same logits as the previous path (from_pretrained + FSDP2, bf16 mixed precision), and
leaves host memory flat (growth well below the fp32 model). One rank, NCCL; needs torch and
transformers only. Prints one JSON object; exit status 1 if a check fails.

    python -m scripts.gpu_checks.sharded_init                  # CUDA: NCCL, cuda:0
    python -m scripts.gpu_checks.sharded_init --device cpu     # the same checks on CPU / gloo (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist


def _rss_kib(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def run(device_type: str, hidden: int, layers: int, vocab: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from scripts.bench.model_init import build_checkpoint
    from verl.utils.fsdp_utils import apply_fsdp2, gpu_mixed_precision
    from verl.utils.model import build_causal_lm, load_causal_lm
    from verl.utils.sharded_init import load_sharded_model

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    cuda = device_type == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    mesh = init_device_mesh(device_type, (1,))
    dist.barrier()   # the communicator (and the CUDA context) exist before the host is measured
    mixed = gpu_mixed_precision() if cuda else None
    with tempfile.TemporaryDirectory(prefix="gpu_check_sharded_init_") as tmp:
        path = build_checkpoint(tmp, hidden, layers, vocab)
        before_kib = _rss_kib()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")   # VmHWM := VmRSS
        module, report = load_sharded_model(lambda: build_causal_lm(path), path, mesh, device, mixed_precision=mixed)
        host_growth_mib = (_rss_kib("VmHWM") - before_kib) / 1024
        reference = load_causal_lm(path)
        n_params = sum(p.numel() for p in reference.parameters())
        expected = {name: p.detach() for name, p in reference.named_parameters()}
        mismatched = [name for name, p in module.named_parameters()
                      if not torch.equal(p.full_tensor().cpu(), expected[name])]
        devices = sorted({str(p.to_local().device) for p in module.parameters()} |
                         {str(b.device) for b in module.buffers()})
        # The previous path on the same device and precision: the same logits, bit for bit.
        previous = apply_fsdp2(reference, mesh, mixed)
        previous.to(device)
        ids = (torch.arange(64, device=device).reshape(2, 32) * 7) % vocab
        with torch.no_grad():
            diff = float((module(input_ids=ids).logits - previous(input_ids=ids).logits).abs().max())
    dist.destroy_process_group()
    fp32_mib = n_params * 4 / 2**20
    checks = {
        "weights_equal_from_pretrained": not mismatched,
        "shards_and_buffers_on_device": devices == [str(device)],
        "broadcast_buffer_on_device": sorted(report.broadcast_devices) == [str(device)],
        "bf16_travels_as_bf16": report.broadcast_bytes * 2 == sum(
            p.numel() * 4 for p in {id(p): p for p in module.parameters()}.values()),
        "tied_embeddings_stay_tied": module.lm_head.weight is module.model.embed_tokens.weight,
        "logits_equal_previous_path": diff == 0.0,
    }
    if cuda:   # the host holds one mapped bf16 tensor at a time (on the CPU the shard is host memory)
        checks["host_growth_below_half_the_fp32_model"] = host_growth_mib < 0.5 * fp32_mib
    return {"device": str(device), "gpu": torch.cuda.get_device_name(0) if cuda else None,
            "parameters": n_params, "model_fp32_mib": round(fp32_mib, 1),
            "host_rss_growth_mib": round(host_growth_mib, 1), "logits_max_diff": diff,
            "mismatched": mismatched[:5], "devices": devices, "checks": checks, "ok": all(checks.values())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args(argv)
    summary = run(args.device, args.hidden, args.layers, args.vocab)
    print(json.dumps(summary, indent=2))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
