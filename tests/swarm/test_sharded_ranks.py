"""The sharded learner (FSDP2 over gloo on the CPU, ranks started by torchrun) trains as one process does,
and its sharded checkpoints resume with another world size (micro-batches in one process:
tests/unit/train/test_sharded_trainer.py).

Tolerances: the ranks reduce gradients in another order than one process sums them, so losses,
gradient norms and KL agree to ~1e-6 relative (stated: 1e-4); AdamW turns such differences into
larger moves of coordinates whose gradient is near zero, so after 20 updates at lr 2e-3 weights
agree within 2e-4 (measured: 1.7e-5, while the policy moved by 3.4e-2). At lr 1e-2 the two runs
drift apart chaotically (0.3 % in the fifth step's gradient norm): the test stays at 2e-3. The
published bytes of the same weights agree exactly.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

REPO = Path(__file__).parents[2]
HELPER = REPO / "tests" / "helpers" / "sharded_steps.py"
LOSS_RTOL = 1e-4
WEIGHT_ATOL = 2e-4


def _run(model: Path, out: Path, ranks: int, train: dict, *extra: str, steps: int = 5) -> dict:
    command = [sys.executable, str(HELPER), str(model), str(out), "--steps", str(steps), "--train", json.dumps(train),
               *extra]
    if ranks > 1:
        command[1:2] = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", str(HELPER)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((out / "result.json").read_text())


@pytest.mark.timeout(400)
def test_two_ranks_train_as_one_process(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Same batches, 5 steps of 2 x 2 updates with a KL reference and stale groups verified exactly
    against versions 1 and 2: W=2 (micro-batches of 3 sequences spread over the ranks; the exact checks
    on a verifier daemon's code, which rank 0 asks and whose figures every rank gets) against W=1 (one
    forward per minibatch, exact checks streamed here). The local exact checks of W=2's rank 0 run in
    the checkpoint test below."""
    one = _run(tiny_model_dir, tmp_path / "w1", 1, {"ppo_epochs": 2, "minibatches": 2})
    two = _run(tiny_model_dir, tmp_path / "w2", 2, {"ppo_epochs": 2, "minibatches": 2, "micro_batch_sequences": 3},
               "--remote")
    assert (one["world"], two["world"]) == (1, 2)
    # v1 at the first step (v2 is then its own version), v1 and v2 at each of the other four
    assert two["remote_calls"] == 1 + 2 * 4 and all(s["verify_remote"] == 4 for s in two["steps"][1:])
    assert len(one["steps"]) == len(two["steps"]) == 5
    for step, (a, b) in enumerate(zip(one["steps"], two["steps"])):
        assert b["groups_trained"] == a["groups_trained"] == 4
        assert b["verify_exact"] == a["verify_exact"]
        assert b["updates"] == a["updates"] == 4 and b["skipped_nonfinite"] == 0
        for key in ("loss", "grad_norm", "kl"):
            assert b[key] == pytest.approx(a[key], rel=LOSS_RTOL, abs=1e-6), (step, key)
        assert b["clip_frac"] == pytest.approx(a["clip_frac"], abs=0.02)
    # From the second step on every group is stale: exact checks under versions 1 and 2 in one spare model.
    assert all(s["verify_exact"] == 4 for s in one["steps"][1:])
    assert (tmp_path / "w2" / "initial.bin").read_bytes() == (tmp_path / "w1" / "initial.bin").read_bytes()
    first, second = load_file(tmp_path / "w1" / "final.safetensors"), load_file(tmp_path / "w2" / "final.safetensors")
    assert sorted(first) == sorted(second)
    start = load_file(tiny_model_dir / "model.safetensors")
    moved = max(float((first[k] - start[k]).abs().max()) for k in start)
    assert moved > 10 * WEIGHT_ATOL  # the comparison below means something
    assert max(float((first[k] - second[k]).abs().max()) for k in first) < WEIGHT_ATOL


def _max_diff(a: Path, b: Path) -> float:
    first, second = load_file(a), load_file(b)
    assert sorted(first) == sorted(second)
    return max(float((first[k] - second[k]).abs().max()) for k in first)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sharded_checkpoints_resume_with_another_world_size(tiny_model_dir: Path, tmp_path: Path) -> None:
    """3 steps at W=2, checkpoint (DCP, sharded), 2 more at W=1; and 3 at W=1, checkpoint, 2 more at
    W=2: both end where 5 uninterrupted steps end, AdamW moments included (a fresh optimizer would
    move every coordinate by about lr = 2e-3, ten times the tolerance)."""
    straight = _run(tiny_model_dir, tmp_path / "straight", 1, {})
    _run(tiny_model_dir, tmp_path / "a", 2, {}, "--checkpoint", str(tmp_path / "run-a"), steps=3)
    assert len(list((tmp_path / "run-a" / "checkpoints").glob("step-*/state/.metadata"))) == 1  # sharded, DCP
    resumed_one = _run(tiny_model_dir, tmp_path / "a1", 1, {}, "--resume", str(tmp_path / "run-a"), steps=2)
    _run(tiny_model_dir, tmp_path / "b", 1, {}, "--checkpoint", str(tmp_path / "run-b"), steps=3)
    resumed_two = _run(tiny_model_dir, tmp_path / "b2", 2, {}, "--resume", str(tmp_path / "run-b"), steps=2)
    for resumed in (resumed_one, resumed_two):
        for a, b in zip(straight["steps"][3:], resumed["steps"]):
            assert b["loss"] == pytest.approx(a["loss"], rel=LOSS_RTOL, abs=1e-6)
    assert _max_diff(tmp_path / "straight" / "final.safetensors", tmp_path / "a1" / "final.safetensors") < WEIGHT_ATOL
    assert _max_diff(tmp_path / "straight" / "final.safetensors", tmp_path / "b2" / "final.safetensors") < WEIGHT_ATOL
