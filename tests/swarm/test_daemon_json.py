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
    seen: dict[str, object] = {}

    def agree() -> bool:
        """The card (as the swarm reads it) and daemon.json both say public, with the same addresses."""
        card = watcher.peers().get(boot.info["peer_id"])
        info = json.loads((boot.state_dir / "daemon.json").read_text())
        seen.update(card=card and {k: card[k] for k in ("reachability", "maddrs")},
                    daemon_json={k: info[k] for k in ("reachability", "card_maddrs", "pid")})
        return bool(card and card["reachability"] == info["reachability"] == "public"
                    and info["card_maddrs"] == card["maddrs"] and info["pid"] == boot.pid)

    with SwarmWatcher(local_swarm.bootstrap_addr, local_swarm.swarm) as watcher:
        # The bootstrap asks the relay (its card says public) every 5 announce periods while unknown.
        try:
            wait_until(agree, timeout=60, what="the bootstrap's card and daemon.json to say public alike")
        except TimeoutError:
            pytest.fail(f"last seen: {seen}")
