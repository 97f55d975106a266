"""LoRA's pieces without workers (verl/utils/lora.py, verl/trainer/config_lora.py): PEFT's adapters
injected, the base frozen, the adapter off = the base, merged weights = PEFT's merge, the exported
adapter = what PeftModel.from_pretrained reads, and the config rules naming their keys.
(The FSDP2 workers with LoRA: tests/workers/test_lora_actor.py, slow.)"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from verl.trainer.config_check import config_errors
from verl.trainer.main_ppo import compose_config
from verl.utils.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    LoraSpec,
    adapter_disabled,
    adapter_state,
    is_adapter_param,
    merged_state,
    save_adapter,
)

torch.set_num_threads(1)
IDS = torch.tensor([[3, 17, 42, 5, 9, 11, 2, 8]])


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _injected(model_dir: str, spec: LoraSpec, seed: int = 0) -> torch.nn.Module:
    """The tiny model with `spec`'s adapters, initialised as the sharded load does, then B randomised
    (a trained adapter: with B = 0 every check below would pass for any code)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    spec.inject(model)
    generator = torch.Generator().manual_seed(seed)
    for name, module in model.named_modules():
        if spec.init_adapter(name, module):
            with torch.no_grad():
                assert float(module.weight.abs().sum()) == 0.0 or ".lora_A." in name + "."
                if ".lora_B." in name + ".":
                    module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * 0.1)
    return model


def test_inject_freezes_the_base_and_the_adapter_off_is_the_base(tiny_model_dir):
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    spec = LoraSpec(rank=4, alpha=8, target_modules="all-linear")
    fresh = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    spec.inject(fresh)
    for name, module in fresh.named_modules():
        spec.init_adapter(name, module)
    # lora_B = 0 at the start: the adapted model computes the base model exactly.
    torch.testing.assert_close(_logits(fresh), _logits(base), rtol=0, atol=0)
    trainable = [n for n, p in fresh.named_parameters() if p.requires_grad]
    assert trainable and all(is_adapter_param(n) for n in trainable)
    assert len(trainable) == 2 * 7 * 2   # 2 layers x 7 projections x (A, B); lm_head left out

    model = _injected(tiny_model_dir, spec)
    assert float((_logits(model) - _logits(base)).abs().max()) > 1e-3
    with adapter_disabled(model):
        torch.testing.assert_close(_logits(model), _logits(base), rtol=0, atol=0)
    assert float((_logits(model) - _logits(base)).abs().max()) > 1e-3   # back on after the block


def test_frozen_base_in_the_compute_dtype_and_target_list():
    from verl.utils.tiny_model import build_tiny_qwen2, train_bpe_tokenizer

    model = build_tiny_qwen2(train_bpe_tokenizer())
    LoraSpec(rank=2, alpha=4, target_modules=["q_proj", "v_proj"]).inject(model, frozen_dtype=torch.bfloat16)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert {d for n, d in dtypes.items() if is_adapter_param(n)} == {torch.float32}
    assert {d for n, d in dtypes.items() if not is_adapter_param(n)} == {torch.bfloat16}
    assert {n.split(".")[-4] for n in dtypes if is_adapter_param(n)} == {"q_proj", "v_proj"}
    with pytest.raises(ValueError, match="target_modules.*matched no module"):
        LoraSpec(rank=2, alpha=4, target_modules=["no_such_proj"]).inject(build_tiny_qwen2(train_bpe_tokenizer()))


