"""`tool_agent` (veRL's name): this project's tool protocol (native tool calls through the chat template,
veRL upstream's Search-R1 recipe; search_r1/llm_agent/tool_turns.py), one row at a time.

The turn rules are the generation manager's (the cut at `</tool_call>`, the tools' lifetime, the
chat template's framing, the stop rules); this loop only drives them through `server_manager.generate`.
A run whose rows all use it in sync mode is rolled out batched (one engine call and one retrieval request
per turn for all rows, search_r1/llm_agent/generation.py); the rows are the same either way.
"""

from __future__ import annotations

from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register


@register("tool_agent")
class ToolAgentLoop(AgentLoopBase):
    """The tool protocol (actor_rollout_ref.rollout.multi_turn.enable=true)."""

    PROTOCOL = "tool"

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        from search_r1.llm_agent.agent_loops import run_protocol_row

        return await run_protocol_row(self, self.PROTOCOL, sampling_params, kwargs)


__all__ = ["ToolAgentLoop"]
