"""Processes of a small weight push for tests/workers/test_weight_sync.py: train ranks 0 and 1 (FSDP2
over their own gloo world) send, rank 2 (outside that world, like a rollout rank) receives into a
plain module. Spawned with torch.multiprocessing, so it lives in an importable module."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist


def run_rank(rank: int, train_port: int, sync_port: int, model_dir: str, dtype_name: str, out_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    from verl.utils.fsdp_utils import apply_fsdp2, full_tensor
    from verl.workers.weight_sync import (
        WeightSyncGroup,
        check_module_takes,
        push_manifest,
        push_state,
        receive_into_module,
        send_state,
    )

    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    out = Path(out_dir)
    if rank < 2:   # the train pool
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(train_port))
        dist.init_process_group("gloo", rank=rank, world_size=2)
        from torch.distributed.device_mesh import init_device_mesh

        actor = apply_fsdp2(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                            init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",)))
        manifest = push_manifest(actor, dtype)
        group = WeightSyncGroup("127.0.0.1", sync_port, 0, 2, "cpu") if rank == 0 else None
        sent = send_state(group, push_state(actor), manifest, "cpu")
        # what the receiver must hold: each full fp32 tensor, cast after the gather
        expected = {name: full_tensor(t).to(dtype) for name, t in push_state(actor)}
        if rank == 0:
            torch.save({"sent": sent, "expected": expected, "names": [s.name for s in manifest.tensors]},
                       out / "sender.pt")
        dist.destroy_process_group()
    else:          # a rollout rank: a plain module in the engine's dtype, its weights zeroed first
        engine = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        with torch.no_grad():
            for p in engine.parameters():
                p.zero_()
        manifest = push_manifest(engine, dtype)
        check_module_takes(manifest, engine, "cpu")
        written = receive_into_module(WeightSyncGroup("127.0.0.1", sync_port, 1, 2, "cpu"), manifest, engine)
        torch.save({"written": written, "state": {k: v.clone() for k, v in engine.state_dict().items()}},
                   out / "receiver.pt")
