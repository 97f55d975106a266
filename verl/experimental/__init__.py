"""veRL's `verl.experimental` names that code written for veRL imports (agent loops)."""
