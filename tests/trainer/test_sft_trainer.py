"""The SFT trainer: per-token weights line up with segments, training lowers the loss,
the result is an HF checkpoint, and FSDP2 across two processes trains the same way."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from verl.trainer.fsdp_sft_trainer import compose_sft_config, run_sft, weighted_lm_loss
from verl.utils.dataset.sft_dataset import Segment, SFTDataset, collate_right_padded, tokenize_segments

WEIGHTS = {"prompt": 0.0, "policy": 1.0, "observation": 0.0}


def _write_sft_parquet(path: Path, n: int = 64) -> Path:
    rows = []
    for i in range(n):
        city = ["Paris", "Rome", "Oslo", "Lima"][i % 4]
        rows.append({
            "prompt": [{"role": "user", "content": f"Where is the capital {i % 4}?"}],
            "turns": [
                {"role": "policy", "text": "<think> search </think>\n<search> capital </search>"},
                {"role": "observation", "text": f"\n\n<information>Doc 1(Title: {city}) {city}\n</information>\n\n"},
                {"role": "policy", "text": f"<answer> {city} </answer>"},
            ],
        })
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path, index=False)
    return path


def test_weights_follow_the_segment_each_token_came_from(tiny_model_dir: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    segments = [Segment("prompt", "Question: who?\n"), Segment("policy", "<search> x </search>"),
                Segment("observation", "\n\n<information>Doc 1(Title: x) y\n</information>\n\n"),
                Segment("policy", "<answer> y </answer>")]
    ex = tokenize_segments(tok, segments, {"prompt": 0.25, "policy": 1.0, "observation": 0.5})
    expected_ids, expected_w = [], []
    for seg, w in zip(segments, (0.25, 1.0, 0.5, 1.0), strict=True):
        ids = tok(seg.text, add_special_tokens=False)["input_ids"]
        expected_ids += ids
        expected_w += [w] * len(ids)
    assert ex.input_ids_L.tolist() == expected_ids + [tok.eos_token_id]
    assert ex.loss_weight_L.tolist() == expected_w + [1.0]


def test_loss_is_the_weighted_mean_over_trainable_tokens(tiny_model_dir: str, tmp_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ds = SFTDataset(str(_write_sft_parquet(tmp_path / "d.parquet", 4)), tok, 1024, WEIGHTS)
    batch = collate_right_padded([ds[i] for i in range(4)], tok.pad_token_id)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    w = batch["loss_weight"][:, 1:]
    loss = weighted_lm_loss(model, batch, float(w.sum()))
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"]).logits[:, :-1]
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["input_ids"][:, 1:], reduction="none")
    # Both sides sum the same ~100 fp32 CE terms (each ~log V ~ 6) in different orders: pairwise
    # summation errs by ~log2(N)*eps ~ 1e-6 relative, on any CPU; rtol 1e-5 keeps a 10x margin,
    # while one wrongly weighted token moves the mean by ~1/N ~ 1e-2.
    torch.testing.assert_close(loss, ce[w > 0].mean(), rtol=1e-5, atol=0.0)
    # Observation tokens carry no weight: their targets do not move the loss.
    assert 0 < int((w > 0).sum()) < int(batch["attention_mask"][:, 1:].sum())


def test_the_head_runs_only_where_some_row_has_a_weighted_target(tiny_model_dir: str, tmp_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ds = SFTDataset(str(_write_sft_parquet(tmp_path / "d.parquet", 4)), tok, 1024, WEIGHTS)
    batch = collate_right_padded([ds[i] for i in range(4)], tok.pad_token_id)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    positions = []
    model.lm_head.register_forward_hook(lambda module, args, out: positions.append(args[0].shape[1]))
    weighted_lm_loss(model, batch, 1.0)
    w = batch["loss_weight"][:, 1:]
    assert positions == [int((w != 0).any(dim=0).sum())]
    assert positions[0] < w.shape[1] - 1       # the prompt and observations (weight 0) are never scored

    class WithoutLogitsToKeep(torch.nn.Module):   # a model class whose forward lacks the keyword
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, position_ids, use_cache):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              use_cache=use_cache)

    torch.testing.assert_close(weighted_lm_loss(WithoutLogitsToKeep(model), batch, 1.0),
                               weighted_lm_loss(model, batch, 1.0), rtol=1e-5, atol=0.0)


def _overrides(data: Path, model: str, out: Path, steps: int) -> list[str]:
    return [f"data.train_files={data}", "data.train_batch_size=8", "data.micro_batch_size_per_gpu=4",
            f"model.partial_pretrain={model}", "optim.lr=1e-2", "optim.warmup_steps_ratio=0.1",
            f"trainer.total_training_steps={steps}", f"trainer.default_local_dir={out}",
            "trainer.logger=[console,jsonl]", "trainer.log_freq=1", "trainer.device=cpu", "trainer.num_threads=1"]


def test_training_lowers_the_loss_and_saves_a_loadable_hf_checkpoint(tiny_model_dir: str, tmp_path: Path) -> None:
    data = _write_sft_parquet(tmp_path / "sft.parquet")
    cfg = compose_sft_config(_overrides(data, tiny_model_dir, tmp_path / "out", steps=30))
    result = run_sft(cfg)
    losses = [h["train/loss"] for h in result.history]
    assert result.steps == 30 and len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5
    assert (tmp_path / "out" / "logs" / "metrics.jsonl").exists()
    trained = AutoModelForCausalLM.from_pretrained(result.checkpoint_dir)
    init = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert any((result.checkpoint_dir / f).exists() for f in ("model.safetensors",))
    assert AutoTokenizer.from_pretrained(result.checkpoint_dir).pad_token == "<|pad|>"
    key = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(trained.state_dict()[key], init.state_dict()[key])


def test_a_missing_column_names_the_row(tiny_model_dir: str, tmp_path: Path) -> None:
    path = tmp_path / "bad.parquet"
    pd.DataFrame([{"prompt": "hi"}]).to_parquet(path)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    with pytest.raises(KeyError, match="row 0.*'response'"):
        SFTDataset(str(path), tok, 64, WEIGHTS)


def test_fsdp2_on_two_processes_trains_and_saves(tiny_model_dir: str, tmp_path: Path) -> None:
    data = _write_sft_parquet(tmp_path / "sft.parquet")
    out = tmp_path / "fsdp"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "verl.trainer.fsdp_sft_trainer", *_overrides(data, tiny_model_dir, out, steps=4),
           f"hydra.run.dir={tmp_path / 'hydra'}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SFT done: 4 steps" in proc.stdout
    model = AutoModelForCausalLM.from_pretrained(out / "huggingface")
    init = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    key = "model.embed_tokens.weight"
    assert model.state_dict()[key].shape == init.state_dict()[key].shape
    assert not torch.equal(model.state_dict()[key], init.state_dict()[key])


# --- the multi-GPU contract (issue 13 item 10), pinned on CPU -------------------------------

def test_cuda_device_is_the_local_rank_and_is_made_current(monkeypatch: pytest.MonkeyPatch) -> None:
    from verl.trainer import fsdp_sft_trainer

    made_current: list[int] = []
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert fsdp_sft_trainer._pick_device("cuda") == torch.device("cuda", 3)
    # Without set_device, FSDP2 and NCCL put every torchrun rank on cuda:0.
    assert made_current == [3]


class _Reduced(Exception):
    pass


def test_cross_rank_sums_hand_the_collective_a_tensor_on_the_trainer_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from verl.trainer import fsdp_sft_trainer

    devices: list[torch.device] = []

    def all_reduce(tensor: torch.Tensor, *args, **kwargs) -> None:
        devices.append(tensor.device)
        raise _Reduced   # a meta tensor has no value to read back; the device is what is checked

    monkeypatch.setattr(fsdp_sft_trainer.dist, "all_reduce", all_reduce)
    # "meta" stands in for "cuda": an NCCL group refuses a CPU tensor, so the sum must be made on the device.
    with pytest.raises(_Reduced):
        fsdp_sft_trainer._global_sum(2.0, torch.device("meta"), world_size=2)
    assert devices == [torch.device("meta")]
    assert fsdp_sft_trainer._global_sum(2.5, torch.device("meta"), world_size=1) == 2.5   # no collective


def test_gpu_process_groups_carry_a_cpu_backend_too() -> None:
    from verl.utils.device import dist_backend_for

    assert dist_backend_for("cuda") == "cpu:gloo,cuda:nccl"
    assert dist_backend_for(torch.device("cuda", 1)) == "cpu:gloo,cuda:nccl"
    assert dist_backend_for("cpu") == "gloo"
