"""veRL's agent-loop interface: `AgentLoopBase`, `AgentLoopOutput`, `register(agent_name)`.

An agent loop rolls out one row: `await loop.run(sampling_params, **row)` gets the row's non-tensor
fields as keywords (`raw_prompt`, `extra_info`, `tools_kwargs`, `interaction_kwargs`, `agent_name`,
`index`, ..., and `raw_prompt_ids`, the prompt as the dataset tokenized it), calls the engine through

    output = await self.server_manager.generate(request_id=..., prompt_ids=..., sampling_params=...)
    output.token_ids, output.log_probs

as often as it likes, and returns an `AgentLoopOutput`: the prompt ids, the response ids, the
`response_mask` (1 = sampled by the policy, 0 = written by the environment: state masking), optionally
the log-probs, `num_turns`, metrics and `extra_fields`. The trainer trains on exactly those tokens. A
row's loop is the one its data column `agent_name` names, else
`actor_rollout_ref.rollout.agent.default_agent_loop`; loops register with `@register(name)` when their
module is imported, or are listed in `agent_loop_config_path` (veRL's YAML: `- name: ..., _target_: ...`).
How the rollout runs them: search_r1/llm_agent/agent_loops.py; docs/agent.md.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

# agent_name -> {"_target_": "module.Class", ...constructor keywords}; the class itself under "_class_"
# for loops registered in this process (veRL's registry holds the dotted name only).
_agent_loop_registry: dict[str, dict[str, Any]] = {}


class TokenOutput(BaseModel):
    """What one `server_manager.generate` call returns (veRL's TokenOutput)."""

    token_ids: list[int]
    log_probs: list[float] | None = None
    routed_experts: Any = None
    stop_reason: str | None = None
    num_preempted: int | None = None


class AgentLoopMetrics(BaseModel):
    """veRL's per-row timings (seconds) and preemptions; other keys a loop puts in its metrics are kept."""

    model_config = ConfigDict(extra="allow")

    generate_sequences: float = 0.0
    tool_calls: float = 0.0
    num_preempted: int = -1


class AgentLoopOutput(BaseModel):
    """One rolled-out row."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]                 # 1: sampled by the policy; 0: the environment's (tool, user)
    response_logprobs: list[float] | None = None
    routed_experts: Any = None
    multi_modal_data: dict[str, Any] | None = None
    reward_score: float | None = None        # set: the row's reward, in place of the reward function's
    num_turns: int = 0
    metrics: AgentLoopMetrics = Field(default_factory=AgentLoopMetrics)
    extra_fields: dict[str, Any] = Field(default_factory=dict)


class DictConfigWrap:
    """The trainer config, wrapped (veRL's name; keeps hydra from resolving it when instantiating)."""

    def __init__(self, config: Any) -> None:
        self.config = config


def _system_prompt_ids(tokenizer: Any) -> list[int]:
    """The ids a chat template puts before the first message on its own (a default system prompt), found
    as veRL finds them: one empty user turn rendered against two."""
    try:
        one = tokenizer.apply_chat_template([{"role": "user", "content": ""}], add_generation_prompt=False,
                                            tokenize=False)
        two = tokenizer.apply_chat_template([{"role": "user", "content": ""}] * 2, add_generation_prompt=False,
                                            tokenize=False)
    except Exception:   # noqa: BLE001 - no chat template: no system prompt
        return []
    turn = len(two) - len(one)
    return list(tokenizer.encode(one[: len(one) - turn], add_special_tokens=False)) if turn > 0 else []


class AgentLoopBase(ABC):
    """A loop that takes one row, talks to the engine (`server_manager`) and its environment, and returns
    an `AgentLoopOutput`. One instance per row; `self.config` is the whole trainer config."""

    def __init__(self, trainer_config: DictConfigWrap, server_manager: Any, tokenizer: Any, processor: Any = None,
                 dataset_cls: Any = None, dataset_config: DictConfigWrap | None = None, **kwargs: Any) -> None:
        self.config = trainer_config.config
        self.server_manager = server_manager
        self.tokenizer = tokenizer
        self.processor = processor
        self.dataset_cls = dataset_cls
        self.dataset_config = dataset_config.config if dataset_config is not None else None
        data = self.dataset_config
        self.apply_chat_template_kwargs = dict(data.get("apply_chat_template_kwargs", None) or {}) \
            if hasattr(data, "get") else {}
        self.system_prompt = _system_prompt_ids(tokenizer)
        try:
            self.loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:   # built outside a running loop (a test): the loop of the first await
            self.loop = None

    async def process_vision_info(self, messages: list[dict]) -> dict:
        """Images and videos of the messages: none here (rollouts are text-only)."""
        return {}

    async def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None, images: Any = None,
                                  videos: Any = None, remove_system_prompt: bool = False) -> list[int]:
        """The token ids of `messages` rendered by the chat template with the next assistant turn opened
        (`tools`: function schemas); `remove_system_prompt` drops the template's default system prompt, so
        messages rendered on their own can be appended to a conversation (veRL's delta rendering)."""
        if images or videos:
            raise ValueError("agent loops here are text-only: images and videos are not supported")

        def render() -> list[int]:
            text = self.tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                                      tokenize=False, **self.apply_chat_template_kwargs)
            return list(self.tokenizer.encode(text, add_special_tokens=False))

        ids = await asyncio.get_running_loop().run_in_executor(None, render)
        if remove_system_prompt and self.system_prompt and ids[: len(self.system_prompt)] == self.system_prompt:
            ids = ids[len(self.system_prompt):]
        return ids

    @abstractmethod
    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        """Roll out one row (`kwargs`: its fields) and return what the trainer trains on."""
        raise NotImplementedError


