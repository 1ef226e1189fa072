"""What a newcomer does from the README: the demo, and a learner plus a rollout peer in two terminals."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.swarm import http_json, run_cli, wait_until

from echo2swarm.runtime.processes import DaemonProcess

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]
REPO = Path(__file__).resolve().parents[2]


def test_demo_syncs_the_swarm_and_stops_cleanly(tmp_path: Path):
    result = run_cli("demo", "--run-dir", str(tmp_path / "demo"), "--timeout", "90", timeout=200)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "every rollout peer verified and installed policy v1" in result.stdout
    assert re.search(r"rollout peers holding policy v1 .* 2/2", result.stdout)
    assert "stopped:" in result.stdout
    for name in ("rollout-1", "rollout-2"):
        installed = tmp_path / "demo" / name / "versions" / "v00000001" / "model.safetensors"
        assert installed.read_bytes() == (tmp_path / "demo" / "model" / "model.safetensors").read_bytes()


def test_launch_learner_script_and_a_rollout_peer_joining_it(tmp_path: Path):
    config = tmp_path / "learner.toml"
    config.write_text(f"""
role = "learner"
state_dir = "{tmp_path}/learner"
[publish]
model = "{tmp_path}/model"
policy_key = "{tmp_path}/learner.key"
[overlay]
swarm = "readme"
new_swarm = true
host_maddrs = ["/ip4/127.0.0.1/tcp/0"]
announce_period_s = 1.0
record_ttl_s = 4.0
[chunk_server]
host = "127.0.0.1"
""")
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "ECHO2SWARM_BIN": str(bin_dir / "echo2swarm"), "PYTHONUNBUFFERED": "1"}
    log = open(tmp_path / "learner.out", "w+")
    learner = subprocess.Popen(["bash", str(REPO / "scripts" / "launch_learner.sh"), str(config)],
                               stdout=log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL)
    rollout = None
    try:
        def printed_address() -> str | None:
            found = re.findall(r"^\s+(/ip4/\S+/p2p/\S+)$", (tmp_path / "learner.out").read_text(), re.M)
            if learner.poll() is not None:
                raise AssertionError(f"learner exited:\n{(tmp_path / 'learner.out').read_text()}")
            return found[0] if found else None

        address = wait_until(printed_address, 90, what="the learner to print its join address")
        output = (tmp_path / "learner.out").read_text()
        assert f"--trust {tmp_path}/learner.key.pub" in output
        # The second terminal, exactly as the README shows it (plus loopback-only addresses for the test).
        rollout = DaemonProcess("rollout", [
            "--role", "rollout", "--price", "0.3", "--initial-peers", address, "--swarm", "readme",
            "--trust", f"{tmp_path}/learner.key.pub", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--chunk-host", "127.0.0.1",
        ], tmp_path / "rollout").start()
        info = rollout.wait_ready(90)
        wait_until(lambda: http_json(info["chunk_url"] + "/v1/info")["version"] == 1, 60, what="the rollout peer at v1")
        peers = json.loads(run_cli("peers", "--initial-peers", address, "--swarm", "readme", "--json").stdout)
        assert sorted((p["role"], p["price"], p["version"]) for p in peers) == [("learner", 0.0, 1), ("rollout", 0.3, 1)]
    finally:
        if rollout is not None:
            rollout.terminate()
        learner.send_signal(signal.SIGTERM)
        learner.wait(15)
        log.close()
