from .fsdp_hf import FSDPHFShardingManager, FSDPUnshardedForGeneration

__all__ = ["FSDPHFShardingManager", "FSDPUnshardedForGeneration"]
