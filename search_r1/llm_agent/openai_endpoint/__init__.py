"""An OpenAI-compatible endpoint in front of the rollout engine, so an agent written against the OpenAI
API trains unchanged (docs/agent.md "Train an agent you already wrote"): `server.py` (the endpoint),
`chat.py` (messages <-> the tool protocol's text), `sessions.py` (token-exact trajectories),
`engines.py` (the engine clients), `agents.py` (running the user's agent per row)."""
