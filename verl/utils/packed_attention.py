"""Packed ("remove padding") attention registered with transformers.

A packed micro-batch is one row of real tokens whose position ids restart at 0 per sequence.
The implementation registered here under `PACKED_ATTENTION` ("search_r1_varlen") reads the
sequence boundaries from those position ids (`cu_seqlens_from_position_ids`) and runs causal
attention within each sequence:

    CUDA   torch's `torch.nn.attention.varlen.varlen_attn` (no extra package), or flash-attn's
           `flash_attn_varlen_func` under `PACKED_FLASH_ATTENTION` (model.packing_kernel=flash_attn)
    CPU    `reference_varlen_attention`: one causal sdpa call per sequence (the same code path the
           CPU tests run; exact, and cheaper than a dense block-diagonal mask over the micro-batch)

Padded batches (a 2-D attention mask) and generation with a KV cache go to transformers' sdpa
unchanged, so the same loaded model serves both.

    register_packed_attention()          # attn_implementation() does it before any model is built
    model = AutoModelForCausalLM.from_config(config, attn_implementation=PACKED_ATTENTION)
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from verl.utils import ulysses
from verl.utils.attention_names import PACKED_ATTENTION, PACKED_FLASH_ATTENTION, VARLEN_ATTN_MISSING


# ---------------------------------------------------------------------------- boundaries
def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(cu_seqlens int32 (S+1,), longest sequence) of the flattened (B, N) position ids.

    A sequence starts wherever the position does not follow the previous one by 1, and at
    every row's start: [[0, 1, 2, 0, 1]] -> ([0, 3, 5], 3)."""
    if position_ids.dim() != 2:
        raise ValueError(f"position_ids must be (batch, tokens), got shape {tuple(position_ids.shape)}")
    rows, n = position_ids.shape
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    start_idx = torch.nonzero(starts.reshape(-1), as_tuple=False).squeeze(-1)      # host sync 1
    # the end appended on the device (a host tensor would be one more copy and sync on CUDA)
    cu_seqlens = F.pad(start_idx, (0, 1), value=rows * n).to(torch.int32)
    max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if rows * n else 0   # host sync 2
    return cu_seqlens, max_len


def boundary_kwargs(position_ids: torch.Tensor) -> dict[str, Any]:
    """The packed row's boundaries as transformers' flash-attention keywords, for the model's forward:
    `model(input_ids=..., position_ids=..., **boundary_kwargs(position_ids))` hands them to every
    layer's attention (and gradient checkpointing's recompute), so the two host syncs of deriving them
    run once per forward, not twice per layer. transformers' own flash_attention_2 reads the same keys."""
    cu_seqlens, max_len = cu_seqlens_from_position_ids(position_ids)
    return {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens, "max_length_q": max_len, "max_length_k": max_len}


# ---------------------------------------------------------------------------- kernels
# Each takes q (T, Hq, D), k and v (T, Hkv, D), cu_seqlens int32 (S+1,), the longest sequence and
# the softmax scale, and returns (T, Hq, D): causal attention within each sequence.
VarlenKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]


def reference_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                               max_len: int, scale: float) -> torch.Tensor:
    """Causal attention within each [cu_seqlens[i], cu_seqlens[i+1]) span: one sdpa call per sequence."""
    del max_len   # the loop needs only the boundaries
    gqa = q.shape[1] != k.shape[1]
    bounds = cu_seqlens.tolist()
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        # (1, H, L, D) views; sdpa's causal mask is the upper-left one, right for q_len == k_len.
        qs, ks, vs = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
        outs.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(outs, dim=0) if outs else q.new_empty(q.shape)


def varlen_attn_causal_kwargs(varlen_attn: Callable[..., Any]) -> dict[str, Any] | None:
    """The keyword that makes torch's `varlen_attn` causal, as packed_attention.torch_varlen_attention
    passes it: window_size=(-1, 0) where the signature takes window_size (torch 2.13, whose default
    (-1, -1) is NOT causal), else is_causal=True (earlier builds); None when it takes neither, or no
    `scale` (the softmax scale is passed too): such a build cannot run the packed attention.
    The signature is read once per function (every layer's call asks)."""
    found = _causal_keyword(varlen_attn)
    return None if found is None else {found[0]: found[1]}


@functools.lru_cache(maxsize=8)
def _causal_keyword(varlen_attn: Callable[..., Any]) -> tuple[str, Any] | None:
    try:
        params = inspect.signature(varlen_attn).parameters
    except (TypeError, ValueError):
        return None
    if "scale" not in params:
        return None
    if "window_size" in params:
        return "window_size", (-1, 0)
    if "is_causal" in params:
        return "is_causal", True
    return None


