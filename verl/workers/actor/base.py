"""The interface every PPO actor implements (data-parallel FSDP today; Megatron would be another)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch


class BasePPOActor(ABC):
    """An actor scores responses under its policy and updates the policy from a PPO batch."""

    def __init__(self, config: Any) -> None:
        self.config = config

    @abstractmethod
    def compute_log_prob(self, data: Any, calculate_entropy: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, R) log-probs of `responses` (and entropies when asked) for a DataProto."""

    @abstractmethod
    def update_policy(self, data: Any) -> dict[str, list[float]]:
        """Run the PPO epochs over `data`; return per-micro-batch metrics."""
