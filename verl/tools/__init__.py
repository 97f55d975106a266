"""veRL's tool interface (`BaseTool`, `verl.tools.schemas`), so a tool file written for veRL loads here
unmodified. A tool config (`actor_rollout_ref.rollout.multi_turn.tool_config_path`) names any
importable `BaseTool` subclass, or a file (`path/to/tools.py:MyTool`); docs/agent.md "Your own tools,
loops and interactions"."""
