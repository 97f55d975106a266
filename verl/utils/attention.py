"""Which attention kernel the workers load a model with, and what packing needs installed.

    attn_implementation("cuda", use_remove_padding=True)   # "flash_attention_2", or a clear error
"""

from __future__ import annotations

# The install line every message and doc gives (docs/training.md, "Installing on GPUs"): flash-attn
# compiles against the torch already installed, so it is not an ordinary extra.
FLASH_ATTN_INSTALL = "pip install flash-attn==2.8.3.post2 --no-build-isolation"


def attn_implementation(device: str, use_remove_padding: bool) -> str | None:
    """flash-attn's varlen kernel for packed batches on CUDA; the model's default otherwise.

    Packing on CUDA without a working flash-attn would fall back to sdpa with one dense (N x N)
    mask over the whole packed micro-batch: slow and memory-hungry, so it is refused. The package
    is imported, not only found: a build for another torch or CUDA fails only when loaded."""
    if device != "cuda" or not use_remove_padding:
        return None
    try:
        import flash_attn  # noqa: F401
    except Exception as err:  # ImportError, or OSError/RuntimeError from a mismatched binary
        raise ValueError(f"model.use_remove_padding=True on CUDA needs a working flash-attn ({type(err).__name__}: "
                         f"{err}); install it with `{FLASH_ATTN_INSTALL}` (after a CUDA torch; docs/training.md, "
                         "'Installing on GPUs'), or set actor_rollout_ref.model.use_remove_padding=False (and "
                         "critic.model.use_remove_padding=False)") from err
    return "flash_attention_2"
