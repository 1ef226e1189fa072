"""Daemon lifecycle: persistent identity, prompt and complete shutdown on SIGTERM."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from helpers.swarm import LocalSwarm, learner_toml, read_metrics, wait_until

from echo2swarm.runtime.processes import child_pids, pid_alive

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def boot(module_swarm: LocalSwarm) -> LocalSwarm:
    """The bootstrap these tests share: the daemons they stop are their own."""
    module_swarm.bootstrap()
    return module_swarm


@pytest.fixture(scope="module")
def served(boot: LocalSwarm, tiny_model_dir: Path, module_policy_key: Path) -> LocalSwarm:
    """The shared bootstrap and a shared learner serving v1."""
    boot.ready(boot.learner(tiny_model_dir, module_policy_key))
    return boot


def test_same_identity_keeps_peer_id(boot: LocalSwarm, joined_swarm: LocalSwarm, tmp_path: Path):
    identity = tmp_path / "ids" / "rollout.id"
    first = joined_swarm.rollout("r-first", "--identity", str(identity))
    peer_id = joined_swarm.ready(first)["peer_id"]
    assert identity.is_file()
    first.terminate()
    second = joined_swarm.rollout("r-second", "--identity", str(identity))
    assert joined_swarm.ready(second)["peer_id"] == peer_id
    other = joined_swarm.rollout("r-other")
    assert joined_swarm.ready(other)["peer_id"] != peer_id


@pytest.mark.parametrize("role", ["bootstrap", "learner", "rollout"])
def test_sigterm_stops_within_5s_leaving_no_children(
    role: str, local_swarm: LocalSwarm, tiny_model_dir: Path, policy_key: Path, module_policy_key: Path,
    request: pytest.FixtureRequest,
):
    if role == "bootstrap":
        daemon = local_swarm.bootstrap()
    else:
        request.getfixturevalue("boot" if role == "learner" else "served")  # a rollout peer needs a learner
        local_swarm = request.getfixturevalue("joined_swarm")
        if role == "learner":
            daemon = local_swarm.learner(tiny_model_dir, policy_key)  # a key of its own: not the shared learner's
            local_swarm.ready(daemon)
        else:
            daemon = local_swarm.rollout("r", trust=Path(f"{module_policy_key}.pub"))
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


def test_a_peer_restarted_after_its_bootstrap_is_gone_rejoins_through_the_peers_it_saw_working(
    local_swarm: LocalSwarm, tiny_model_dir: Path, policy_key: Path, tmp_path: Path
):
    """The bootstrap is one machine: when it is gone, a rollout peer restarted with the same --initial-peers
    joins through rejoin.json (the learner it fetched verified chunks from) and works again. Its first
    start names a dead address beside the bootstrap: one live initial peer is enough."""
    bootstrap = local_swarm.bootstrap()
    learner = local_swarm.start("learner", "--config", str(learner_toml(tmp_path / "learner.toml", tiny_model_dir,
                                                                         policy_key, steps=2000)))
    learner_id = local_swarm.ready(learner)["peer_id"]
    trust = Path(f"{policy_key}.pub")
    dead = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDNSVj168KNjs6cqwmWsqdg9DGvdYcN1E7seBqHR5mAL2"  # nothing listens on 9
    first = local_swarm.rollout("rollout", "--initial-peers", dead, trust=trust)
    local_swarm.ready(first)
    saved = first.state_dir / "rejoin.json"
    wait_until(lambda: saved.exists() and learner_id in saved.read_text(), 60, interval=0.5,
               what="the rollout peer to keep the learner in rejoin.json")
    bootstrap.terminate()
    first.terminate()
    again = local_swarm.rollout("rollout", "--initial-peers", dead, trust=trust)  # same state dir and flags: all dead
    peer_id = local_swarm.ready(again, timeout=90)["peer_id"]
    assert "rejoining through" in again.log_path.read_text()
    metrics = learner.state_dir / "run" / "metrics.jsonl"

    def delivered() -> int:
        records = read_metrics(metrics)
        return records[-1]["delivered"].get(peer_id, 0) if records else 0

    wait_until(lambda: delivered() > 0, 90, interval=0.5, what="the restarted peer to deliver groups again")
