"""`BaseTool`, veRL's interface of a tool, with veRL's constructor and async methods.

A tool config entry `{class_name, config, tool_schema}` becomes `cls(config, tool_schema)` (one
object per rollout process, shared by all its trajectories). For each trajectory the rollout calls

    instance_id, _ = await tool.create(instance_id, **create_kwargs)   # once, when the trajectory starts
    response, step_reward, metrics = await tool.execute(instance_id, arguments, **execute_kwargs)  # per call
    reward = await tool.calc_reward(instance_id, **calc_reward_kwargs)  # once, when it ends
    await tool.release(instance_id, **release_kwargs)

The `*_kwargs` come from the row's `extra_info.tools_kwargs[<tool name>]` (veRL's layout). Calls of one
turn run concurrently (`asyncio.gather`), so `execute` must not block the event loop: do blocking work
with `await asyncio.to_thread(...)`. `response.text` is the `tool` message the model reads (cut to
`multi_turn.max_tool_response_length` characters); step rewards and `calc_reward` reach the reward
function in `extra_info["tool_rewards"]` / `extra_info["rollout_reward_scores"]` (docs/agent.md).
An exception from `execute` is that call's counted error (`tools/<name>/errors`): the model reads
`{"result": "Error: tool '<name>' failed (<type>)"}` and the trajectory goes on.
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from verl.utils.rollout_trace import rollout_trace_op


class BaseTool:
    """A tool the policy calls by `self.name` (its schema's function name)."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None) -> None:
        self.config = config
        self.tool_schema = tool_schema or self.get_openai_tool_schema()
        if self.tool_schema is None:
            raise ValueError(f"{type(self).__name__}: no tool_schema given and get_openai_tool_schema() "
                             "returned none")
        self.name = self.tool_schema.function.name

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema | None:
        """The schema shown to the model; a subclass without a `tool_schema:` in its YAML returns its own."""
        return getattr(self, "tool_schema", None)

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        """Start this tool's state for one trajectory; returns its id (a new one when None is given)."""
        return (instance_id if instance_id is not None else str(uuid4())), ToolResponse()

    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
                      ) -> tuple[ToolResponse, float, dict]:
        """Answer one call: (response, step reward, metrics)."""
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """The trajectory's reward from this tool's state, asked once when the trajectory ends."""
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Drop the trajectory's state."""


__all__ = ["BaseTool"]
