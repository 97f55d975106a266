"""`BaseInteraction`, veRL's interface of a simulated user, with veRL's constructor and async methods.

An interaction config (`actor_rollout_ref.rollout.multi_turn.interaction_config_path`) lists
`{name, class_name, config}`; a row whose `extra_info.interaction_kwargs` has `name: <interaction>` talks to
it. In the tool protocol's loop, when the model ends a turn without a tool call (it answered, or wrote EOS):

    await interaction.start_interaction(instance_id, **interaction_kwargs)         # once, when the row starts
    should_terminate, response, score, metadata = await interaction.generate_response(
        instance_id, messages, **interaction_kwargs)                             # per such turn
    await interaction.finalize_interaction(instance_id)                          # once, when the row ends

`messages` is the conversation so far (the row's chat messages, then the model's turns as `assistant`
messages and the tool answers as `tool` messages). Unless `should_terminate`, `response` becomes a `user`
message (masked: the environment wrote it) and the model takes another turn. Each `score` is kept in the
row's `turn_scores`, which a reward function reads as `extra_info["turn_scores"]`.
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4


class BaseInteraction:
    """A simulated user; `self.name` is what a row's `interaction_kwargs.name` calls it."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.name: str = config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """Start one row's conversation; returns its id (a new one when None is given)."""
        return instance_id if instance_id is not None else str(uuid4())

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
                                ) -> tuple[bool, str, float, dict[str, Any]]:
        """(should_terminate, the user's reply, this turn's score, metadata)."""
        return False, "Your current result seems acceptable.", 0.8, {}

    async def calculate_score(self, instance_id: str | None = None, **kwargs: Any) -> float:
        """A score of the conversation (not called by the rollout; an agent loop of your own may)."""
        return 0.0

    async def finalize_interaction(self, instance_id: str | None = None, **kwargs: Any) -> None:
        """Drop the row's state."""


__all__ = ["BaseInteraction"]
