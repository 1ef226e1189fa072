"""What the learner asks of a trainer: the seam between the swarm-facing learner and the training stack.

    learner (intake, publisher, checkpoints)  ──►  Trainer  ◄──  GRPOTrainer (one process, trainer.py)
                                                            ◄──  ShardedTrainer (rank 0 of W, distributed.py)

The learner never reaches past this Protocol: it tokenises prompts with it, hands it a step's
groups, asks it for the published cast of its weights, and saves, restores or rolls it back.
Every call runs in a worker thread (the trainer blocks; the learner's event loop does not).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from echo2swarm.train.group import Group

if TYPE_CHECKING:
    import torch


class Trainer(Protocol):
    world: int  # ranks training the policy together (1: one process)

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends a completion (engines stop on any of them)."""

    @property
    def optimizer(self) -> "torch.optim.Optimizer": ...

    def encode_prompt(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def step(self, groups: list[Group], current_version: int) -> dict[str, Any]:
        """One GRPO step; the stats include ``refused_groups`` [(peer_id, prompt_id, reason)]."""

    def weights_state(self, dtype: "torch.dtype | None" = None, hold_from: "dict[str, torch.Tensor] | None" = None,
                      hold_ulps: float = ...) -> "dict[str, torch.Tensor]":
        """The policy's tensors on the CPU cast to ``dtype`` (train/rounding.py holds values of
        ``hold_from``); raises NonFiniteWeightsError rather than return a NaN or an inf."""

    def load_weights(self, tensors: "dict[str, torch.Tensor]") -> None: ...

    def reset_optimizer(self) -> None: ...

    def assert_finite(self) -> None: ...

    def save_state(self, path: Path) -> None: ...

    def load_state(self, path: Path) -> None: ...

    def save_model_dir(self, out_dir: Path) -> Path: ...

    def close(self) -> None: ...
