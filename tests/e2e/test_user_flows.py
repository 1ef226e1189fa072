"""What a newcomer does first from the README: `echo2swarm demo`, which must learn (the two-terminal way in
is test_two_terminals.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers.swarm import read_metrics, run_cli

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]
# The demo's steps here. From the session's warm model the mean reward of 20 steps rises over the first
# 20's by about +0.08 at step 60, +0.10 at 100, +0.13 at 120, +0.16 at 140, then levels off (+0.13 to
# +0.16 at 200; two runs, 2026-11-28, docs/benchmarks.md "Test suite duration"): 150 steps, and the last
# 30 of them (less scattered than 20) against the first 20.
DEMO_STEPS = 150
LAST = 30


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_demo_learns(tmp_path: Path, warm_model_dir: Path):
    """The CI variant of `make demo`: fewer steps, and the reward must visibly rise. It starts from the
    session's warm model, the one the demo's own warm-up writes (tests/conftest.py `warm_model`), which
    the demo finds in its run directory; the demo's warm-up itself runs in test_demo_poker.py."""
    run_dir = tmp_path / "demo"
    shutil.copytree(warm_model_dir, run_dir / "model")
    result = run_cli("demo", "--run-dir", str(run_dir), "--steps", str(DEMO_STEPS), "--timeout", "480", timeout=580)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "greedy accuracy (held-out arith)" in result.stdout and "stopped:" in result.stdout
    records = read_metrics(run_dir / "learner" / "run" / "metrics.jsonl")
    assert len(records) == DEMO_STEPS
    first = sum(r["reward_mean"] for r in records[:20]) / 20
    last = sum(r["reward_mean"] for r in records[-LAST:]) / LAST
    assert last - first >= 0.1, f"mean reward of the first 20 steps {first:.3f}, of the last {LAST} {last:.3f}"
    png = run_dir / "reward.png"
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Every rollout peer contributed, and every trained group was within the staleness window (S=1).
    assert len(records[-1]["delivered"]) == 2
    assert all(0 <= s <= 1 for r in records for s in r["staleness"])
    # An honest swarm: the learner's verification refused nothing, banned no one, skipped no step.
    assert sum(sum(r.get("verify_refused", {}).values()) for r in records) == 0
    assert sum(r.get("verify_checked", 0) for r in records) >= DEMO_STEPS * 16 * 0.9  # every group was checked
    assert not any(r.get("skipped_nonfinite") for r in records)