def test_merged_weights_and_exported_adapter_match_peft(tiny_model_dir, tmp_path):
    from peft import PeftModel

    spec = LoraSpec(rank=4, alpha=8, target_modules="all-linear")
    model = _injected(tiny_model_dir, spec)
    expected = _logits(model)

    merged = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    state = dict(merged_state(model))
    assert not any(is_adapter_param(n) or ".base_layer." in n for n in state)
    merged.load_state_dict(state, strict=False)
    torch.testing.assert_close(_logits(merged), expected, rtol=1e-5, atol=1e-5)

    save_adapter(adapter_state(model), spec, tiny_model_dir, str(tmp_path))
    assert (tmp_path / ADAPTER_CONFIG).is_file() and (tmp_path / ADAPTER_WEIGHTS).is_file()
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                                           str(tmp_path))
    torch.testing.assert_close(_logits(peft_model), expected, rtol=1e-5, atol=1e-5)
    # PEFT's own merge agrees with ours.
    torch.testing.assert_close(_logits(peft_model.merge_and_unload()), expected, rtol=1e-5, atol=1e-5)

    # lora_adapter_path: rank / alpha / targets come from the saved adapter, its weights initialise.
    spec2 = LoraSpec.from_model_config({"lora_rank": 1, "lora_alpha": 1, "lora_adapter_path": str(tmp_path)})
    assert (spec2.rank, spec2.alpha) == (4, 8.0)
    reloaded = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    spec2.inject(reloaded)
    for name, module in reloaded.named_modules():
        spec2.init_adapter(name, module)
    torch.testing.assert_close(_logits(reloaded), expected, rtol=0, atol=0)


@pytest.mark.parametrize(("overrides", "message"), [
    (["actor_rollout_ref.model.lora_rank=-1"], "actor_rollout_ref.model.lora_rank=-1 must be an int >= 0"),
    (["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=0"],
     "actor_rollout_ref.model.lora_alpha=0 must be a number > 0"),
    (["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.target_modules=[]"],
     "actor_rollout_ref.model.target_modules=[] names no module"),
    (["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_adapter_path=/no/such/adapter"],
     "lora_adapter_path='/no/such/adapter' has no adapter_config.json / adapter_model.safetensors"),
    (["actor_rollout_ref.model.lora_adapter_path=/x"], "lora_adapter_path='/x' is set but "
                                                        "actor_rollout_ref.model.lora_rank=0"),
    (["critic.model.lora_rank=8"], "critic.model.lora_rank=8: critic LoRA is not supported yet"),
    (["actor_rollout_ref.model.lora_rank=8", "trainer.pipeline=one_step_off", "trainer.rollout_pool=1",
      "actor_rollout_ref.model.lora_adapter_path=/no/such/adapter"],
     "lora_adapter_path='/no/such/adapter' with trainer.pipeline=one_step_off: the rollout pool's first rollout"),
    (["trainer.save_merged_lora=true"], "trainer.save_merged_lora=True exports a LoRA model merged"),
])
def test_lora_config_rules_name_the_key(overrides, message):
    errors = config_errors(compose_config(overrides))
    assert any(message in e for e in errors), errors


def test_lora_config_valid():
    assert config_errors(compose_config(["actor_rollout_ref.model.lora_rank=64", "actor_rollout_ref.model.lora_alpha=32",
                                         "actor_rollout_ref.model.target_modules=[q_proj,v_proj]"])) == []


@pytest.mark.parametrize("extra", [
    ["trainer.pipeline=one_step_off"],
    ["trainer.pipeline=async", "actor_rollout_ref.rollout.name=vllm"],
    ["trainer.pipeline=async", "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.lora_sync=merged"],
])
def test_lora_composes_with_the_pipelines(extra):
    # the push carries the adapter (vLLM, lora_sync=adapter) or the merged weights (verl/workers/lora_push.py)
    errors = config_errors(compose_config(["actor_rollout_ref.model.lora_rank=8", "trainer.n_gpus_per_node=2",
                                           "trainer.rollout_pool=1", *extra]))
    assert errors == []


def test_infer_loads_an_adapter_folder_with_its_base(tiny_model_dir, tmp_path):
    from infer import adapter_base, load_model

    spec = LoraSpec(rank=4, alpha=8, target_modules="all-linear")
    model = _injected(tiny_model_dir, spec, seed=1)
    save_adapter(adapter_state(model), spec, tiny_model_dir, str(tmp_path))
    assert adapter_base(str(tmp_path)) == tiny_model_dir and adapter_base(tiny_model_dir) is None
    loaded, tokenizer = load_model(str(tmp_path), "cpu")   # no tokenizer in the folder: the base's
    assert len(tokenizer) > 0
    torch.testing.assert_close(_logits(loaded), _logits(model), rtol=1e-5, atol=1e-5)
