"""Each rank's slice of a full tensor is the one FSDP2 gives it, at 3 and 4 ranks (issue 43 item 12).

The sharded load (verl/utils/sharded_init.py `_copy_into`) and the starting-adapter reference
(verl/utils/lora.py `_shard_of`) cut a full tensor into this rank's FSDP2 shard themselves. At 2 ranks
every dim-0 split agrees (torch.chunk, tensor_split, ...); with 10 rows over 4 ranks FSDP2 holds
3, 3, 3, 1 (torch.chunk's sizes) where tensor_split cuts 3, 3, 2, 2, and 5 rows over 4 leave the
last rank none. Default suite: FSDP2's `fully_shard` on a real module, in this process, as rank r of a
3- or 4-rank world, over torch's fake process group (`fully_shard` computes its shard locally, without
a collective): what it holds is what the slice must be. Slow: the tiny model loaded over three real
gloo ranks against FSDP2's sharding of from_pretrained's model.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.conftest import free_port, run_ranks
from verl.utils import sharded_init
from verl.utils.lora import _shard_of


@contextmanager
def _as_rank(rank: int, world: int) -> Iterator[Any]:
    """This process as rank `rank` of `world` (torch's fake process group); the 1-D mesh over it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized(), "a process group left initialised by an earlier test"
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()


def _module() -> nn.Module:
    """First dimensions 10 (over 3: 4, 4, 2; over 4: 3, 3, 3, 1), 5 (over 4: 2, 2, 1, 0) and 7."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 10), nn.Linear(10, 5), nn.Embedding(7, 3))


def _fsdp2_shards(world: int) -> list[dict[str, dict[str, torch.Tensor]]]:
    """Per rank, by parameter name: the full tensors ("full"), what FSDP2's fully_shard holds on that
    rank ("held"), what `_copy_into` copies into the zeroed shard ("copied"), what `_shard_of` cuts."""
    from torch.distributed.fsdp import fully_shard

    out = []
    for rank in range(world):
        with _as_rank(rank, world) as mesh:
            module = _module()
            full = {name: p.detach().clone() for name, p in module.named_parameters()}
            fully_shard(module, mesh=mesh)
            held = {name: p.to_local().detach().clone() for name, p in module.named_parameters()}
            copied, adapter_pieces = {}, {}
            with torch.no_grad():
                for name, param in module.named_parameters():
                    param.to_local().zero_()
                    sharded_init._copy_into(param, full[name], name)
                    copied[name] = param.to_local().detach().clone()
                    adapter_pieces[name] = _shard_of(param, full[name]).clone()
            out.append({"full": full, "held": held, "copied": copied, "shard_of": adapter_pieces})
    return out


@pytest.mark.parametrize("world", [3, 4])
def test_every_rank_copies_the_rows_fsdp2_holds_there_for_uneven_first_dimensions(world):
    ranks = _fsdp2_shards(world)
    rows = {name: [len(r["held"][name]) for r in ranks] for name in ranks[0]["full"]}
    # The case discriminates: some first dimension is split otherwise than by tensor_split.
    assert any(sizes != [len(piece) for piece in torch.tensor_split(ranks[0]["full"][name], world)]
               for name, sizes in rows.items()), rows
    for rank, found in enumerate(ranks):
        for name, held in found["held"].items():
            assert torch.equal(found["copied"][name], held), (world, rank, name, rows[name])
            assert torch.equal(found["shard_of"][name], held), (world, rank, name, rows[name])
    # Together the shards are the whole tensor, each row once.
    for name, full in ranks[0]["full"].items():
        torch.testing.assert_close(torch.cat([r["held"][name] for r in ranks]), full, rtol=0, atol=0)


# ----------------------------------------------------------------------------- three real gloo ranks

def _three_rank_load(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=3)
        from torch.distributed.device_mesh import init_device_mesh

        from verl.utils.fsdp_utils import apply_fsdp2
        from verl.utils.model import build_causal_lm, load_causal_lm

        mesh = init_device_mesh("cpu", (3,))
        module, _ = sharded_init.load_sharded_model(lambda: build_causal_lm(model_dir), model_dir, mesh, "cpu")
        reference = apply_fsdp2(load_causal_lm(model_dir), mesh)   # FSDP2's own shards of from_pretrained
        expected = dict(reference.named_parameters())
        uneven = [name for name, p in module.named_parameters() if p.shape[0] % 3]
        assert uneven, "no first dimension that 3 does not divide: the case would not discriminate"
        for name, param in module.named_parameters():
            assert torch.equal(param.to_local(), expected[name].to_local()), (rank, name, tuple(param.shape))
        dist.destroy_process_group()
    except Exception:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


@pytest.mark.slow   # three spawned ranks importing transformers: ~2 min on a busy 2-core machine
def test_three_gloo_ranks_load_the_shards_fsdp2_makes_of_from_pretrained(tiny_model_dir, tmp_path):
    port = free_port()
    run_ranks(_three_rank_load, lambda r: (r, port, tiny_model_dir, str(tmp_path)), tmp_path, world=3, timeout=400)
