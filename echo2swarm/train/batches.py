"""Accepted groups as one left-padded batch of tensors: what a GRPO step trains on.

    groups (prompt ids, completions, behaviour logprobs, rewards, version)
      ─► one row per completion, left-padded as generation saw it ─► `Batch` on the training device
         (input ids, attention mask, completion mask, behaviour logprobs, advantages per group, versions)

`Batch.select` and `Batch.only_rows` cut minibatches and take refused groups out of the objective
(train/updates.py, train/trainer.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from echo2swarm.train.group import Group
from echo2swarm.train.grpo import group_advantages

__all__ = ["Batch", "build_batch", "group_rows"]


@dataclass
class Batch:
    """One row per completion, [B, T] per-token tensors left-padded; ``advantages`` and ``versions`` are [B]."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    behaviour: torch.Tensor
    advantages: torch.Tensor
    versions: torch.Tensor

    def to(self, device: torch.device) -> Batch:
        return Batch(*(getattr(self, f.name).to(device) for f in fields(self)))

    def select(self, rows: torch.Tensor) -> tuple[Batch, int]:
        """The rows ``rows`` ([n] long), without the leading columns that are padding in all of them;
        also returns the first column kept (slice per-token tensors of the full batch with it)."""
        sub = Batch(*(getattr(self, f.name).index_select(0, rows) for f in fields(self)))
        used = sub.attention_mask.bool().any(dim=0).nonzero()
        first = int(used[0]) if used.numel() else 0
        if first:
            sub = replace(sub, input_ids=sub.input_ids[:, first:], attention_mask=sub.attention_mask[:, first:],
                          completion_mask=sub.completion_mask[:, first:], behaviour=sub.behaviour[:, first:])
        return sub, first

    def only_rows(self, keep: torch.Tensor) -> Batch:
        """The same tensors with the rows where ``keep`` ([B] bool) is false taken out of the
        objective: no completion token, behaviour logprob 0, advantage 0."""
        column = keep.unsqueeze(1)
        return replace(
            self,
            completion_mask=self.completion_mask * column,
            behaviour=torch.where(column, self.behaviour, torch.zeros_like(self.behaviour)),
            advantages=torch.where(keep, self.advantages, torch.zeros_like(self.advantages)),
        )


def build_batch(groups: list[Group], *, pad_id: int, scale_std: bool, device: torch.device) -> Batch:
    """``groups`` as one batch on ``device``: a row per completion, left-padded with ``pad_id``;
    advantages per group (`train.scale_std`)."""
    rows: list[tuple[list[int], list[int], list[float], float, int]] = []
    for group in groups:
        advantages = group_advantages(torch.tensor(group.rewards, dtype=torch.float32), scale_std=scale_std)
        for completion, logprobs, adv in zip(group.completions, group.behaviour_logprobs, advantages.tolist()):
            rows.append((group.prompt_ids, completion, logprobs, adv, group.version))
    length = max(len(p) + len(c) for p, c, *_ in rows)
    batch = len(rows)
    input_ids = torch.full((batch, length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, length), dtype=torch.long)
    completion_mask = torch.zeros((batch, length), dtype=torch.float32)
    behaviour = torch.zeros((batch, length), dtype=torch.float32)
    for b, (prompt, completion, logprobs, _, _) in enumerate(rows):
        seq = prompt + completion
        start = length - len(seq)  # left padding, as generation saw it
        input_ids[b, start:] = torch.tensor(seq)
        attention_mask[b, start:] = 1
        completion_mask[b, length - len(completion):] = 1
        behaviour[b, length - len(completion):] = torch.tensor(logprobs)
    # Assembled on the CPU (many small row writes), then moved in one copy per tensor.
    return Batch(
        input_ids, attention_mask, completion_mask, behaviour,
        torch.tensor([r[3] for r in rows], dtype=torch.float32),
        torch.tensor([r[4] for r in rows], dtype=torch.long),
    ).to(device)


def group_rows(groups: list[Group]) -> list[range]:
    """The rows of each group in `build_batch(groups)`."""
    rows, start = [], 0
    for group in groups:
        rows.append(range(start, start + len(group.completions)))
        start += len(group.completions)
    return rows
