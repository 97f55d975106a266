"""An agent loop of your own, written only against veRL's interfaces (`verl.experimental.agent_loop`,
`verl.tools`): the search agent with a budget of `max_searches` searches. A call past the budget is not
run: the trajectory stops there, unanswered (the protocol's own `tool_agent` would answer it with an
error or let the model go on); so the policy learns to answer within the budget.

The loop renders the conversation with the chat template itself: the prompt from the row's `raw_prompt`
and the run's tool schemas, and after each search the template's text between the model's turn and the
next (the model's ids are never re-encoded: only the new text is tokenized, masked as the environment's).

    bash train_grpo.sh demo.protocol=tool \
        actor_rollout_ref.rollout.agent.agent_loop_config_path=example/agent_loops/agent_loops.yaml \
        actor_rollout_ref.rollout.agent.default_agent_loop=search_budget_agent
"""

from __future__ import annotations

import json
from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop import AgentLoopBase, AgentLoopOutput, register
from verl.tools.utils.tool_registry import initialize_tools_from_config

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_TOOLS: dict[str, dict] = {}    # tool config path -> its tools, built once per process (a loop is built per row)


def first_call(text: str) -> dict | None:
    """The first complete `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` of a turn, or None."""
    start = text.find(CALL_OPEN)
    end = text.find(CALL_CLOSE, start + len(CALL_OPEN)) if start >= 0 else -1
    if end < 0:
        return None
    try:
        call = json.loads(text[start + len(CALL_OPEN): end])
    except ValueError:
        return {"name": None, "arguments": None}
    return call if isinstance(call, dict) else {"name": None, "arguments": None}


@register("search_budget_agent")
class SearchBudgetAgentLoop(AgentLoopBase):
    def __init__(self, *args: Any, max_searches: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_searches = int(max_searches)
        multi_turn = self.config.actor_rollout_ref.rollout.multi_turn
        path = str(multi_turn.tool_config_path)
        if path not in _TOOLS:
            _TOOLS[path] = {tool.name: tool for tool in initialize_tools_from_config(path)}
        self.tools = _TOOLS[path]
        self.schemas = [t.tool_schema.model_dump(exclude_unset=True, exclude_none=True) for t in self.tools.values()]
        self.budget = int(self.config.data.max_response_length)
        self.max_chars = int(multi_turn.max_tool_response_length)

    def render(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.schemas, add_generation_prompt=True,
                                                  tokenize=False)

    async def answer(self, call: dict, instances: dict[str, str], rewards: list[float]) -> str:
        tool = self.tools.get(call.get("name"))
        if tool is None or not isinstance(call.get("arguments"), dict):
            return json.dumps({"result": f"Error: call one of {sorted(self.tools)} with a JSON object of arguments."})
        try:
            response, reward, _ = await tool.execute(instances[tool.name], call["arguments"])
        except Exception as err:   # noqa: BLE001 - the tool's error is the model's to read
            return json.dumps({"result": f"Error: {type(err).__name__}"})
        rewards.append(float(reward or 0.0))
        text = response.text or ""
        return text if len(text) <= self.max_chars else text[: self.max_chars] + "...(truncated)"

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        messages = [dict(m) for m in kwargs["raw_prompt"]]
        context = self.render(messages)
        prompt_ids = list(kwargs.get("raw_prompt_ids") or self.tokenizer.encode(context, add_special_tokens=False))
        instances = {}
        for name, tool in self.tools.items():      # veRL's lifetime: one instance per trajectory
            create_kwargs = kwargs.get("tools_kwargs", {}).get(name, {}).get("create_kwargs", {})
            instances[name], _ = await tool.create(**create_kwargs)
        ids: list[int] = []
        mask: list[int] = []
        rewards: list[float] = []
        searches = turns = 0
        request_id = uuid4().hex
        while len(ids) < self.budget:
            out = await self.server_manager.generate(
                request_id=request_id, prompt_ids=prompt_ids + ids,
                sampling_params={**sampling_params, "stop": [CALL_CLOSE], "max_tokens": self.budget - len(ids)})
            ids += out.token_ids
            mask += [1] * len(out.token_ids)
            turns += 1
            turn = self.tokenizer.decode(out.token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            call = first_call(turn)
            if call is None or searches >= self.max_searches:
                break                              # answered, gave up, or over budget: the row ends
            searches += 1
            messages += [{"role": "assistant", "content": turn},
                         {"role": "tool", "content": await self.answer(call, instances, rewards)}]
            rendered = self.render(messages)
            if not rendered.startswith(context + turn):
                raise ValueError("the chat template does not render a conversation as its prefix plus the new turns")
            observation = self.tokenizer.encode(rendered[len(context + turn):], add_special_tokens=False)
            if len(ids) + len(observation) >= self.budget:
                break
            ids += observation
            mask += [0] * len(observation)
            turns += 1
            context = rendered
        scores = {}
        for name, tool in self.tools.items():
            scores[name] = float(await tool.calc_reward(instances[name]))
            await tool.release(instances[name])
        return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=ids, response_mask=mask, num_turns=turns + 1,
                               extra_fields={"tool_rewards": rewards, "reward_scores": scores, "searches": searches})