def register(agent_name: str) -> Any:
    """Class decorator: the loop is the one rows with `agent_name` (or a default_agent_loop of that name) use."""
    def decorator(subclass: type[AgentLoopBase]) -> type[AgentLoopBase]:
        _agent_loop_registry[agent_name] = {"_target_": f"{subclass.__module__}.{subclass.__qualname__}",
                                            "_class_": subclass}
        return subclass

    return decorator


def registered_agent_loops() -> list[str]:
    return sorted(_agent_loop_registry)


def load_agent_loop_config(path: str) -> list[str]:
    """Register the loops of an `agent_loop_config_path` file (veRL's layout: a list of `{name, _target_,
    ...constructor keywords}`; `_target_` a dotted class name, or `path/to/file.py:Class` relative to the
    file's folder). Returns their names; errors name the file and the entry."""
    from pathlib import Path

    import yaml

    from verl.tools.utils.tool_registry import ToolClassError, get_tool_class, resolve_class_name

    file = Path(path).expanduser()
    where = f"actor_rollout_ref.rollout.agent.agent_loop_config_path ({file})"
    if not file.is_file():
        raise FileNotFoundError(f"{where}: no such file")
    try:
        entries = yaml.safe_load(file.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"{where}: not valid YAML: {err}") from err
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{where}: expected a list of {{name: ..., _target_: module.Class}}")
    names = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or \
                not isinstance(entry.get("_target_"), str):
            raise ValueError(f"{where}[{i}]: expected {{name: <agent name>, _target_: module.Class or "
                             f"file.py:Class, ...constructor keywords}}, got {entry!r}")
        target = resolve_class_name(entry["_target_"], file.resolve().parent)
        try:
            cls = get_tool_class(target, f"{where}[{i}]._target_")
        except ToolClassError as err:
            raise ValueError(str(err)) from err
        if not issubclass(cls, AgentLoopBase):
            raise ValueError(f"{where}[{i}]._target_: {entry['_target_']!r} is not a "
                             "verl.experimental.agent_loop.AgentLoopBase subclass")
        _agent_loop_registry[entry["name"]] = {**{k: v for k, v in entry.items() if k != "name"},
                                               "_target_": target, "_class_": cls}
        names.append(entry["name"])
    return names


def agent_loop_class(name: str) -> tuple[type[AgentLoopBase], dict[str, Any]]:
    """(class, constructor keywords from its config entry) of the loop registered as `name`."""
    entry = _agent_loop_registry.get(name)
    if entry is None:
        raise ValueError(f"agent loop {name!r} is not registered; registered: {registered_agent_loops()} (register "
                         "yours with @register(name) in an imported module, or list it in "
                         "actor_rollout_ref.rollout.agent.agent_loop_config_path)")
    cls = entry.get("_class_")
    if cls is None:
        from verl.tools.utils.tool_registry import get_tool_class

        cls = entry["_class_"] = get_tool_class(entry["_target_"], f"agent loop {name!r}")
    return cls, {k: v for k, v in entry.items() if not k.startswith("_")}


__all__ = ["AgentLoopBase", "AgentLoopMetrics", "AgentLoopOutput", "DictConfigWrap", "TokenOutput", "agent_loop_class",
           "load_agent_loop_config", "register", "registered_agent_loops"]
