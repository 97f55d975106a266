"""A LoRA actor's checkpoint holds its adapter, not the model (issue 43 item 12; default suite).

FSDPCheckpointManager with a LoraSpec (verl/utils/checkpoint/fsdp_checkpoint_manager.py) writes the
adapter and its optimizer state: the frozen base is model.path's, loaded again at start-up, and a
checkpoint holding it too would cost the whole model's size per save while still round-tripping. One
process, the tiny model with PEFT's adapters (a trained one: lora_B != 0) and an AdamW step; the
checkpoint's own metadata says what it holds. (The FSDP2 workers' LoRA checkpoint over Ray:
tests/workers/test_lora_actor.py, slow.)
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed.checkpoint as dcp
from transformers import AutoModelForCausalLM

from verl.utils.checkpoint.fsdp_checkpoint_manager import DCP_DIR, FSDPCheckpointManager
from verl.utils.lora import LoraSpec, is_adapter_param

torch.set_num_threads(1)
SPEC = LoraSpec(rank=4, alpha=8, target_modules="all-linear")
IDS = torch.tensor([[3, 17, 42, 5, 9, 11, 2, 8]])


def _lora_model(model_dir: str, seed: int) -> torch.nn.Module:
    """The tiny model with the adapter initialised as the sharded load does, then lora_B drawn from `seed`."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    SPEC.inject(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, module in model.named_modules():
            if SPEC.init_adapter(name, module) and ".lora_B." in name + ".":
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * 0.1)
    return model


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(input_ids=IDS, labels=IDS).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_a_lora_checkpoint_holds_the_adapter_and_its_optimizer_state_and_resumes(tiny_model_dir, tmp_path):
    model = _lora_model(tiny_model_dir, seed=0)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    _step(model, optimizer)
    saved = _state(model)
    adapter = {name for name in saved if is_adapter_param(name)}
    adapter_bytes = sum(saved[name].numel() * 4 for name in adapter)
    with warnings.catch_warnings():   # DCP warns that it runs without a process group
        warnings.simplefilter("ignore")
        FSDPCheckpointManager(model, optimizer, lora=SPEC, base_model_path=tiny_model_dir).save_checkpoint(
            str(tmp_path / "actor"), global_step=7)
    stored = dcp.FileSystemReader(str(tmp_path / "actor" / DCP_DIR)).read_metadata().state_dict_metadata
    model_keys = {key.removeprefix("model.") for key in stored if key.startswith("model.")}
    assert model_keys == adapter, sorted(model_keys - adapter)[:5]
    # optimizer.state.<parameter>.<exp_avg | exp_avg_sq | step>: the adapter's, each of them
    state_of = {key.removeprefix("optimizer.state.").rpartition(".")[0] for key in stored
                if key.startswith("optimizer.state.")}
    assert state_of == adapter, sorted(state_of ^ adapter)[:5]
    assert {key.partition(".")[0] for key in stored} == {"model", "optimizer"}
    # What the checkpoint's model part weighs: the adapter's fp32 bytes, not the model's.
    model_bytes = sum(stored[f"model.{name}"].size.numel() * 4 for name in model_keys)
    assert model_bytes == adapter_bytes < sum(v.numel() * 4 for v in saved.values()) / 4

    # A fresh actor (another adapter) resumes: the adapter and its optimizer state come back, the base
    # stays model.path's, and the next step is the one the saved actor takes.
    _step(model, optimizer)
    after = _state(model)
    fresh = _lora_model(tiny_model_dir, seed=1)
    fresh_optimizer = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = FSDPCheckpointManager(fresh, fresh_optimizer, lora=SPEC,
                                     base_model_path=tiny_model_dir).load_checkpoint(str(tmp_path / "actor"))
    assert step == 7
    for name, value in _state(fresh).items():
        assert torch.equal(value, saved[name]), name
    _step(fresh, fresh_optimizer)
    for name, value in _state(fresh).items():
        assert torch.equal(value, after[name]), f"{name} diverged after a step: optimizer state lost"
