"""The weight push's two ends (verl/workers/weight_sync.py) over a real gloo group, in threads.

A sender and a receiver in one process, each with its own rank of a WeightSyncGroup (the same TCP
store and gloo group the pools use); the tiny Qwen2 (tied embeddings) as the sender's module.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from tests.conftest import free_port
from verl.utils.tiny_model import build_tiny_qwen2, train_bpe_tokenizer
from verl.workers.rollout_pool import RolloutPoolState
from verl.workers.weight_sync import (
    PushManifest,
    ReceivedTensors,
    TensorSpec,
    WeightSyncGroup,
    check_module_takes,
    push_manifest,
    push_state,
    receive_into_module,
    send_state,
)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return train_bpe_tokenizer()


def _model(tokenizer: Any, seed: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    return build_tiny_qwen2(tokenizer, seed=seed).to(dtype).eval()


def _both_ends(send: Callable[[WeightSyncGroup], Any], receive: Callable[[WeightSyncGroup], Any]) -> tuple[Any, Any]:
    """Run the sender (group rank 0) and one receiver (rank 1) at once; their results."""
    port = free_port()
    results: dict[int, Any] = {}
    errors: list[BaseException] = []

    def member(rank: int, body: Callable[[WeightSyncGroup], Any]) -> None:
        try:
            results[rank] = body(WeightSyncGroup("127.0.0.1", port, rank, 2, "cpu"))
        except BaseException as err:   # raised in the test's thread below
            errors.append(err)

    # daemons: a member left waiting in a broadcast (a broken push) must not keep the test process alive
    threads = [threading.Thread(target=member, args=(rank, body), daemon=True)
               for rank, body in enumerate((send, receive))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a member of the push hung"
    if errors:
        raise errors[0]
    return results[0], results[1]


def _n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())    # a tied tensor once


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_push_lands_in_the_engine_dtype_in_place_each_tensor_once_in_state_dict_order(
        tokenizer: Any, dtype: torch.dtype) -> None:
    actor = _model(tokenizer, seed=0)                   # fp32 master weights
    engine = _model(tokenizer, seed=1, dtype=dtype)     # other weights, in the engine's dtype
    manifest = push_manifest(actor, dtype)
    check_module_takes(manifest, engine, "cpu")
    storage = {name: p.data_ptr() for name, p in engine.named_parameters()}

    sent, written = _both_ends(lambda g: send_state(g, push_state(actor), manifest, "cpu"),
                               lambda g: receive_into_module(g, manifest, engine))

    # bytes = parameters x the dtype's size: half of fp32's in bf16; the tied lm_head is not sent twice
    assert sent == manifest.nbytes == _n_params(actor) * torch.empty((), dtype=dtype).element_size()
    assert "lm_head.weight" not in written and written[0] == "model.embed_tokens.weight"
    assert manifest.tensors[0].aliases == ("lm_head.weight",)
    assert written == [name for name in actor.state_dict() if name != "lm_head.weight"]
    for name, p in engine.named_parameters():
        assert p.dtype == dtype and p.data_ptr() == storage[name], name      # overwritten in place
        assert torch.equal(p, actor.get_parameter(name).detach().to(dtype)), name   # the sender's cast, exactly
    assert engine.lm_head.weight is engine.model.embed_tokens.weight


def test_an_engine_load_that_stops_early_still_completes_the_push_and_fails_naming_what_it_left(
        tokenizer: Any) -> None:
    actor = _model(tokenizer, seed=0)
    manifest = push_manifest(actor, torch.float32)
    taken: list[str] = []

    shapes = {name: spec.shape for spec in manifest.tensors for name in (spec.name, *spec.aliases)}

    def load_three(group: WeightSyncGroup) -> int:
        stream = ReceivedTensors(group, manifest, "cpu")
        for name, tensor in stream:
            assert tensor.dtype == torch.float32 and tuple(tensor.shape) == shapes[name]
            taken.append(name)
            if len(taken) == 3:
                break
        return stream.finish()

    with pytest.raises(RuntimeError, match=r"took 3 of the push's \d+ tensors; not loaded: \['model.layers.0"):
        _both_ends(lambda g: send_state(g, push_state(actor), manifest, "cpu"), load_three)
    # the tied lm_head comes right after the embedding, from the same buffer (vLLM reloads it as its own layer)
    assert taken == manifest.load_names[:3] == ["model.embed_tokens.weight", "lm_head.weight",
                                                "model.layers.0.self_attn.q_proj.weight"]


def test_a_module_that_cannot_take_the_push_in_place_is_refused_naming_the_tensor(tokenizer: Any) -> None:
    manifest = push_manifest(_model(tokenizer, seed=0), torch.bfloat16)
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight arrives as .* torch.bfloat16 .* holds .* torch.float32"):
        check_module_takes(manifest, _model(tokenizer, seed=0), "cpu")
    short = PushManifest(manifest.tensors[:-1], torch.bfloat16)
    with pytest.raises(ValueError, match=r"parameters \['model.norm.weight'\] are not pushed"):
        check_module_takes(short, _model(tokenizer, seed=0, dtype=torch.bfloat16), "cpu")
    untied = _model(tokenizer, seed=0, dtype=torch.bfloat16)
    untied.lm_head.weight = nn.Parameter(untied.lm_head.weight.detach().clone())
    with pytest.raises(ValueError, match="lm_head.weight is model.embed_tokens.weight in the actor"):
        check_module_takes(manifest, untied, "cpu")
    alien = PushManifest((TensorSpec("model.vision.weight", (2, 2)), *manifest.tensors), torch.bfloat16)
    with pytest.raises(ValueError, match="no tensor 'model.vision.weight'"):
        check_module_takes(alien, _model(tokenizer, seed=0, dtype=torch.bfloat16), "cpu")


def test_what_crosses_to_the_workers_survives_pickling(tokenizer: Any) -> None:
    manifest = push_manifest(_model(tokenizer, seed=0), torch.bfloat16)
    assert pickle.loads(pickle.dumps(manifest)) == manifest
    state = RolloutPoolState(version=2, engine_version=2, dtype="bfloat16", engine_loads=2, fsdp_modules=0,
                             dtensors=0, params=10, last_push=("a", "b"))
    assert pickle.loads(pickle.dumps(state)) == state


def test_an_fsdp_sharded_actor_pushes_each_tensor_cast_to_bf16_into_a_plain_bf16_module(
        tiny_model_dir: str, tmp_path: Any) -> None:
    # two FSDP2 train ranks (their own gloo world) cast their shards, gather and send; a third
    # process receives. (fp32, the CPU engines' dtype: tests/workers/test_rollout_pool.py)
    dtype = "bfloat16"
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM

    from tests.workers._push_ranks import run_rank

    mp.spawn(run_rank, args=(free_port(), free_port(), tiny_model_dir, dtype, str(tmp_path)), nprocs=3, join=True)
    sender, receiver = torch.load(tmp_path / "sender.pt"), torch.load(tmp_path / "receiver.pt")
    n_params = _n_params(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    assert sender["sent"] == n_params * 2     # half of an fp32 push
    assert receiver["written"] == sender["names"]
    for name, tensor in sender["expected"].items():
        assert torch.equal(receiver["state"][name], tensor), name    # the gathered fp32 tensor's cast, exactly
