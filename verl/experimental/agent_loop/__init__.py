"""veRL's agent loops (`from verl.experimental.agent_loop import AgentLoopBase, AgentLoopOutput, register`),
with the built-in loops registered: `single_turn_agent`, `tool_agent` (the tool protocol) and
`search_r1_agent` (the original's tag protocol)."""

from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
    DictConfigWrap,
    TokenOutput,
    agent_loop_class,
    load_agent_loop_config,
    register,
    registered_agent_loops,
)
from verl.experimental.agent_loop.search_r1_agent_loop import SearchR1AgentLoop
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop

# The loop a protocol's rows use unless their agent_name or default_agent_loop says otherwise.
PROTOCOL_LOOPS = {"tags": "search_r1_agent", "tool": "tool_agent"}

__all__ = ["PROTOCOL_LOOPS", "AgentLoopBase", "AgentLoopMetrics", "AgentLoopOutput", "DictConfigWrap", "SearchR1AgentLoop",
           "SingleTurnAgentLoop", "TokenOutput", "ToolAgentLoop", "agent_loop_class", "load_agent_loop_config",
           "register", "registered_agent_loops"]
