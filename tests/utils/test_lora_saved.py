"""Continuing from an adapter PEFT saved (`actor_rollout_ref.model.lora_adapter_path`, verl/utils/lora.py):
the actor's adapter is rebuilt from the folder's adapter_config.json as PeftModel.from_pretrained rebuilds
it (rsLoRA's alpha / sqrt(r), DoRA's magnitude, rank / alpha patterns, the layer selection), so its
log-probs, its merged weights and its re-export are PEFT's; what it cannot rebuild is refused by name, at
the config check and at load. LoRA on embed_tokens / lm_head is refused in every mode. (The sharded load
on 2 ranks and the starting adapter as reference: tests/utils/test_lora_fsdp.py.)"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from verl.trainer.config_check import config_errors
from verl.trainer.main_ppo import compose_config
from verl.utils.lora import (
    ADAPTER_CONFIG,
    SAVED_FIELDS_BUILT,
    SAVED_FIELDS_IGNORED,
    SAVED_FIELDS_REFUSED,
    LoraSpec,
    adapter_state,
    merged_state,
    save_adapter,
)

torch.set_num_threads(1)
IDS = torch.tensor([[3, 17, 42, 5, 9, 11, 2, 8], [7, 7, 30, 1, 60, 4, 12, 99]])

# each a PEFT LoraConfig whose scale or shape the old loader (r and lora_alpha only) got wrong
SAVED = {
    "rslora": {"r": 16, "lora_alpha": 16, "use_rslora": True, "target_modules": "all-linear"},   # x4, not x1
    "dora": {"r": 4, "lora_alpha": 8, "use_dora": True, "target_modules": ["q_proj", "v_proj", "down_proj"]},
    "patterns": {"r": 4, "lora_alpha": 8, "target_modules": "all-linear",
                 "rank_pattern": {"q_proj": 8, "layers.1.mlp.down_proj": 2}, "alpha_pattern": {"v_proj": 32}},
    "layers": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "layers_to_transform": [1],
               "layers_pattern": "layers"},
}


def save_peft_adapter(model_dir: str, folder: Path, seed: int = 0, **config: object) -> None:
    """An adapter as PEFT itself saves it, every trained part moved off its init (B = 0 would hide any
    scaling, a magnitude equal to the row norms would hide DoRA)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                           LoraConfig(lora_dropout=0.0, **config))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in model.named_parameters():
            if param.requires_grad:
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    model.save_pretrained(str(folder))


def log_probs(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=IDS).logits.float(), dim=-1)


def peft_log_probs(model_dir: str, folder: Path) -> torch.Tensor:
    from peft import PeftModel

    return log_probs(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                               str(folder)))


def load_as_the_actor(model_dir: str, folder: Path) -> tuple[LoraSpec, torch.nn.Module]:
    """What the worker builds from lora_adapter_path (its own rank / alpha ignored), in one process."""
    spec = LoraSpec.from_model_config({"lora_rank": 1, "lora_alpha": 1, "lora_adapter_path": str(folder)})
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    spec.inject(model)
    initialised = [name for name, module in model.named_modules() if spec.init_adapter(name, module)]
    assert initialised
    return spec, model


@pytest.mark.parametrize("case", sorted(SAVED))
def test_an_adapter_saved_by_peft_computes_as_peft_loads_it(case, tiny_model_dir, tmp_path):
    folder = tmp_path / "saved"
    save_peft_adapter(tiny_model_dir, folder, **SAVED[case])
    expected = peft_log_probs(tiny_model_dir, folder)
    base = log_probs(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))
    assert float((expected - base).abs().max()) > 1e-2   # the adapter matters

    spec, model = load_as_the_actor(tiny_model_dir, folder)
    torch.testing.assert_close(log_probs(model), expected, rtol=1e-5, atol=1e-5)

    # lora_sync=merged / the HF engine / save_merged_lora: the merged weights compute the same
    merged = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    result = merged.load_state_dict(dict(merged_state(model)), strict=False)
    assert result.unexpected_keys == []
    torch.testing.assert_close(log_probs(merged), expected, rtol=1e-5, atol=1e-5)

    # the run's export is read back by PEFT as the same adapter (its config keeps every built field)
    export = tmp_path / "export"
    save_adapter(adapter_state(model), spec, tiny_model_dir, str(export))
    torch.testing.assert_close(peft_log_probs(tiny_model_dir, export), expected, rtol=1e-5, atol=1e-5)
    written = json.loads((export / ADAPTER_CONFIG).read_text())
    for key in SAVED_FIELDS_BUILT:
        if key in SAVED[case]:
            assert written[key] == SAVED[case][key], key