@functools.lru_cache(maxsize=8)
def _takes_enable_gqa(varlen_attn: Callable[..., Any]) -> bool:
    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def torch_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                           max_len: int, scale: float) -> torch.Tensor:
    """torch's varlen_attn (flash attention in torch itself), causal, GQA without copying k/v."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as err:
        raise RuntimeError(VARLEN_ATTN_MISSING) from err
    # torch 2.13 spells causal as window_size=(-1, 0); earlier varlen_attn builds took is_causal
    # (the same rule attention.has_varlen_attn checks before a model is loaded).
    causal = varlen_attn_causal_kwargs(varlen_attn)
    if causal is None:
        raise RuntimeError(VARLEN_ATTN_MISSING)
    kwargs: dict[str, Any] = {"scale": scale, **causal}
    if q.shape[1] != k.shape[1]:
        if _takes_enable_gqa(varlen_attn):
            kwargs["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, **kwargs)


def flash_attn_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                                max_len: int, scale: float) -> torch.Tensor:
    """flash-attn's flash_attn_varlen_func (the package, when installed and asked for)."""
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, dropout_p=0.0,
                                  softmax_scale=scale, causal=True)


def _cuda_kernel(name: str) -> VarlenKernel:
    return flash_attn_varlen_attention if name == PACKED_FLASH_ATTENTION else torch_varlen_attention


def varlen_kernel(device_type: str, name: str = PACKED_ATTENTION) -> VarlenKernel:
    """The kernel a packed forward on `device_type` runs under the registered implementation `name`."""
    return _cuda_kernel(name) if device_type == "cuda" else reference_varlen_attention


# ---------------------------------------------------------------------------- transformers glue
def _packed_attention_forward(name: str) -> Callable[..., tuple[torch.Tensor, None]]:
    def forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """query (B, Hq, N, D), key / value (B, Hkv, N, D) -> ((B, N, Hq, D), None), transformers' contract."""
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        position_ids = kwargs.get("position_ids")
        padded_or_cached = attention_mask is not None or query.shape[2] != key.shape[2]
        sp = ulysses.active()
        if sp is not None and not padded_or_cached:
            # Ulysses: my heads of every token in, varlen over the whole packed row, my tokens back.
            query, key, value = (ulysses.heads_to_sequence(t, sp) for t in (query, key, value))
            if sp.boundaries is None:
                sp.boundaries = cu_seqlens_from_position_ids(sp.full_position_ids)
            out = _packed(name, module, query, key, value, sp.full_position_ids, scaling, dropout, kwargs,
                          boundaries=sp.boundaries)
            return ulysses.sequence_to_heads(out, sp), None
        if padded_or_cached or position_ids is None or not getattr(module, "is_causal", True):
            return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                          dropout=dropout, **kwargs)
        given = kwargs.get("cu_seq_lens_q")    # boundary_kwargs: derived once for the whole forward
        boundaries = None if given is None else (given, int(kwargs["max_length_q"]))
        return _packed(name, module, query, key, value, position_ids, scaling, dropout, kwargs,
                       boundaries=boundaries, shortcut=True), None

    forward.__name__ = f"{name}_attention_forward"
    return forward


def _packed(name: str, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            position_ids: torch.Tensor, scaling: float | None, dropout: float, kwargs: dict[str, Any],
            boundaries: tuple[torch.Tensor, int] | None = None, shortcut: bool = False) -> torch.Tensor:
    """Causal attention within each sequence of the packed rows -> (B, N, Hq, D). `boundaries`: the
    rows' (cu_seqlens, max length) when known (derived once for all layers: `boundary_kwargs`, or
    Ulysses' state); else derived here. `shortcut`: one sequence per row runs plain causal sdpa (not
    under Ulysses, where sdpa would repeat key/value heads by the model's global ratio, not the SP
    share's)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, n, head_dim = query.shape
    cu_seqlens, max_len = boundaries or cu_seqlens_from_position_ids(position_ids.expand(batch, -1))
    if shortcut and cu_seqlens.numel() - 1 == batch:   # one sequence per row: plain causal attention
        kwargs = {k: v for k, v in kwargs.items() if k != "position_ids"}
        return sdpa_attention_forward(module, query, key, value, None, scaling=scaling, dropout=dropout,
                                      **kwargs)[0]
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError(f"{name}: packed attention with a sliding window is not supported; set "
                                  "model.use_remove_padding=False for this model")
    if dropout:
        raise NotImplementedError(f"{name}: packed attention has no attention dropout ({dropout}); set the "
                                  "model's attention_dropout to 0 or model.use_remove_padding=False")
    scale = float(scaling) if scaling is not None else head_dim ** -0.5
    q, k, v = (t.transpose(1, 2).reshape(batch * n, t.shape[1], head_dim) for t in (query, key, value))
    out = varlen_kernel(query.device.type, name)(q, k, v, cu_seqlens.to(query.device), max_len, scale)
    return out.reshape(batch, n, heads, head_dim)


def _packed_mask(**kwargs: Any) -> torch.Tensor | None:
    """No mask for a cache-free forward without a padding mask (the attention reads the boundaries from
    position_ids; a dense block-diagonal mask is what packing avoids); sdpa's mask otherwise."""
    from transformers.masking_utils import sdpa_mask

    if kwargs.get("attention_mask") is None and not kwargs.get("q_offset") and not kwargs.get("kv_offset") \
            and kwargs["q_length"] == kwargs["kv_length"]:
        return None
    return sdpa_mask(**kwargs)


def register_packed_attention() -> None:
    """Register both names with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for name in (PACKED_ATTENTION, PACKED_FLASH_ATTENTION):
        AttentionInterface.register(name, _packed_attention_forward(name))
        AttentionMaskInterface.register(name, _packed_mask)
