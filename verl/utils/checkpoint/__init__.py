from .fsdp_checkpoint_manager import FSDPCheckpointManager
from .hf_export import export_hf_model

__all__ = ["FSDPCheckpointManager", "export_hf_model"]
