"""The loader's name map (verl/utils/checkpoint/name_map.py) against transformers' own conversion:
transformers 5 fuses MoE experts on load and splits them back on save; the sharded load must read
what `save_pretrained` wrote into the fused parameters `from_pretrained` builds, and the export must
write what `save_pretrained` writes.

Default suite: the map and the export in one process for each MoE family; FSDP2's own shard of a
fused parameter against `_copy_piece_into` at 3 and 4 ranks (torch's fake process group, as
tests/utils/test_sharded_init_ranks.py does); and the whole sharded load of tiny Qwen3 (dense) and
Qwen3-MoE in this process, a gloo world of one. Slow: the sharded load on two real gloo ranks for
Qwen3, Qwen3-MoE, Qwen2-MoE (its shared expert) and Mixtral (block_sparse_moe, w1/w3/w2), and the
critic over Qwen3-MoE (one spawn).
"""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from tests.conftest import free_port, run_ranks
from verl.utils import sharded_init
from verl.utils.checkpoint.name_map import EXPERT_LAYOUTS, NameMap, Piece
from verl.utils.tiny_model import (
    MOE_ARCHITECTURES,
    build_tiny_model,
    save_model_and_tokenizer,
    train_bpe_tokenizer,
)


def _saved(path: Path, arch: str, dtype: torch.dtype = torch.float32, **kwargs: Any) -> Path:
    tok = train_bpe_tokenizer()
    return save_model_and_tokenizer(build_tiny_model(tok, arch, **kwargs).to(dtype), tok, path)


