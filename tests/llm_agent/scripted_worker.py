"""The scripted engine hosted in a Ray worker (its own module so Ray workers can import it)."""

from __future__ import annotations

import torch

from scripts.bench.rollout import ScriptedRollout
from verl.protocol import DataProto
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.base.worker import Worker


class ScriptedRolloutWorker(Worker):
    """A rollout worker whose engine replays scripts (no model can search here)."""

    def __init__(self, tokenizer, scripts: dict[str, list[list[int]]]) -> None:
        super().__init__()
        torch.set_num_threads(1)
        self.engine = ScriptedRollout(tokenizer, scripts)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Reads input_ids/attention_mask; writes responses, attention_mask (see ScriptedRollout)."""
        return self.engine.generate_sequences(prompts)
