"""scripts/bench_delta.py runs end to end on a tiny model: real GRPO steps, deltas verified bit-exact, JSON out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).parents[2]


@pytest.mark.timeout(300)
def test_bench_delta_smoke() -> None:
    args = ["--hidden", "64", "--layers", "2", "--heads", "4", "--versions", "2", "--gaps", "1,2",
            "--lr", "1e-4", "--updates", "1x1", "--prompts", "4", "--warmup-steps", "60", "--warmup-lr", "3e-3", "--json"]
    result = subprocess.run([sys.executable, "scripts/bench_delta.py", *args], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "## lr 0.0001, 1 epochs x 1 minibatches" in out and "catch-up to v2" in out
    assert "CHOSEN: e2s-delta/2 (classes by key" in out and "floor given the base's key" in out
    report = json.loads(out[out.index("\n{") + 1:])
    (run,) = report["runs"]
    assert [r["version"] for r in run["versions"]] == [1, 2]
    for row in run["versions"]:
        assert row["dense_bytes"] > 0 and row["delta_bytes"] > 0
        assert row["ratio"] == pytest.approx(row["dense_bytes"] / row["delta_bytes"])
        # The floor (entropy given the base's key) is below what the codec spends, the 17-byte frame aside.
        assert 0 < row["floor_bytes"] <= row["delta_bytes"]
    assert [c["gap"] for c in run["catch_up"]] == [1, 2]
    # Single deltas chain exactly: the gap-1 chain is the last single delta itself.
    assert run["catch_up"][0]["chain_bytes"] == run["versions"][-1]["delta_bytes"]
    assert run["catch_up"][0]["composite_bytes"] == run["versions"][-1]["delta_bytes"]
    assert any(e["encoding"].startswith("CHOSEN") for e in run["encodings"])
    assert all(e["bytes"] > 0 for e in run["encodings"])
