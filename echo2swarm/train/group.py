"""One prompt's group of completions as the learner accepted it: what the trainer trains on."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Group"]


@dataclass
class Group:
    """One prompt's G completions, as accepted by the learner (rewards already computed)."""

    prompt_id: str
    version: int  # policy version that generated it
    prompt_ids: list[int]
    completions: list[list[int]]
    behaviour_logprobs: list[list[float]]
    rewards: list[float]
    finish_reasons: list[str]
    peer_id: str = ""
    received_at: float = 0.0  # time.monotonic() when the learner accepted it
    prompt_index: int | None = None  # the task's index of the prompt: re-issued if the group is thrown away
    sampler: str | None = None  # the lease's seeded sampler it was drawn with (wire/sampling.py); None: unseeded
    seed: int | None = None  # with `sampler`: the lease's seed, which the learner drew (never the peer's word)

    def __len__(self) -> int:
        return len(self.completions)

    def check(self) -> None:
        """Raise ValueError unless the per-completion lists line up (one entry per completion,
        one behaviour logprob per completion token)."""
        g = len(self.completions)
        if g == 0:
            raise ValueError(f"group {self.prompt_id!r} has no completions")
        if self.version < 0:
            raise ValueError(f"group {self.prompt_id!r} has negative version {self.version}")
        for name in ("behaviour_logprobs", "rewards", "finish_reasons"):
            if len(getattr(self, name)) != g:
                raise ValueError(f"group {self.prompt_id!r}: {len(getattr(self, name))} {name} for {g} completions")
        for i, (tokens, logprobs) in enumerate(zip(self.completions, self.behaviour_logprobs, strict=True)):
            if len(tokens) != len(logprobs):
                raise ValueError(
                    f"group {self.prompt_id!r} completion {i}: {len(tokens)} tokens but {len(logprobs)} logprobs"
                )
