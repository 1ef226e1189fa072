"""The learning plane: the learner daemon, policy publishing (and, next, GRPO training)."""
