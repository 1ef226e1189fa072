"""What a task adapter is: prompts out, rewards in, ground truth kept on the learner.

    learner: task.prompt(i, split) ─► Prompt(prompt_id, text) ─► lease ─► rollout peer
    rollout peer: text ─► model ─► completion ─► learner
    learner: task.reward(prompt_id, completion, finished) ─► float

A prompt id is opaque to rollout peers and never carries the answer; only the learner maps it back
to its ground truth. Tasks are deterministic in (seed, split, index), so a restarted learner hands
out the same prompts for the same ids.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar, runtime_checkable

__all__ = ["SPLITS", "EpochShuffle", "Prompt", "SupervisedTask", "Task", "format_prompt_id", "parse_prompt_id"]

T = TypeVar("T")

SPLITS: tuple[str, ...] = ("train", "eval")

# Strict decimal, no sign or leading zeros: one id per prompt, so ids can key caches and counters.
_PROMPT_ID = re.compile(r"(train|eval):(0|[1-9][0-9]{0,17})")


@dataclass(frozen=True)
class Prompt:
    """One prompt as the learner hands it out in a lease.

    Example::

        Prompt(prompt_id="train:17", text="12+30=")
    """

    prompt_id: str
    """Opaque id the learner hands out in leases, e.g. ``"train:17"``; ground truth is never in it."""
    text: str
    """What the rollout peer feeds the model (chat templates are the task's business)."""


@runtime_checkable
class Task(Protocol):
    """A data-plane adapter: deterministic prompts and a learner-side reward."""

    name: str

    def prompt(self, index: int, split: str = "train") -> Prompt:
        """The prompt at ``index`` of ``split``; deterministic in (seed, split, index).

        The train split is unbounded (any ``index >= 0``); the eval split has ``eval_size()`` prompts.
        """
        ...

    def eval_size(self) -> int:
        """Number of prompts in the eval split."""
        ...

    def reward(self, prompt_id: str, completion: str, finished: bool) -> float:
        """Reward of ``completion`` (decoded text without special tokens) for ``prompt_id``.

        Learner-side only. ``finished`` is true when the completion ended with EOS rather than
        being cut at the token limit. Raises ``ValueError`` for an unknown or malformed prompt id.
        """
        ...


@runtime_checkable
class SupervisedTask(Task, Protocol):
    """A task that also exposes its reference answers, for a supervised warm-up before RL."""

    def answer(self, index: int, split: str = "train") -> str:
        """The reference answer text for the prompt at ``index`` of ``split``."""
        ...


def format_prompt_id(split: str, index: int) -> str:
    return f"{split}:{index}"


def parse_prompt_id(prompt_id: str) -> tuple[str, int]:
    """Split ``"train:17"`` into ``("train", 17)``; anything else raises ``ValueError``."""
    match = _PROMPT_ID.fullmatch(prompt_id) if isinstance(prompt_id, str) else None
    if match is None:
        raise ValueError(f"malformed prompt id {prompt_id!r}: expected 'train:<index>' or 'eval:<index>'")
    return match.group(1), int(match.group(2))


def check_index(index: int, split: str, eval_size: int) -> None:
    """Raise ``ValueError`` unless ``index`` addresses a prompt of ``split``."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: expected one of {', '.join(SPLITS)}")
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"prompt index must be a non-negative int, got {index!r}")
    if split == "eval" and index >= eval_size:
        raise ValueError(f"eval index {index} out of range: the eval split has {eval_size} prompts")


class EpochShuffle(Generic[T]):
    """An unbounded train split over a finite list: index ``i`` is position ``i % n`` of pass
    ``i // n``, each pass a permutation seeded by ``f"{key}:{pass}"``, so deterministic in the key.

    Example::

        order = EpochShuffle(rows, key=f"{seed}:train")
        order[len(rows) + 3]   # the 4th item of the second pass
    """

    def __init__(self, items: Sequence[T], key: str):
        self._items = list(items)
        self._key = key
        self._passes: dict[int, list[T]] = {}

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: int) -> T:
        epoch, position = divmod(index, len(self._items))
        return self._epoch(epoch)[position]

    def _epoch(self, epoch: int) -> list[T]:
        items = self._passes.get(epoch)
        if items is None:
            items = list(self._items)
            random.Random(f"{self._key}:{epoch}").shuffle(items)
            if len(self._passes) >= 4:  # leases stay within a pass or two of each other
                self._passes.clear()
            self._passes[epoch] = items
        return items
