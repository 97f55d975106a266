"""Packing on CUDA through torch's own varlen_attn (issue 35), run on a real GPU.

    pytest -m gpu tests/gpu          # on a machine with one CUDA GPU; CI deselects `gpu`

CPU tests pin the kernel's arguments with stand-ins (tests/utils/test_packed_attention.py) and run the
per-sequence reference path; these run the kernel itself: causal within each sequence (torch 2.13 spells
causal as window_size=(-1, 0)), GQA, its backward, the tiny model packed == padded in bf16, one boundary
derivation per forward, and the one-time leak check.
"""

from __future__ import annotations

import pytest
import torch

import verl.utils.packed_attention as pa
from verl.utils.attention import attn_implementation
from verl.utils.remove_padding import check_packing_isolates_sequences, pack_batch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 0),
                                 reason="torch's varlen_attn (flash attention) needs sm80 or newer")]

HEADS, KV_HEADS = 4, 2


def _close(actual: torch.Tensor, expected: torch.Tensor, fraction: float) -> None:
    """|actual - expected| <= fraction of expected's largest magnitude (bf16 kernels against fp32)."""
    actual, expected = actual.detach().float(), expected.detach().float()
    scale = float(expected.abs().max()) + 1e-6
    err = float((actual - expected).abs().max())
    assert err <= fraction * scale, f"max |difference| {err:.4g} > {fraction} x {scale:.4g}"


def test_varlen_attn_is_causal_within_each_sequence_with_gqa_and_its_backward() -> None:
    """At the production head sizes (64: Qwen2.5-0.5B, 128: 3B and up) and lengths that span several of
    flash attention's tiles (a 1-token sequence, one of 194), against the fp32 per-sequence reference."""
    for head_dim in (64, 128):
        _kernel_matches_the_reference(head_dim, [0, 5, 6, 200, 333], 194)


def _kernel_matches_the_reference(head_dim: int, bounds: list[int], longest: int) -> None:
    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    total = bounds[-1]
    g = torch.Generator(device="cuda").manual_seed(head_dim)
    shapes = ((total, HEADS, head_dim), (total, KV_HEADS, head_dim), (total, KV_HEADS, head_dim))
    q, k, v = (torch.randn(s, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_() for s in shapes)
    out = pa.torch_varlen_attention(q, k, v, cu, longest, head_dim ** -0.5)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = pa.reference_varlen_attention(q32, k32, v32, cu, longest, head_dim ** -0.5)
    assert out.shape == (total, HEADS, head_dim) and out.dtype == torch.bfloat16
    # a non-causal or cross-sequence kernel is off by a large fraction of the output's scale
    _close(out, ref, 0.03)
    weight = torch.randn(out.shape, generator=g, device="cuda")
    (out.float() * weight).sum().backward()
    (ref * weight).sum().backward()
    for name, got, want in (("q", q, q32), ("k", k, k32), ("v", v, v32)):
        assert got.grad is not None and torch.isfinite(got.grad).all(), name
        _close(got.grad, want.grad, 0.05)


def _models(tiny_model_dir: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    padded = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).cuda()
    packed = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16,
                                                  attn_implementation=attn_implementation("cuda", True)).cuda()
    return padded, packed


def test_the_packed_model_equals_the_padded_one_and_derives_its_boundaries_once(tiny_model_dir, monkeypatch) -> None:
    padded, packed = _models(tiny_model_dir)
    vocab = padded.config.vocab_size
    g = torch.Generator().manual_seed(1)
    lengths = [7, 19, 12]
    width = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), width), generator=g)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, width - n:] = 1                                   # left padded, as prompts are
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    ids, mask, positions = ids.cuda(), mask.cuda(), positions.cuda()
    with torch.no_grad():
        want = padded(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    batch = pack_batch(ids, mask, positions)
    kwargs = pa.boundary_kwargs(batch.position_ids)
    derived: list[int] = []
    real = pa.cu_seqlens_from_position_ids
    monkeypatch.setattr(pa, "cu_seqlens_from_position_ids", lambda p: derived.append(1) or real(p))
    kernel_calls: list[int] = []      # the packed rows went through varlen_attn, not a dense-mask sdpa
    kernel = pa.torch_varlen_attention
    monkeypatch.setattr(pa, "torch_varlen_attention", lambda *a: kernel_calls.append(1) or kernel(*a))
    packed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    packed.train()
    got = packed(input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=None, use_cache=False,
                 **kwargs).logits
    got.float().square().mean().backward()
    assert derived == []          # every layer and the recompute used the boundaries given
    assert len(kernel_calls) == 2 * packed.config.num_hidden_layers     # forward and recompute
    _close(got[0].detach(), want.reshape(-1, want.shape[-1])[batch.indices], 0.05)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in packed.parameters())


def test_the_packing_leak_check_passes_on_cuda(tiny_model_dir) -> None:
    _, packed = _models(tiny_model_dir)
    check_packing_isolates_sequences(packed, packed.config.vocab_size)
