"""Identity files: an RSA one (what hivemind's `P2P.generate_identity` writes) runs a daemon with
auto-relay on; one the daemon cannot use is refused before anything starts, saying what to do.

p2pd once panicked at start with such a file ("Daemon with autoRelay requires either -relayDiscovery=1
or -trustedRelays"), reported as "could not reach any of --initial-peers" after under a second: hivemind's
is-this-identity-taken probe, run only for RSA files, started a second p2pd with our static-relay flags
and without the relays.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.swarm import LocalSwarm, SwarmWatcher, wait_until

from echo2swarm.wire.peer_keys import PeerKey

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]


def test_a_hivemind_rsa_identity_joins_with_auto_relay_and_signs_its_card(local_swarm: LocalSwarm, tmp_path: Path):
    from hivemind.p2p import P2P

    identity = tmp_path / "rsa.id"
    P2P.generate_identity(str(identity))
    key = PeerKey.load(identity)
    assert not key.is_ed25519 and key.peer_id.startswith("Qm")
    local_swarm.bootstrap()
    assert local_swarm.bootstrap_addr is not None
    relay = local_swarm.start("rsa-relay", "--role", "relay", "--identity", str(identity))  # auto-relay is the default
    assert local_swarm.ready(relay, timeout=60)["peer_id"] == key.peer_id
    with SwarmWatcher(local_swarm.bootstrap_addr, local_swarm.swarm) as watcher:
        # Its card carries its RSA public key (the peer id is a hash of it) and every reader verifies it.
        wait_until(lambda: key.peer_id in watcher.peers(), timeout=30, what="the RSA peer's card to be read")


def test_doctor_reads_the_identity_file_as_the_daemon_does(tmp_path: Path, policy_key: Path):
    import json

    from hivemind.p2p import P2P
    from helpers.swarm import run_cli

    rsa = tmp_path / "rsa.id"
    P2P.generate_identity(str(rsa))
    common = ["--role", "relay", "--json", "--timeout", "5", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--state-dir", str(tmp_path / "s")]
    ok = run_cli("doctor", "--identity", str(rsa), *common, timeout=120)
    checks = {c["name"]: c for c in json.loads(ok.stdout)}
    assert checks["identity"]["status"] == "ok" and "RSA-2048" in checks["identity"]["detail"], checks
    assert checks["p2pd"]["status"] == "ok" and PeerKey.load(rsa).peer_id in checks["p2pd"]["detail"], checks
    # The policy key where the identity belongs: said at once, and nothing started on it.
    bad = run_cli("doctor", "--identity", str(policy_key), *common, timeout=120)
    checks = {c["name"]: c for c in json.loads(bad.stdout)}
    assert bad.returncode == 1 and checks["identity"]["status"] == "fail" and "PEM" in checks["identity"]["detail"]
    assert "p2pd" not in checks, "the network checks wait until the identity file is usable"


def test_an_unusable_identity_file_is_refused_at_start_with_what_to_do(tmp_path: Path, policy_key: Path):
    import time

    from helpers.swarm import run_cli

    started = time.monotonic()
    result = run_cli("daemon", "--role", "relay", "--new-swarm", "--identity", str(policy_key),
                     "--state-dir", str(tmp_path / "s"), "--host-maddrs", "/ip4/127.0.0.1/tcp/0", timeout=60)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"error: --identity {policy_key}" in result.stderr and "PEM file" in result.stderr
    assert "give --identity a path of its own" in result.stderr
    assert not (tmp_path / "s").exists() and time.monotonic() - started < 30  # refused before the state dir, p2pd
