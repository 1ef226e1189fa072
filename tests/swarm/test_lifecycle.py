"""Daemon lifecycle: persistent identity, prompt and complete shutdown on SIGTERM."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from helpers.swarm import LocalSwarm, wait_until

from echo2swarm.runtime.processes import child_pids, pid_alive

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(180)]


def test_same_identity_keeps_peer_id(local_swarm: LocalSwarm, tmp_path: Path):
    local_swarm.bootstrap()
    identity = tmp_path / "ids" / "rollout.id"
    first = local_swarm.rollout("r-first", "--identity", str(identity))
    peer_id = local_swarm.ready(first)["peer_id"]
    assert identity.is_file()
    first.terminate()
    second = local_swarm.rollout("r-second", "--identity", str(identity))
    assert local_swarm.ready(second)["peer_id"] == peer_id
    other = local_swarm.rollout("r-other")
    assert local_swarm.ready(other)["peer_id"] != peer_id


@pytest.mark.parametrize("role", ["bootstrap", "learner", "rollout"])
def test_sigterm_stops_within_5s_leaving_no_children(
    role: str, local_swarm: LocalSwarm, tiny_model_dir: Path, policy_key: Path
):
    boot = local_swarm.bootstrap()
    if role == "bootstrap":
        daemon = boot
    elif role == "learner":
        daemon = local_swarm.learner(tiny_model_dir, policy_key)
        local_swarm.ready(daemon)
    else:
        local_swarm.ready(local_swarm.learner(tiny_model_dir, policy_key))
        daemon = local_swarm.rollout("r", trust=Path(f"{policy_key}.pub"))
        local_swarm.ready(daemon)
        wait_until(lambda: any((daemon.state_dir / "versions").glob("*.manifest")), 30, what="a version installed")
    children = child_pids(daemon.pid)
    assert children, "p2pd should be a child of the daemon"
    assert daemon.proc is not None
    started = time.monotonic()
    daemon.proc.send_signal(signal.SIGTERM)
    daemon.proc.wait(10)
    took = time.monotonic() - started
    assert took < 5.0, f"{role} took {took:.1f} s to stop on SIGTERM"
    assert daemon.proc.returncode == 0
    wait_until(lambda: not any(pid_alive(p) for p in children), timeout=2, what="children (p2pd) to be gone")
    assert not (daemon.state_dir / "daemon.json").exists()
