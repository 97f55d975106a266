from .dp_critic import DataParallelPPOCritic

__all__ = ["DataParallelPPOCritic"]
