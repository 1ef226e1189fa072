"""The training stack: torch only, no network. GRPO loss and its steps, the trainer and its sharded
form over torchrun ranks, verification of groups against the policy, the publish cast."""
