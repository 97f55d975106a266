"""`single_turn_agent` (veRL's name): one engine call, the whole response trained on."""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register


@register("single_turn_agent")
class SingleTurnAgentLoop(AgentLoopBase):
    """The row's prompt (as the dataset tokenized it, else the chat template over `raw_prompt`), one
    generation, no environment."""

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        prompt_ids = kwargs.get("raw_prompt_ids")
        if prompt_ids is None:
            prompt_ids = await self.apply_chat_template(list(kwargs["raw_prompt"]))
        output = await self.server_manager.generate(request_id=uuid4().hex, prompt_ids=list(prompt_ids),
                                                    sampling_params=dict(sampling_params))
        ids = list(output.token_ids)
        return AgentLoopOutput(prompt_ids=list(prompt_ids), response_ids=ids, response_mask=[1] * len(ids),
                               response_logprobs=output.log_probs, num_turns=2)


__all__ = ["SingleTurnAgentLoop"]
