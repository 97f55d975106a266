"""Issue 35 item 1: the packed attention registered with transformers (verl/utils/packed_attention.py).

The CUDA kernels cannot run here: their contract (the arguments torch's varlen_attn and flash-attn's
flash_attn_varlen_func receive) is pinned with stand-ins that record them and compute varlen_attn's
semantics on CPU, and the model's output through them is compared with the padded sdpa forward.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.attention.varlen
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM

import verl.utils.packed_attention as pa
from verl.utils.attention import PACKED_ATTENTION, PACKED_FLASH_ATTENTION, attn_implementation
from verl.utils.remove_padding import pack_batch

torch.set_num_threads(1)
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def test_cu_seqlens_from_restarting_position_ids():
    cu, longest = pa.cu_seqlens_from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1, 2, 3]]))
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 5, 6, 10] and longest == 4
    # Rows are flattened; every row starts a sequence even if its positions continue the previous row's.
    cu, longest = pa.cu_seqlens_from_position_ids(torch.tensor([[0, 1, 2], [3, 4, 0]]))
    assert cu.tolist() == [0, 3, 5, 6] and longest == 3
    with pytest.raises(ValueError, match="position_ids must be"):
        pa.cu_seqlens_from_position_ids(torch.arange(4))


def _qkv(total: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(total, HEADS, HEAD_DIM, generator=g, requires_grad=True)
    k = torch.randn(total, KV_HEADS, HEAD_DIM, generator=g, requires_grad=True)
    v = torch.randn(total, KV_HEADS, HEAD_DIM, generator=g, requires_grad=True)
    return q, k, v


def _dense_block_causal(q, k, v, cu_seqlens, scale):
    """Independent oracle: one sdpa over the whole pack with a block-diagonal causal mask."""
    seq = torch.repeat_interleave(torch.arange(cu_seqlens.numel() - 1), (cu_seqlens[1:] - cu_seqlens[:-1]).long())
    n = q.shape[0]
    allowed = (seq[:, None] == seq[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1),
                                         attn_mask=allowed, scale=scale)
    return out.transpose(0, 1)


def test_reference_path_equals_a_block_diagonal_causal_mask_values_and_gradients():
    cu = torch.tensor([0, 5, 6, 13, 20], dtype=torch.int32)
    q, k, v = _qkv(20)
    out = pa.reference_varlen_attention(q, k, v, cu, 7, 0.3)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected = _dense_block_causal(q, k, v, cu, 0.3)
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    # Two fp32 computations of softmax over <= 7 keys: rounding ~1e-7; 1e-5 holds on any CPU.
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def fake_varlen_attn(calls: list[dict]):
    """A stand-in with torch 2.13's varlen_attn signature and semantics, computed on CPU."""
    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
        calls.append({"q": tuple(query.shape), "k": tuple(key.shape), "v": tuple(value.shape), "cu_q": cu_seq_q,
                      "cu_k": cu_seq_k, "max_q": max_q, "max_k": max_k, "scale": scale,
                      "window_size": window_size, "enable_gqa": enable_gqa})
        assert window_size == (-1, 0), "packed sequences need causal attention"
        if query.shape[1] != key.shape[1]:
            assert enable_gqa, "varlen_attn refuses fewer kv heads without enable_gqa"
        return pa.reference_varlen_attention(query, key, value, cu_seq_q, max_q, scale)

    return varlen_attn


def _tiny_qwen2(attn: str | None) -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=97, hidden_size=HEADS * HEAD_DIM, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64)
    if attn:
        config._attn_implementation = attn
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).eval()


def _padded_batch():
    lengths = torch.tensor([5, 12, 1, 9])
    total = 12
    mask = (torch.arange(total)[None] >= total - lengths[:, None]).long()     # left padded
    ids = torch.randint(1, 97, (4, total), generator=torch.Generator().manual_seed(1)) * mask
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions, lengths


@pytest.mark.parametrize("name", [PACKED_ATTENTION, PACKED_FLASH_ATTENTION])
def test_cuda_kernels_receive_varlen_arguments_and_match_the_padded_forward(monkeypatch, name):
    attn_implementation("cpu", True)   # registers both names
    calls: list[dict] = []
    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", fake_varlen_attn(calls))
    flash = types.ModuleType("flash_attn")

    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False):
        calls.append({"q": tuple(q.shape), "k": tuple(k.shape), "v": tuple(v.shape), "cu_q": cu_q, "cu_k": cu_k,
                      "max_q": max_q, "max_k": max_k, "scale": softmax_scale, "causal": causal,
                      "dropout_p": dropout_p})
        return pa.reference_varlen_attention(q, k, v, cu_q, max_q, softmax_scale)

    flash.flash_attn_varlen_func = flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "flash_attn", flash)
    # Run the CUDA dispatch on CPU tensors.
    monkeypatch.setattr(pa, "varlen_kernel", lambda device_type, kernel_name: pa._cuda_kernel(kernel_name))

    ids, mask, positions, lengths = _padded_batch()
    packed = pack_batch(ids, mask, positions)
    padded_model, packed_model = _tiny_qwen2(None), _tiny_qwen2(name)
    with torch.no_grad():
        want = padded_model(input_ids=ids, attention_mask=mask, position_ids=positions,
                            use_cache=False).logits.reshape(-1, 97)[packed.indices]
        got = packed_model(input_ids=packed.input_ids, position_ids=packed.position_ids, attention_mask=None,
                           use_cache=False).logits[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)   # fp32 rounding only
    assert len(calls) == 2   # one per layer
    total = int(lengths.sum())
    for call in calls:
        assert call["q"] == (total, HEADS, HEAD_DIM)
        assert call["k"] == call["v"] == (total, KV_HEADS, HEAD_DIM)   # GQA: k/v not repeated
        for cu in (call["cu_q"], call["cu_k"]):
            assert cu.dtype == torch.int32 and cu.tolist() == [0, 5, 17, 18, 27]
        assert call["max_q"] == call["max_k"] == 12
        assert call["scale"] == pytest.approx(HEAD_DIM ** -0.5)
        if name == PACKED_ATTENTION:
            assert call["window_size"] == (-1, 0) and call["enable_gqa"] is True
        else:
            assert call["causal"] is True and call["dropout_p"] == 0.0


