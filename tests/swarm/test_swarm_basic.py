"""A real swarm on loopback: bootstrap, learner and two rollout peers as separate processes."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from helpers.swarm import RECORD_TTL_S, LocalSwarm, SwarmWatcher, peers_json, wait_until
from safetensors.torch import load_file

from echo2swarm.runtime.processes import child_pids, pid_alive

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(180)]


def test_swarm_syncs_lists_peers_and_forgets_the_dead(local_swarm: LocalSwarm, tiny_model_dir: Path, policy_key: Path):
    local_swarm.bootstrap()
    learner = local_swarm.learner(tiny_model_dir, policy_key)
    # Paced to a crawl: the learner cannot finish a step, so v1 stays the current version while this
    # test checks how it spread (training and newer versions are test_training's business).
    slow = {"ECHO2SWARM_WORKER__MAX_ROLLOUTS_PER_S": "0.5"}
    r1 = local_swarm.rollout("rollout-1", price=0.3, trust=Path(f"{policy_key}.pub"), env=slow)
    r2 = local_swarm.rollout("rollout-2", price=0.45, trust=Path(f"{policy_key}.pub"), env=slow)
    for d in (learner, r1, r2):
        local_swarm.ready(d)
    addr = local_swarm.bootstrap_addr
    assert addr is not None

    def all_four_synced() -> list[dict] | None:
        peers = peers_json(addr, local_swarm.swarm)
        by_role = sorted((p["role"], p["price"], p["version"]) for p in peers)
        want = [("bootstrap", 0.0, None), ("learner", 0.0, 1), ("rollout", 0.3, 1), ("rollout", 0.45, 1)]
        return peers if by_role == want else None

    # Within 30 s of the daemons being up (interpreter start-up on a loaded 2-core box is not the swarm's).
    peers = wait_until(all_four_synced, timeout=30, interval=0.5, what="peers --json to list all four, synced to v1")
    for p in peers:
        assert {"peer_id", "role", "price", "version", "state", "last_seen"} <= p.keys()
        assert p["last_seen"] < 10

    # Both rollout peers hold v1 bit-identical to what the learner published.
    original = (tiny_model_dir / "model.safetensors").read_bytes()
    reference = load_file(tiny_model_dir / "model.safetensors")
    for peer in (r1, r2):
        installed = peer.state_dir / "versions" / "v00000001"
        assert (installed / "model.safetensors").read_bytes() == original
        got = load_file(installed / "model.safetensors")
        assert got.keys() == reference.keys()
        for name, tensor in reference.items():
            assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape
            assert torch.equal(got[name].view(-1).view(torch.uint8), tensor.view(-1).view(torch.uint8))
        assert (installed / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()

    # kill -9 one rollout peer: its card vanishes within one TTL, and its p2pd dies with it.
    victim_id = r2.info["peer_id"]
    p2pd = child_pids(r2.pid)
    assert p2pd, "the daemon should run p2pd as its child"
    with SwarmWatcher(addr, local_swarm.swarm) as watcher:
        assert victim_id in watcher.peers()
        os.kill(r2.pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_until(lambda: victim_id not in watcher.peers(), timeout=RECORD_TTL_S + 10, interval=0.2,
                   what="the killed peer to vanish")
        vanished_after = time.monotonic() - killed
    assert vanished_after <= RECORD_TTL_S + 1.0, f"dead peer listed for {vanished_after:.1f} s, TTL is {RECORD_TTL_S} s"
    assert victim_id not in {p["peer_id"] for p in peers_json(addr, local_swarm.swarm)}
    wait_until(lambda: not any(pid_alive(pid) for pid in p2pd), timeout=5, what="the killed daemon's p2pd to exit")
    # The surviving rollout peer is unaffected.
    assert r1.running()
