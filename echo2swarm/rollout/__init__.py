"""The rollout plane: the rollout daemon's service (and, next, generation engines)."""
