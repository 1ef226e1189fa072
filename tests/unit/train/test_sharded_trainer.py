"""Micro-batches accumulate to the same update as the whole minibatch, in one process (the sharded
learner's ranks under torchrun: tests/swarm/test_sharded_ranks.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from echo2swarm.config.rl import TrainConfig, VerifyConfig
from echo2swarm.train.trainer import GRPOTrainer
from helpers.groups import make_groups


@pytest.mark.timeout(120)
def test_micro_batches_accumulate_to_the_same_update(tiny_model_dir: Path) -> None:
    """One process: minibatches split into micro-batches of 3 sequences give the update of one forward."""
    unverified = VerifyConfig(enabled=False)
    for loss_type in ("bnpo", "grpo", "dr_grpo", "dapo"):
        base = TrainConfig(device="cpu", lr=1e-2, seed=1, loss_type=loss_type, kl_coef=0.1)
        whole = GRPOTrainer(tiny_model_dir, base, verify=unverified)
        split = GRPOTrainer(tiny_model_dir, base.model_copy(update={"micro_batch_sequences": 3}), verify=unverified)
        groups = make_groups(whole, n_groups=4, group_size=4)
        a, b = whole.step(groups, current_version=1), split.step(groups, current_version=1)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7), loss_type
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), loss_type
        # AdamW's first update moves every coordinate by about lr, whatever its gradient's size: the
        # rounding of near-zero gradients shows up in the weights at a small fraction of lr.
        after, split_after = whole.weights_state(), split.weights_state()
        for name, tensor in after.items():
            assert torch.allclose(tensor, split_after[name], atol=1e-3), (loss_type, name)
