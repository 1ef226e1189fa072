"""`echo2swarm demo --task poker`, as a user runs it: warm-up, swarm, poker rewards on the learner,
the held-out score before and after. A few steps only: the learning itself is in docs/benchmarks.md."""

from __future__ import annotations

import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from helpers.swarm import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.swarm, pytest.mark.timeout(600)]


def test_demo_runs_the_poker_task(tmp_path: Path) -> None:
    run_dir = tmp_path / "demo"
    demo = subprocess.Popen(
        [sys.executable, "-m", "echo2swarm.cli.main", "demo", "--task", "poker", "--run-dir", str(run_dir),
         "--steps", "6", "--warmup-steps", "50", "--engine", "transformers", "--timeout", "300"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
    )
    try:
        output, _ = demo.communicate(timeout=540)
    except subprocess.TimeoutExpired:
        demo.send_signal(signal.SIGINT)  # the demo then stops its daemons
        try:
            output, _ = demo.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            demo.kill()
            output, _ = demo.communicate()
        pytest.fail(f"the demo did not finish in 540 s:\n{output[-3000:]}")
    assert demo.returncode == 0, output[-5000:]
    flat = " ".join(output.split())  # rich wraps lines at the terminal's width
    assert "greedy reward on held-out poker prompts" in flat and "greedy reward (held-out poker)" in flat, output

    config = tomllib.loads((run_dir / "learner.toml").read_text())
    train = config["train"]
    assert (train["task"], train["task_options"], train["max_new_tokens"]) == ("poker", {"answers": "letters"}, 2)
    records = read_metrics(run_dir / "learner" / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 7))
    # The learner scored the peers' completions with the poker task: rewards in [0, 1], not all
    # zero (50 warm-up steps teach the model to answer with the letters), nothing refused.
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in records)
    assert sum(r["reward_mean"] for r in records) > 0
    assert sum(records[-1]["refused"].values()) == 0
