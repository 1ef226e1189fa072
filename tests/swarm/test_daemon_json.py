"""daemon.json says what the card says: its reachability and card addresses follow the card's.

A bootstrap starts with nobody to dial it back (`unknown`) and learns `public` once a peer has joined;
its daemon.json, written once at start, kept saying `unknown` (issue 32: an implementer read it).
"""

from __future__ import annotations

import json

import pytest
from helpers.swarm import LocalSwarm, SwarmWatcher, wait_until

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]


def test_daemon_json_reachability_follows_the_card(local_swarm: LocalSwarm) -> None:
    boot = local_swarm.bootstrap()
    assert boot.info["reachability"] == "unknown"  # nobody to ask yet
    local_swarm.ready(local_swarm.start("relay", "--role", "relay"))
    assert local_swarm.bootstrap_addr is not None
    with SwarmWatcher(local_swarm.bootstrap_addr, local_swarm.swarm) as watcher:
        # The bootstrap asks the relay (its card says public) within 5 announce periods while unknown.
        card = wait_until(lambda: (c := watcher.peers().get(boot.info["peer_id"])) and c["reachability"] == "public"
                          and c, timeout=45, what="the bootstrap's card to say public")

        def written() -> dict[str, object] | None:
            info = json.loads((boot.state_dir / "daemon.json").read_text())
            return info if info["reachability"] == "public" else None

        info = wait_until(written, timeout=10, what="daemon.json to say public as the card does")
    assert info["card_maddrs"] == card["maddrs"] and info["pid"] == boot.pid
