"""An interaction of your own, written only against veRL's interface (`verl.interactions.base.BaseInteraction`):
a user who checks the model's answer and, the first time it is wrong, says so once ("That is wrong, try
again."), so the model gets one more turn. Each reply's score (1.0 right, 0.0 wrong) goes to the row's
`turn_scores`, which a reward function reads as `extra_info["turn_scores"]`.

A row talks to it when its `extra_info.interaction_kwargs` is `{"name": "retry", "ground_truth": [answers]}`;
the run names the file with
    actor_rollout_ref.rollout.multi_turn.interaction_config_path=example/interactions/interaction_config.yaml
"""

from __future__ import annotations

from typing import Any

from verl.interactions.base import BaseInteraction
from verl.utils.reward_score.search_r1_like_qa_em import em_check, extract_solution

RETRY = "That is wrong, try again."


class RetryOnceInteraction(BaseInteraction):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.retries = int(config.get("retries", 1))
        self._rows: dict[str, dict[str, Any]] = {}

    async def start_interaction(self, instance_id: str | None = None, ground_truth: Any = None, **kwargs: Any) -> str:
        instance_id = await super().start_interaction(instance_id)
        golds = ground_truth.get("target", []) if isinstance(ground_truth, dict) else ground_truth or []
        self._rows[instance_id] = {"golds": [golds] if isinstance(golds, str) else list(golds), "wrong": 0,
                                   "score": 0.0}
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
                                ) -> tuple[bool, str, float, dict[str, Any]]:
        state = self._rows[instance_id]
        said = next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "")
        answer = extract_solution(said)
        if answer is not None and em_check(answer, state["golds"]):
            state["score"] = 1.0
            return True, "Correct.", 1.0, {}
        state["wrong"] += 1
        return state["wrong"] > self.retries, RETRY, 0.0, {"wrong": state["wrong"]}

    async def calculate_score(self, instance_id: str | None = None, **kwargs: Any) -> float:
        return self._rows.get(instance_id, {}).get("score", 0.0)

    async def finalize_interaction(self, instance_id: str | None = None, **kwargs: Any) -> None:
        self._rows.pop(instance_id, None)
