"""veRL's interactions (`verl.interactions.base.BaseInteraction`): a simulated user that answers the model's
turns in a multi-turn rollout (multi_turn.interaction_config_path; docs/agent.md)."""
