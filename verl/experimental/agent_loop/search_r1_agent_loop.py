"""`search_r1_agent`: the original Search-R1's tag protocol (`<search>` / `<answer>`, `<information>`
observations; search_r1/llm_agent/actions.py), one row at a time, through the generation manager's rules
(see tool_agent_loop.py for how the loops and the batched sync rollout relate)."""

from __future__ import annotations

from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register


@register("search_r1_agent")
class SearchR1AgentLoop(AgentLoopBase):
    """The tag protocol (the default; multi_turn.enable=false)."""

    PROTOCOL = "tags"

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        from search_r1.llm_agent.agent_loops import run_protocol_row

        return await run_protocol_row(self, self.PROTOCOL, sampling_params, kwargs)


__all__ = ["SearchR1AgentLoop"]
