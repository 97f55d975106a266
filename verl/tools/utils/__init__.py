"""Loading tools from a tool config (veRL's `verl.tools.utils.tool_registry`)."""
