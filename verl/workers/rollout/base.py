"""The interface every rollout engine implements (HF generate loop here; vLLM on GPU)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch

from verl.utils import batch_keys as K

if TYPE_CHECKING:   # verl.protocol imports tensordict (and with it torch._dynamo): preflight's config checks read
    from verl.protocol import DataProto  # this module's settings without it


class BaseRollout(ABC):
    """Turns left-padded prompts into prompt + sampled response batches."""

    @abstractmethod
    def generate_sequences(self, prompts: Any) -> Any:
        """DataProto of prompts -> DataProto with prompts, responses, input_ids, attention_mask, position_ids."""


def prompt_and_response_batch(prompts: Any, responses: torch.Tensor, response_mask: torch.Tensor,
                              log_probs: torch.Tensor) -> DataProto:
    """The batch every engine returns: the prompts' tensors with the responses (B, R) appended,
    response positions continuing the prompt's, and each sampled token's log-prob; the
    prompts' non-tensors and meta_info are kept."""
    idx = prompts.batch[K.INPUT_IDS]
    attention_mask = prompts.batch[K.ATTENTION_MASK]
    position_ids = prompts.batch[K.POSITION_IDS]
    # Positions keep counting over sampled tokens and repeat the last one over padding.
    response_positions = position_ids[:, -1:] + torch.cumsum(response_mask, dim=-1)
    tensors = {
        K.PROMPTS: idx,
        K.RESPONSES: responses,
        K.INPUT_IDS: torch.cat([idx, responses], dim=-1),
        K.ATTENTION_MASK: torch.cat([attention_mask, response_mask], dim=-1),
        K.POSITION_IDS: torch.cat([position_ids, response_positions], dim=-1),
        K.ROLLOUT_LOG_PROBS: log_probs,
    }
    from verl.protocol import DataProto

    return DataProto.from_dict(tensors=tensors, non_tensors=dict(prompts.non_tensor_batch),
                               meta_info=dict(prompts.meta_info))
