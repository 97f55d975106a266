"""Checkpoints: FSDPCheckpointManager (DCP shards, HF export) and export_hf_model.

Both are imported on first use (PEP 562), so that a light submodule (hf_export's HF_MAX_SHARD_MB, read by
preflight's host memory plan; manifest; shared_dir) does not bring torch.distributed.checkpoint with it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FSDPCheckpointManager", "export_hf_model"]


def __getattr__(name: str) -> Any:
    if name == "FSDPCheckpointManager":
        from .fsdp_checkpoint_manager import FSDPCheckpointManager

        return FSDPCheckpointManager
    if name == "export_hf_model":
        from .hf_export import export_hf_model

        return export_hf_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