def test_varlen_attn_without_enable_gqa_gets_repeated_kv_heads_and_is_causal(monkeypatch):
    """An older varlen_attn signature (is_causal, no enable_gqa): k/v heads repeated to the query's."""
    seen: dict = {}

    def old_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, is_causal=False):
        seen.update(k=tuple(key.shape), is_causal=is_causal)
        return pa.reference_varlen_attention(query, key, value, cu_seq_q, max_q, scale)

    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", old_varlen_attn)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    q, k, v = _qkv(9, seed=2)
    out = pa.torch_varlen_attention(q, k, v, cu, 5, 0.5)
    assert seen == {"k": (9, HEADS, HEAD_DIM), "is_causal": True}
    torch.testing.assert_close(out, _dense_block_causal(q, k, v, cu, 0.5), atol=1e-5, rtol=0)


def test_padded_and_generation_forwards_are_sdpa_unchanged():
    """The same loaded model serves padded batches and the HF rollout's cached generation."""
    attn_implementation("cpu", True)
    ids, mask, positions, _ = _padded_batch()
    sdpa_model, packed_model = _tiny_qwen2(None), _tiny_qwen2(PACKED_ATTENTION)
    with torch.no_grad():
        torch.testing.assert_close(packed_model(input_ids=ids, attention_mask=mask).logits,
                                   sdpa_model(input_ids=ids, attention_mask=mask).logits, atol=1e-6, rtol=0)
        kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
        assert torch.equal(packed_model.generate(input_ids=ids, attention_mask=mask, **kwargs),
                           sdpa_model.generate(input_ids=ids, attention_mask=mask, **kwargs))


def test_has_varlen_attn_requires_the_arguments_the_packed_attention_passes(monkeypatch):
    """has_varlen_attn says yes only for a varlen_attn that torch_varlen_attention can call causally:
    scale= and window_size= (torch 2.13) or is_causal= (earlier builds); a build taking neither would
    be refused by the kernel, so the config check must refuse it too."""
    from verl.utils import attention

    def window(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        return query

    def is_causal(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, is_causal=False):
        return query

    def neither(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None):
        return query

    def no_scale(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size=(-1, -1)):
        return query

    for fn, expected in [(window, {"window_size": (-1, 0)}), (is_causal, {"is_causal": True}), (neither, None),
                         (no_scale, None)]:
        monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", fn)
        assert pa.varlen_attn_causal_kwargs(fn) == expected, fn.__name__
        assert attention.has_varlen_attn() is (expected is not None), fn.__name__
    # the kernel refuses the same build with the same message the config check gives
    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", neither)
    q, k, v = _qkv(9, seed=2)
    with pytest.raises(RuntimeError, match="has no torch.nn.attention.varlen.varlen_attn taking scale= and a causal"):
        pa.torch_varlen_attention(q, k, v, torch.tensor([0, 4, 9], dtype=torch.int32), 5, 0.5)


def test_the_kernel_call_costs_no_per_layer_signature_read_nor_host_tensor(monkeypatch):
    """Every layer calls torch_varlen_attention: varlen_attn's signature is read once per function, not
    per call; and deriving the boundaries builds no host tensor (on CUDA each is a copy and a sync)."""
    calls: list[dict] = []
    fake = fake_varlen_attn(calls)
    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", fake)
    reads: list[object] = []
    real_signature = pa.inspect.signature
    monkeypatch.setattr(pa.inspect, "signature", lambda fn: reads.append(fn) or real_signature(fn))
    q, k, v = _qkv(9)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    for _ in range(3):
        pa.torch_varlen_attention(q, k, v, cu, 5, 0.3)
    assert len(calls) == 3 and reads.count(fake) <= 2     # the causal switch and enable_gqa, once each

    def no_host_tensors(*args, **kwargs):
        raise AssertionError("cu_seqlens_from_position_ids built a tensor from host data")

    monkeypatch.setattr(pa.torch, "tensor", no_host_tensors)
    got, longest = pa.cu_seqlens_from_position_ids(torch.arange(7).remainder(4)[None])
    assert got.tolist() == [0, 4, 7] and got.dtype == torch.int32 and longest == 4
