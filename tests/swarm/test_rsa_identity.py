"""An RSA identity file (what hivemind's `P2P.generate_identity` writes) runs a daemon with auto-relay on.

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
