"""The sharded learner (FSDP2 over gloo on the CPU) trains as one process does, and micro-batches
accumulate to the same update as the whole minibatch.

Tolerances: the ranks reduce gradients in another order than one process sums them, so losses
agree to ~1e-5 relative; AdamW turns such differences into up to lr-sized moves of coordinates
whose gradient is near zero, so weights after 5 steps at lr 1e-2 agree within 2e-3 (the policy
moves by up to 5e-2 over those steps). The published bytes of the same weights agree exactly.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from echo2swarm.config.rl import TrainConfig, VerifyConfig
from echo2swarm.learner.trainer import GRPOTrainer
from tests.unit.learner.test_trainer_device import make_groups

REPO = Path(__file__).parents[3]
HELPER = REPO / "tests" / "helpers" / "sharded_steps.py"
LOSS_RTOL = 1e-3
WEIGHT_ATOL = 2e-3


def _run(model: Path, out: Path, ranks: int, train: dict) -> dict:
    command = [sys.executable, str(HELPER), str(model), str(out), "--steps", "5", "--train", json.dumps(train)]
    if ranks > 1:
        command[1:2] = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", str(HELPER)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((out / "result.json").read_text())


@pytest.mark.timeout(400)
def test_two_ranks_train_as_one_process(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Same batches, 5 steps of 2 x 2 updates with a KL reference and stale groups verified exactly
    against version 1: W=2 (micro-batches of 3 sequences spread over the ranks) against W=1 (one
    forward per minibatch)."""
    one = _run(tiny_model_dir, tmp_path / "w1", 1, {})
    two = _run(tiny_model_dir, tmp_path / "w2", 2, {"micro_batch_sequences": 3})
    assert (one["world"], two["world"]) == (1, 2)
    assert len(one["steps"]) == len(two["steps"]) == 5
    for a, b in zip(one["steps"], two["steps"]):
        assert b["groups_trained"] == a["groups_trained"] == 4
        assert b["verify_exact"] == a["verify_exact"]
        assert b["updates"] == a["updates"] == 4 and b["skipped_nonfinite"] == 0
        for key in ("loss", "grad_norm", "kl", "clip_frac"):
            assert b[key] == pytest.approx(a[key], rel=LOSS_RTOL, abs=1e-6), key
    assert sum(s["verify_exact"] for s in one["steps"][1:]) > 0  # the spare model held version 1
    assert (tmp_path / "w2" / "initial.bin").read_bytes() == (tmp_path / "w1" / "initial.bin").read_bytes()
    first, second = load_file(tmp_path / "w1" / "final.safetensors"), load_file(tmp_path / "w2" / "final.safetensors")
    assert sorted(first) == sorted(second)
    start = load_file(tiny_model_dir / "model.safetensors")
    moved = max(float((first[k] - start[k]).abs().max()) for k in start)
    assert moved > 10 * WEIGHT_ATOL  # the comparison below means something
    assert max(float((first[k] - second[k]).abs().max()) for k in first) < WEIGHT_ATOL


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