def test_every_peft_lora_field_is_built_ignored_or_refused():
    import peft

    classified = {"r", "lora_alpha", "target_modules", "exclude_modules", *SAVED_FIELDS_BUILT, *SAVED_FIELDS_IGNORED,
                  *SAVED_FIELDS_REFUSED}
    unclassified = sorted(f.name for f in dataclasses.fields(peft.LoraConfig) if f.name not in classified)
    assert unclassified == [], f"PEFT {peft.__version__}: classify these in verl/utils/lora.py"


@pytest.fixture(scope="module")
def q_proj_adapter(tiny_model_dir, tmp_path_factory) -> Path:
    """A plain rank-4 adapter on q_proj, saved by PEFT once for the tests that copy and edit it."""
    folder = tmp_path_factory.mktemp("q_proj_adapter")
    save_peft_adapter(tiny_model_dir, folder, r=4, lora_alpha=8, target_modules=["q_proj"])
    return folder


def _with(source: Path, folder: Path, **fields: object) -> Path:
    """A copy of the adapter folder `source` with these adapter_config.json fields set."""
    shutil.copytree(source, folder)
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    config.update(fields)
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config))
    return folder


def _merged_run(adapter: Path, *extra: str):
    """A config continuing from `adapter` under lora_sync=merged (and the HF engine): no vLLM adapter rule."""
    return compose_config(["actor_rollout_ref.model.lora_rank=4", f"actor_rollout_ref.model.lora_adapter_path={adapter}",
                           "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.lora_sync=merged", *extra])


