"""`echo2swarm demo --engine vllm`: the swarm learns with vLLM rollout peers, as with transformers."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.swarm import read_metrics

pytestmark = [pytest.mark.vllm, pytest.mark.swarm, pytest.mark.timeout(900)]


def test_demo_learns_with_vllm_peers(tmp_path: Path) -> None:
    run_dir = tmp_path / "demo"
    demo = subprocess.Popen(
        [sys.executable, "-m", "echo2swarm.cli.main", "demo", "--engine", "vllm", "--run-dir", str(run_dir),
         "--steps", "300", "--timeout", "600"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
    )
    try:
        output, _ = demo.communicate(timeout=860)
    except subprocess.TimeoutExpired:
        # SIGINT, not SIGKILL: the demo then stops its bootstrap, learner and rollout daemons.
        demo.send_signal(signal.SIGINT)
        try:
            output, _ = demo.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            demo.kill()
            output, _ = demo.communicate()
        pytest.fail(f"the demo did not finish in 860 s:\n{output[-3000:]}")
    assert demo.returncode == 0, output[-5000:]
    print(output[-2500:])
    records = read_metrics(run_dir / "learner" / "run" / "metrics.jsonl")
    assert len(records) == 300
    first = sum(r["reward_mean"] for r in records[:20]) / 20
    last = sum(r["reward_mean"] for r in records[-20:]) / 20
    assert last - first >= 0.1, f"mean reward of the first 20 steps {first:.3f}, of the last 20 {last:.3f}"
    assert len(records[-1]["delivered"]) == 2  # both peers contributed
    # Honest vLLM peers pass the learner's verification: nothing refused, no step skipped. The learner
    # requires seeded sampling (its default): none of their groups was refused as unseeded, and it
    # re-derived the vLLM engines' choices wherever it had their version's logits.
    refused = sum(sum(r.get("verify_refused", {}).values()) for r in records)
    choices = [r.get("verify_choices", 0) for r in records]
    print(f"verification: {sum(r.get('verify_checked', 0) for r in records)} groups checked, "
          f"{sum(r.get('verify_exact', 0) for r in records)} against their exact version, {sum(choices)} with "
          f"their seeded choices re-derived, {refused} refused")
    assert refused == 0
    assert records[-1]["refused"].get("unseeded", 0) == 0, records[-1]["refused"]
    assert sum(choices) > 0
    assert not any(r.get("skipped_nonfinite") for r in records)
    total = 0
    for peer in ("rollout-1", "rollout-2"):
        log = (run_dir / peer / "daemon.log").read_text()
        assert "rollout engine: vllm (asked for 'vllm')" in log
        # New versions were swapped into the running engine, never into a rebuilt one. Not every
        # one of the 300: a peer whose loads would take over worker.max_refit_share of its time
        # skips versions while the staleness window allows, and one the learner's capacity model
        # keeps on standby (one peer can be enough for this tiny model) loads few.
        assert log.count("vllm engine: ") == 1, log[-2000:]
        found = re.findall(r"reloaded \d+ tensors from \S+ in place \((\w+)\) in ([\d.]+) s", log)
        assert {mode for mode, _ in found} == {"direct"}, found[:3]  # a CPU and an unquantized model
        refits = [float(seconds) for _, seconds in found]
        assert refits, f"{peer} never refit"
        total += len(refits)
        print(f"{peer}: {len(refits)} in-place refits, median {sorted(refits)[len(refits) // 2] * 1000:.0f} ms")
    # With S = 1 a version trains at most two steps, so the peers that generated for all 300 steps
    # loaded at least ~150 versions between them.
    assert total >= 150, total
