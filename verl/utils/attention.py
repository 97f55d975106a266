"""Which attention implementation the workers load a model with, and what packing needs installed.

Packing (`model.use_remove_padding=True`) runs through the implementation registered with
transformers in `verl/utils/packed_attention.py` ("search_r1_varlen"): torch's own varlen_attn on
CUDA (no flash-attn needed), flash-attn's kernel with `model.packing_kernel=flash_attn`, and an
exact per-sequence reference on CPU. This module imports neither torch nor transformers at import
time (the config check reads its constants).

    attn_implementation("cuda", use_remove_padding=True)   # "search_r1_varlen"
"""

from __future__ import annotations

from verl.utils.attention_names import (  # noqa: F401  (re-exported: the names callers use)
    FLASH_ATTN_INSTALL,
    PACKED_ATTENTION,
    PACKED_FLASH_ATTENTION,
    PACKING_KERNELS,
    VARLEN_ATTN_MISSING,
)


def has_varlen_attn() -> bool:
    """Whether this torch build has torch.nn.attention.varlen.varlen_attn taking what the packed
    attention passes: `scale` and a causal switch (`varlen_attn_causal_kwargs`)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return False
    from verl.utils.packed_attention import varlen_attn_causal_kwargs

    return varlen_attn_causal_kwargs(varlen_attn) is not None


def attn_implementation(device: str, use_remove_padding: bool, packing_kernel: str = "varlen_attn") -> str | None:
    """The registered packed attention when packing; the model's default (sdpa) otherwise.

    On CUDA, packing_kernel=varlen_attn needs a torch with varlen_attn; packing_kernel=flash_attn needs
    flash-attn, imported, not only found: a build for another torch or CUDA fails only when loaded."""
    if not use_remove_padding:
        return None
    if packing_kernel not in PACKING_KERNELS:
        raise ValueError(f"model.packing_kernel={packing_kernel!r}: expected one of {list(PACKING_KERNELS)}")
    from verl.utils.packed_attention import register_packed_attention

    register_packed_attention()
    if device != "cuda":
        return PACKED_ATTENTION
    if packing_kernel == "flash_attn":
        try:
            import flash_attn  # noqa: F401
        except Exception as err:  # ImportError, or OSError/RuntimeError from a mismatched binary
            raise ValueError(f"model.packing_kernel=flash_attn needs a working flash-attn ({type(err).__name__}: "
                             f"{err}); install it with `{FLASH_ATTN_INSTALL}` (after a CUDA torch; docs/training.md, "
                             "'Installing on GPUs'), or set model.packing_kernel=varlen_attn (torch's kernel, no "
                             "extra package)") from err
        return PACKED_FLASH_ATTENTION
    if not has_varlen_attn():
        raise ValueError(VARLEN_ATTN_MISSING)
    return PACKED_ATTENTION