@pytest.mark.parametrize(("fields", "named"), [
    ({"modules_to_save": ["lm_head"]}, "modules_to_save=['lm_head']: fully trained copies"),
    ({"lora_bias": True}, "lora_bias=True: a trained bias on lora_B"),
    ({"bias": "all"}, "bias='all': trained biases"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out=True"),
    ({"init_lora_weights": "pissa"}, "init_lora_weights='pissa' changes the base weights"),
    ({"alora_invocation_tokens": [1, 2]}, "alora_invocation_tokens=[1, 2]: activated LoRA"),
    ({"a_field_from_a_later_peft": 3}, "a_field_from_a_later_peft=3 is a field this loader does not know"),
])
def test_a_saved_adapter_field_the_loader_cannot_rebuild_is_refused_by_name(fields, named, q_proj_adapter, tmp_path):
    folder = _with(q_proj_adapter, tmp_path / "saved", **fields)
    with pytest.raises(ValueError, match="lora_adapter_path") as err:
        LoraSpec.from_model_config({"lora_rank": 4, "lora_adapter_path": str(folder)})
    assert named in str(err.value) and ADAPTER_CONFIG in str(err.value)
    for cfg in (_merged_run(folder), _merged_run(folder, "actor_rollout_ref.rollout.name=hf")):
        errors = config_errors(cfg)
        assert any(named in e and "lora_adapter_path" in e for e in errors), errors


def test_a_peft_adapter_with_rslora_dora_and_patterns_passes_the_config_check_under_merged(tiny_model_dir, tmp_path):
    folder = tmp_path / "saved"
    save_peft_adapter(tiny_model_dir, folder, r=4, lora_alpha=8, use_rslora=True, use_dora=True,
                      target_modules=["q_proj", "v_proj"], rank_pattern={"q_proj": 8}, alpha_pattern={"v_proj": 4})
    assert config_errors(_merged_run(folder)) == []
    # vLLM serving the adapter itself: DoRA refused (vLLM 0.32 has none), naming both keys
    adapter_mode = config_errors(_merged_run(folder, "actor_rollout_ref.rollout.lora_sync=adapter"))
    assert any("use_dora=true" in e and "lora_sync=adapter" in e for e in adapter_mode), adapter_mode


# --------------------------------------------------------------------------- embed_tokens / lm_head

@pytest.mark.parametrize("target", [["q_proj", "lm_head"], ["embed_tokens"], "lm_head|.*q_proj"])
@pytest.mark.parametrize("engine", [["actor_rollout_ref.rollout.name=hf"],
                                    ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.lora_sync=merged"],
                                    ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.lora_sync=adapter"]])
def test_lora_on_the_embeddings_is_refused_in_every_mode(target, engine):
    value = f"'{target}'" if isinstance(target, str) else f"[{','.join(target)}]"
    errors = config_errors(compose_config(["actor_rollout_ref.model.lora_rank=8",
                                           f"actor_rollout_ref.model.target_modules={value}", *engine]))
    matches = [e for e in errors if "actor_rollout_ref.model.target_modules=" in e and "is not supported" in e]
    assert matches, errors
    assert ("lm_head" if "lm_head" in str(target) else "embed_tokens") in matches[0]
    assert not any("set actor_rollout_ref.rollout.lora_sync=merged" in e for e in errors), errors


@pytest.mark.parametrize("target", [["q_proj", "lm_head"], ["embed_tokens"], "lm_head|.*v_proj"])
def test_injection_refuses_an_adapter_on_the_embeddings(target, tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with pytest.raises(ValueError, match="output head is not supported") as err:
        LoraSpec(rank=4, alpha=8, target_modules=target).inject(model)
    assert ("lm_head" if "lm_head" in str(target) else "embed_tokens") in str(err.value)


def test_a_saved_adapter_on_lm_head_is_refused_at_the_check_and_the_load(tiny_model_dir, tmp_path):
    folder = tmp_path / "saved"
    save_peft_adapter(tiny_model_dir, folder, r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"])
    errors = config_errors(_merged_run(folder))
    assert any("target_modules holds ['lm_head']" in e and "not supported" in e for e in errors), errors
    with pytest.raises(ValueError, match=r"target_modules holds \['lm_head'\]"):
        LoraSpec.from_model_config({"lora_rank": 4, "lora_adapter_path": str(folder)})


# --------------------------------------------------------------------------- the KL reference

def test_the_reference_of_a_continued_adapter_is_said_at_start_up(q_proj_adapter, caplog):
    folder = q_proj_adapter
    kl = "actor_rollout_ref.actor.use_kl_loss=true"
    with caplog.at_level(logging.WARNING, logger="verl.trainer.config_lora"):
        assert config_errors(_merged_run(folder, kl)) == []
    assert any("the KL reference is the base model WITHOUT the adapter" in r.getMessage() and
               "lora_reference=start_adapter" in r.getMessage() for r in caplog.records), caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="verl.trainer.config_lora"):
        assert config_errors(_merged_run(folder, kl, "actor_rollout_ref.ref.lora_reference=start_adapter")) == []
    assert not any("KL reference" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(("overrides", "message"), [
    (["actor_rollout_ref.ref.lora_reference=start_adapter"],
     "actor_rollout_ref.ref.lora_reference=start_adapter needs actor_rollout_ref.model.lora_adapter_path"),
    (["actor_rollout_ref.ref.lora_reference=sft"], "actor_rollout_ref.ref.lora_reference='sft' must be one of"),
])
def test_lora_reference_rules_name_the_key(overrides, message):
    errors = config_errors(compose_config(["actor_rollout_ref.model.lora_rank=8", *overrides]))
    assert any(message in e for e in errors), errors