def _stored(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_the_export_writes_what_save_pretrained_writes_and_the_map_reads_it_back(arch: str, tmp_path: Path) -> None:
    from verl.utils.checkpoint.hf_export import export_hf_model

    folder = _saved(tmp_path / "hf", arch)
    model = __import__("transformers").AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert any(".experts.gate_up_proj" in name for name, _ in model.named_parameters())   # fused in memory
    export_hf_model(model, None, str(tmp_path / "ours"))
    theirs, ours = _stored(folder), _stored(tmp_path / "ours")
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    # Every fused parameter is made of stored pieces, each filling its expert's rows exactly once.
    names_map = NameMap.of(model.config)
    for name, param in model.named_parameters():
        pieces = names_map.pieces(name, tuple(param.shape), theirs)
        if ".experts." not in name:
            assert pieces is None and any(c in theirs for c in names_map.candidates(name)), name
            continue
        assert pieces is not None, name
        rebuilt = torch.full_like(param, float("nan"))
        for piece in pieces:
            region = rebuilt[piece.expert] if piece.rows is None else rebuilt[piece.expert, piece.rows[0]:piece.rows[1]]
            region.copy_(theirs[piece.name])
        assert torch.equal(rebuilt, param.detach()), name


def test_a_missing_expert_piece_is_missing_and_an_unknown_fused_family_is_refused_by_name() -> None:
    names = NameMap("qwen3_moe", EXPERT_LAYOUTS["qwen3_moe"])
    stored = {f"model.layers.0.mlp.experts.{e}.{p}.weight" for e in range(4) for p in ("gate_proj", "up_proj")}
    assert names.pieces("model.layers.0.mlp.experts.gate_up_proj", (4, 8, 4), stored) is not None
    stored.discard("model.layers.0.mlp.experts.3.up_proj.weight")
    assert names.pieces("model.layers.0.mlp.experts.gate_up_proj", (4, 8, 4), stored) is None
    with pytest.raises(ValueError, match="model type 'new_moe'.*EXPERT_LAYOUTS"):
        NameMap("new_moe", None).pieces("model.layers.0.mlp.experts.down_proj", (4, 4, 4), stored)


# ----------------------------------------------------------------------------- FSDP2's expert shards

@contextmanager
def _as_rank(rank: int, world: int) -> Iterator[Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized(), "a process group left initialised by an earlier test"
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [3, 4])
def test_each_rank_copies_the_experts_fsdp2_holds_there(world: int) -> None:
    """5 experts: over 3 ranks 2, 2, 1; over 4 ranks 2, 2, 1, 0 (torch.chunk's split, FSDP2's)."""
    from torch.distributed.fsdp import fully_shard

    experts, rows, cols = 5, 6, 3
    torch.manual_seed(0)
    full = torch.randn(experts, rows, cols)
    stored = {f"e{e}.{half}": full[e, h * 3:(h + 1) * 3].clone() for e in range(experts)
              for h, half in enumerate(("gate", "up"))}
    pieces = [Piece(f"e{e}.{half}", e, (h * 3, (h + 1) * 3)) for e in range(experts)
              for h, half in enumerate(("gate", "up"))]
    held_rows = []
    for rank in range(world):
        with _as_rank(rank, world):
            module = torch.nn.Module()
            module.experts = torch.nn.Parameter(full.clone())
            fully_shard(module)
            held = module.experts.to_local().detach().clone()
            with torch.no_grad():
                module.experts.to_local().fill_(float("nan"))
                for piece in pieces:
                    sharded_init._copy_piece_into(module.experts, stored[piece.name], piece, "experts")
            assert torch.equal(module.experts.to_local(), held), (world, rank)
            held_rows.append(len(held))
    assert held_rows == [len(c) for c in torch.chunk(full, world)] + [0] * (world - len(torch.chunk(full, world)))


# ----------------------------------------------------------------------------- two real gloo ranks

def _rank_main(rank: int, port: int, cases: dict[str, tuple[str, str]], out_dir: str, world: int = 2) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if world > 1:
            torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        from torch.distributed.device_mesh import init_device_mesh

        from verl.utils.model import build_causal_lm, build_value_model, load_causal_lm, load_value_model

        mesh = init_device_mesh("cpu", (world,))
        results = {}
        for case, (role, path) in cases.items():
            torch.manual_seed(0)
            if role == "critic":
                reference, build = load_value_model(path), (lambda p=path: build_value_model(p))
            else:
                reference, build = load_causal_lm(path), (lambda p=path: build_causal_lm(p))
            module, report = sharded_init.load_sharded_model(build, path, mesh, "cpu")
            expected = dict(reference.named_parameters())
            mismatched = [n for n, p in module.named_parameters() if not torch.equal(p.full_tensor(), expected[n])]
            ids = torch.arange(12).reshape(2, 6) % module.config.vocab_size
            out, ref_out = module(input_ids=ids), reference(input_ids=ids)
            key = "logits"
            results[case] = {
                "mismatched": mismatched, "names": sorted(expected) == sorted(dict(module.named_parameters())),
                "max_diff": float((getattr(out, key) - getattr(ref_out, key)).abs().max()),
                "loaded": report.loaded,
                "largest_fused": max([p.numel() for n, p in module.named_parameters() if ".experts." in n], default=0),
                "local_experts": {n: p.to_local().shape[0] for n, p in module.named_parameters() if ".experts." in n}}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()
    except Exception:
        Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def _spawn(cases: dict[str, tuple[str, str]], out: Path) -> list[dict[str, Any]]:
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    run_ranks(_rank_main, lambda r: (r, port, cases, str(out)), out, timeout=400)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _assert_equal_to_from_pretrained(found: list[dict[str, Any]], case: str, stored: set[str],
                                     experts_per_rank: int) -> None:
    for rank, per_rank in enumerate(found):
        result = per_rank[case]
        assert result["mismatched"] == [] and result["names"], (case, rank, result["mismatched"])
        assert result["max_diff"] == 0.0, (case, rank, result["max_diff"])
        # Only stored tensors travel (per expert: never a fused one), each once, and every one of them.
        assert sorted(result["loaded"]) == sorted(stored), case
        if result["largest_fused"]:
            assert set(result["local_experts"].values()) == {experts_per_rank}, result["local_experts"]


def _one_rank_load(cases: dict[str, tuple[str, str]]) -> list[dict[str, Any]]:
    """`_rank_main`'s findings with this process as a world of one (gloo): the name map's path
    (pieces read, copied into the fused parameters) without a spawn; the split between ranks is
    test_each_rank_copies_the_experts_fsdp2_holds_there's and the slow test's."""
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        assert not dist.is_initialized(), "a process group left initialised by an earlier test"
        try:
            _rank_main(0, free_port(), cases, out, world=1)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        return [json.loads(Path(out, "rank0.json").read_text())]


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_the_sharded_load_equals_from_pretrained(arch: str, tmp_path: Path) -> None:
    folder = _saved(tmp_path / arch, arch, torch.bfloat16)
    found = _one_rank_load({arch: ("actor", str(folder))})
    _assert_equal_to_from_pretrained(found, arch, set(_stored(folder)), experts_per_rank=4)


@pytest.mark.slow   # a two-rank spawn, five models: ~2-3 min on a busy 2-core machine
def test_the_sharded_load_over_two_ranks_equals_from_pretrained_for_each_family_and_the_critic(tmp_path: Path) -> None:
    folders = {arch: _saved(tmp_path / arch, arch, torch.bfloat16) for arch in ("qwen3", *MOE_ARCHITECTURES)}
    cases = {arch: ("actor", str(folder)) for arch, folder in folders.items()}
    cases["critic"] = ("critic", str(folders["qwen3_moe"]))
    found = _spawn(cases, tmp_path / "out")
    for arch, folder in folders.items():
        _assert_equal_to_from_pretrained(found, arch, set(_stored(folder)), experts_per_rank=2)
    stored = set(_stored(folders["qwen3_moe"]))
    for rank in range(2):
        assert found[rank]["critic"]["mismatched"] == [], found[rank]["critic"]
        assert set(found[rank]["critic"]["loaded"]) <= stored
