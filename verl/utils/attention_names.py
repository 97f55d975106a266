"""The names and messages of packed attention, for verl/utils/attention.py (which picks the
implementation) and verl/utils/packed_attention.py (which registers it): a leaf module, no imports."""

# The install line every message and doc gives (docs/training.md, "Installing on GPUs"): flash-attn
# compiles against the torch already installed, so it is not an ordinary extra.
FLASH_ATTN_INSTALL = "pip install flash-attn==2.8.3.post2 --no-build-isolation"

PACKED_ATTENTION = "search_r1_varlen"               # varlen_attn on CUDA, the reference on CPU
PACKED_FLASH_ATTENTION = "search_r1_varlen_fa2"   # flash-attn's varlen kernel on CUDA, the reference on CPU
# (neither name contains "flash": transformers routes such names to its own flash-attention loader)
PACKING_KERNELS = ("varlen_attn", "flash_attn")     # model.packing_kernel's values
VARLEN_ATTN_MISSING = (
    "this torch build has no torch.nn.attention.varlen.varlen_attn taking scale= and a causal window_size= (or "
    "is_causal=) (packing on CUDA runs through it): install the "
    "locked torch (docs/training.md, 'Installing on GPUs'), or set model.packing_kernel=flash_attn with flash-attn "
    f"installed (`{FLASH_ATTN_INSTALL}`), or set model.use_remove_padding=False")
