"""A LoRA actor's weight push (verl/workers/lora_push.py): the adapter alone, or the merged weights,
over a real gloo group in threads (the pattern of tests/workers/test_weight_sync.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.utils.test_lora import _injected
from tests.workers.test_weight_sync import _both_ends
from verl.utils.lora import ADAPTER_NAME, LoraSpec, adapter_state, merged_state
from verl.workers.lora_push import lora_push_manifest, lora_push_state, push_mode
from verl.workers.rollout_pool import RolloutPoolEngine
from verl.workers.weight_sync import ReceivedTensors, check_module_takes, receive_into_module, send_state

SPEC = LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])


def _expected_adapter_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """r * (in + out) per targeted linear, times the dtype's bytes."""
    size = torch.empty((), dtype=dtype).element_size()
    linears = [m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in SPEC.target_modules]
    assert len(linears) > 0
    return sum(m.r[ADAPTER_NAME] * (m.base_layer.in_features + m.base_layer.out_features) for m in linears) * size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adapter_manifest_names_peft_keys_and_counts_r_in_out_bytes(tiny_model_dir: str, dtype: torch.dtype) -> None:
    model = _injected(tiny_model_dir, SPEC, seed=3)
    manifest = lora_push_manifest(model, dtype, "adapter")
    saved = adapter_state(model)
    assert manifest.mode == "adapter" and manifest.dtype == dtype
    assert [s.name for s in manifest.tensors] == list(saved)        # PEFT's keys, as save_adapter writes them
    assert all(spec.shape == tuple(saved[spec.name].shape) for spec in manifest.tensors)
    assert manifest.nbytes == _expected_adapter_bytes(model, dtype)
    assert manifest.with_dtype(torch.float16).mode == "adapter"
    state = list(lora_push_state(model, "adapter"))
    assert [n for n, _ in state] == list(saved)
    for name, tensor in state:
        torch.testing.assert_close(tensor.detach().float(), saved[name], rtol=0, atol=0)


def test_merged_manifest_fits_a_plain_model_and_carries_merge_of_base_and_adapter(tiny_model_dir: str) -> None:
    model = _injected(tiny_model_dir, SPEC, seed=4)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    manifest = lora_push_manifest(model, torch.float32, "merged")
    check_module_takes(manifest, plain, "cpu")     # every name a plain parameter; a tied lm_head an alias
    merged = dict(merged_state(model))
    pushed = list(lora_push_state(model, "merged"))
    assert [n for n, _ in pushed] == [s.name for s in manifest.tensors]
    for name, tensor in pushed:
        torch.testing.assert_close(tensor.float(), merged[name].float(), rtol=1e-6, atol=1e-6)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(dict(pushed)[q], plain.state_dict()[q])   # the adapter changed it (B != 0)


def test_push_mode_follows_the_engine_and_a_mode_the_module_cannot_give_is_refused(tiny_model_dir: str) -> None:
    assert push_mode(None, adapter_engine=True) == "full"
    assert push_mode(SPEC, adapter_engine=True) == "adapter"
    assert push_mode(SPEC, adapter_engine=False) == "merged"
    model = _injected(tiny_model_dir, SPEC)
    with pytest.raises(ValueError, match="mode 'full': the actor has LoRA adapter"):
        lora_push_manifest(model, torch.float32, "full")
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with pytest.raises(ValueError, match="mode 'adapter': the actor has no LoRA adapter"):
        lora_push_manifest(plain, torch.float32, "adapter")
    with pytest.raises(ValueError, match="mode 'bogus' is not one of"):
        lora_push_manifest(model, torch.float32, "bogus")


class _AdapterEngine:
    """A stand-in vLLM rollout serving LoRA: records every sync_adapter and refuses weight loads."""

    def __init__(self) -> None:
        self.adapter_sync = object()
        self.adapters: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.synced_version: int | None = None
        self.weight_dtype = torch.bfloat16

    def sync_adapter(self, tensors: dict[str, torch.Tensor], version: int) -> bool:
        self.adapters.append((version, tensors))
        self.synced_version = version
        return True

    def sync_weights(self, *args: Any, **kwargs: Any) -> bool:
        raise AssertionError("an adapter push loaded base weights")


def test_an_adapter_push_reaches_the_engine_as_its_versions_adapter(tiny_model_dir: str) -> None:
    actor = _injected(tiny_model_dir, SPEC, seed=5)
    manifest = lora_push_manifest(actor, torch.bfloat16, "adapter")
    engine = _AdapterEngine()
    pool = RolloutPoolEngine(engine, None, "cpu", SPEC)   # type: ignore[arg-type]
    assert pool.push_mode == "adapter"
    pool.join(manifest)
    with pytest.raises(ValueError, match="the sender pushes 'merged' tensors, the rollout engine takes 'adapter'"):
        pool.join(lora_push_manifest(actor, torch.bfloat16, "merged"))
    sent, received = _both_ends(lambda g: send_state(g, lora_push_state(actor, "adapter"), manifest, "cpu"),
                                lambda g: pool.receive(g, manifest, version=1))
    assert sent == received == manifest.nbytes == _expected_adapter_bytes(actor, torch.bfloat16)
    assert [v for v, _ in engine.adapters] == [1] and pool.version == 1
    (_, tensors), = engine.adapters
    expected = adapter_state(actor)
    assert list(tensors) == list(expected) and pool.last_push == tuple(expected)
    for name, tensor in tensors.items():
        assert tensor.dtype == torch.bfloat16
        torch.testing.assert_close(tensor, expected[name].to(torch.bfloat16), rtol=0, atol=0)


def test_a_merged_push_lands_in_a_plain_module_as_merge_of_base_and_adapter(tiny_model_dir: str) -> None:
    actor = _injected(tiny_model_dir, SPEC, seed=6)
    engine = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    manifest = lora_push_manifest(actor, torch.float32, "merged")
    check_module_takes(manifest, engine, "cpu")
    sent, written = _both_ends(lambda g: send_state(g, lora_push_state(actor, "merged"), manifest, "cpu"),
                               lambda g: receive_into_module(g, manifest, engine))
    assert sent == manifest.nbytes and written == [s.name for s in manifest.tensors]
    held = engine.state_dict()
    for name, tensor in merged_state(actor):
        torch.testing.assert_close(held[name], tensor, rtol=1e-6, atol=1e-6)
    # the merged module computes what the adapted actor computes
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        torch.testing.assert_close(engine(ids).logits, actor(ids).logits, rtol=1e-4, atol=1e-4)


def test_a_received_adapter_stream_refuses_to_stop_early(tiny_model_dir: str) -> None:
    actor = _injected(tiny_model_dir, SPEC, seed=7)
    manifest = lora_push_manifest(actor, torch.float32, "adapter")

    def take_one(group: Any) -> int:
        stream = ReceivedTensors(group, manifest, "cpu")
        next(iter(stream))
        return stream.finish()

    with pytest.raises(RuntimeError, match="took 1 of the push's"):
        _both_ends(lambda g: send_state(g, lora_push_state(actor, "adapter"), manifest, "cpu"), take_one)
