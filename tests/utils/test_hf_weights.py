"""Reading a Hugging Face folder's weights one tensor at a time (verl/utils/checkpoint/hf_weights.py)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from verl.utils.checkpoint.hf_export import export_hf_model
from verl.utils.checkpoint.hf_weights import HFWeights, TensorMeta
from verl.utils.tiny_model import build_tiny_qwen2, train_bpe_tokenizer


@pytest.fixture(scope="module")
def bf16_model():
    tok = train_bpe_tokenizer()
    return build_tiny_qwen2(tok, tie_word_embeddings=False).to(torch.bfloat16), tok


def _expected(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach() for name, t in model.state_dict().items()}


def test_reads_the_shards_and_index_this_project_exports(bf16_model, tmp_path):
    model, tok = bf16_model
    export_hf_model(model, tok, str(tmp_path), max_shard_mb=0.05)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "the export should have written several shards"
    weights = HFWeights.open(str(tmp_path))
    expected = _expected(model)
    assert weights.kind == "safetensors"
    assert weights.manifest() == {n: TensorMeta(torch.bfloat16, tuple(t.shape)) for n, t in expected.items()}
    for name, tensor in expected.items():
        got = weights.read(name)
        assert got.dtype == torch.bfloat16 and torch.equal(got, tensor), name


def test_reads_a_single_file_and_bin_files_in_their_stored_dtype(bf16_model, tmp_path):
    model, tok = bf16_model
    model.save_pretrained(tmp_path / "st")
    expected = _expected(model)
    single = HFWeights.open(str(tmp_path / "st"))
    assert set(single.manifest()) == set(load_file(tmp_path / "st" / "model.safetensors"))
    # .bin, sharded with an index: each shard is mapped when first read, one at a time.
    names = sorted(expected)
    half = len(names) // 2
    (tmp_path / "bin").mkdir()
    weight_map = {}
    for part, chunk in enumerate((names[:half], names[half:]), start=1):
        file_name = f"pytorch_model-{part:05d}-of-00002.bin"
        torch.save({n: expected[n].clone() for n in chunk}, tmp_path / "bin" / file_name)
        weight_map.update(dict.fromkeys(chunk, file_name))
    (tmp_path / "bin" / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    weights = HFWeights.open(str(tmp_path / "bin"))
    assert weights.kind == "bin"
    assert weights.manifest() == single.manifest()
    for name in names:
        assert torch.equal(weights.read(name), expected[name]), name


def test_a_folder_without_weights_or_with_a_broken_index_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model weights"):
        HFWeights.open(str(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "gone.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="gone.safetensors.*missing"):
        HFWeights.open(str(tmp_path)).manifest()
