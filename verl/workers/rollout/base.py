"""The interface every rollout engine implements (HF generate loop here; vLLM on GPU)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class BaseRollout(ABC):
    """Turns left-padded prompts into prompt + sampled response batches."""

    @abstractmethod
    def generate_sequences(self, prompts: Any) -> Any:
        """DataProto of prompts -> DataProto with prompts, responses, input_ids, attention_mask, position_ids."""
