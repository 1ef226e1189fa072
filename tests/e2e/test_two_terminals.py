"""The README's second way in: `scripts/launch_learner.sh` in one terminal, a rollout peer joining it in
another, exactly as the README shows them."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from helpers.swarm import LOOPBACK_OVERLAY, http_json, learner_toml, read_metrics, run_cli, wait_until

from echo2swarm.runtime.processes import DaemonProcess

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]
REPO = Path(__file__).resolve().parents[2]


# The script writes the demo's warm model: here it finds the session's (`warm_model`) in the run's
# warm model cache (models/warm_cache.py) instead of warming up again; the rest takes about a minute.
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_launch_learner_script_and_a_rollout_peer_joining_it(tmp_path: Path, warm_model_dir: Path):
    # The model and key do not exist yet: the script creates both.
    config = learner_toml(tmp_path / "learner.toml", tmp_path / "model", tmp_path / "learner.key", steps=30,
                          prompts_per_step=4, top={"state_dir": f"{tmp_path}/learner"},
                          sections={"overlay": {**LOOPBACK_OVERLAY, "swarm": "readme"},
                                    "chunk_server": {"host": "127.0.0.1"}})
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "ECHO2SWARM_BIN": str(bin_dir / "echo2swarm"), "PYTHONUNBUFFERED": "1"}
    log = open(tmp_path / "learner.out", "w+")
    # A session of its own, as a terminal gives it: a stop during the warm-up ends the script's children too.
    learner = subprocess.Popen(["bash", str(REPO / "scripts" / "launch_learner.sh"), str(config)],
                               stdout=log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL,
                               start_new_session=True)
    rollout = None
    try:
        def printed_banner() -> str | None:
            output = (tmp_path / "learner.out").read_text()
            if learner.poll() is not None:
                raise AssertionError(f"learner exited:\n{output}")
            return output if re.search(r"^Prometheus metrics: ", output, re.M) else None

        output = wait_until(printed_banner, 720, what="the warm-up, then the learner to print its join address and pages")
        address = re.findall(r"^\s+(/ip4/\S+/p2p/\S+)$", output, re.M)[0]
        # The missing model became the demo's warmed-up tiny model, and the script said so.
        assert "warm-up on arith" in output and f"wrote tiny model to {tmp_path}/model" in output
        # ... the same recipe as the demo's, so the cache gave it the session's warm model
        assert (tmp_path / "model" / "model.safetensors").read_bytes() == (warm_model_dir / "model.safetensors").read_bytes()
        # What it trains, how a rollout peer joins, where its pages are: printed by the learner once up.
        assert f"Training {tmp_path}/model on task 'arith' for 30 steps: staleness S=" in output
        assert re.search(rf"^  echo2swarm daemon --role rollout .*--swarm readme .*--trust {tmp_path}/learner.key.pub$",
                         output, re.M)
        metrics_url = re.findall(r"^Prometheus metrics: (http://127\.0\.0\.1:\d+/metrics)$", output, re.M)[0]
        with urllib.request.urlopen(metrics_url, timeout=10) as resp:
            assert 'echo2swarm_daemon_info{role="learner"' in resp.read().decode()
        for page in re.findall(r"^Live swarm page: (http://\S+/)$", output, re.M):  # where the learner serves one
            with urllib.request.urlopen(page, timeout=10) as resp:
                assert resp.status == 200
        # The second terminal, exactly as the README shows it (plus loopback-only addresses for the test).
        rollout = DaemonProcess("rollout", [
            "--role", "rollout", "--price", "0.3", "--initial-peers", address, "--swarm", "readme",
            "--trust", f"{tmp_path}/learner.key.pub", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--chunk-host", "127.0.0.1",
        ], tmp_path / "rollout", env={"ECHO2SWARM_WORKER__MAX_ROLLOUTS_PER_S": "40"}).start()  # paced: ~0.4 s/step
        info = rollout.wait_ready(90)
        wait_until(lambda: (http_json(info["chunk_url"] + "/v1/info")["version"] or 0) >= 1, 60,
                   what="the rollout peer to hold a version")
        def both_listed_with_versions() -> list | None:
            listing = run_cli("peers", "--initial-peers", address, "--swarm", "readme", "--json")
            assert learner.poll() is None, "the learner finished before it was listed"
            if listing.returncode != 0:
                return None
            peers = json.loads(listing.stdout)
            ok = sorted((p["role"], p["price"]) for p in peers) == [("learner", 0.0), ("rollout", 0.3)]
            return peers if ok and all((p["version"] or 0) >= 1 for p in peers) else None

        wait_until(both_listed_with_versions, 30, interval=0.5, what="peers --json to list both with versions")
        # The two terminals train: the learner runs its steps on the rollout peer's groups and exits.
        learner.wait(240)
        assert learner.returncode == 0, (tmp_path / "learner.out").read_text()[-3000:]
        records = read_metrics(tmp_path / "learner" / "run" / "metrics.jsonl")
        assert [r["step"] for r in records] == list(range(1, 31))
        assert set(records[-1]["delivered"]) == {info["peer_id"]}
        # Warmed up, the model earns rewards from the start (a cold tiny model scores 0 on every step).
        assert sum(r["reward_mean"] for r in records) > 0
    finally:
        if rollout is not None:
            rollout.terminate()
        if learner.poll() is None:
            os.killpg(learner.pid, signal.SIGTERM)  # the group this test started: the script and what it runs
        learner.wait(15)
        log.close()
