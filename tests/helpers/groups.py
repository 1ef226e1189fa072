"""Made-up groups for trainer tests: random completion tokens with made-up behaviour logprobs.

The learner's verification rightly refuses them; tests of devices and numerics train with it off,
or give them the trainer's own logprobs first (`with_own_logprobs`).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from echo2swarm.train.group import Group

if TYPE_CHECKING:
    from echo2swarm.train.trainer import GRPOTrainer


def make_groups(trainer: GRPOTrainer, *, n_groups: int = 3, group_size: int = 4, version: int = 1,
                seed: int = 0) -> list[Group]:
    rng = random.Random(seed)
    groups = []
    for g in range(n_groups):
        prompt = trainer.encode_prompt(f"{rng.randint(1, 99)}+{rng.randint(1, 99)}=")
        completions = [[rng.randrange(4, trainer.vocab_size) for _ in range(rng.randint(1, 6))]
                       for _ in range(group_size)]
        groups.append(Group(
            prompt_id=f"p{g}", version=version, prompt_ids=prompt, completions=completions,
            behaviour_logprobs=[[-rng.uniform(2.0, 5.0) for _ in c] for c in completions],
            rewards=[float(rng.random() < 0.5) + 0.1 * i for i in range(group_size)],
            finish_reasons=["stop"] * group_size,
        ))
    return groups


def with_own_logprobs(trainer: GRPOTrainer, groups: list[Group],
                      shift: Callable[[float], float] = float) -> list[Group]:
    """The groups with behaviour logprobs computed by the trainer's current policy, each passed through
    `shift` (on-policy data by default; a shift makes it look stale)."""
    import torch

    from echo2swarm.train.grpo import token_logprobs

    batch = trainer.build_batch(groups)
    with torch.no_grad():
        lp = token_logprobs(trainer.model, batch.input_ids, batch.attention_mask, batch.completion_mask)
    out, row = [], 0
    for group in groups:
        behaviour = []
        for completion in group.completions:
            behaviour.append([shift(float(v)) for v in lp[row, lp.shape[1] - len(completion):]])
            row += 1
        out.append(replace(group, behaviour_logprobs=behaviour))
    return out
