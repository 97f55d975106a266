"""Loading interactions from an interaction config (veRL's `verl.interactions.utils.interaction_registry`)."""
