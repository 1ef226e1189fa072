"""Forged and flooded peer cards on a real swarm: refused where forged, bounded where valid.

The case seen on a local swarm before cards were signed: anyone could store a card under any
peer id. A card under the learner's id with a slow chunk URL sent every follower to the wrong
server, a forged `stopping` card removed an honest peer from the plan, and 2000 fake cards from
one client filled the broadcast plan, doubled the learner's memory and emptied `peers --json`.

The rogue here is a real hivemind DHT node in this process, speaking our keys with no validator
of its own (so it sends exactly the bytes it wants). The honest daemons (bootstrap, learner, one
rollout peer) are separate processes on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.swarm import LocalSwarm, http_json, learner_toml, peers_json, run_cli, wait_until

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(420)]
FLOOD = 500
STORE_TIMEOUT_S = 20.0


def _info(daemon: Any) -> dict[str, Any]:
    return http_json(daemon.info["chunk_url"] + "/v1/info")


def _refused(daemon: Any) -> int:
    return _info(daemon)["stats"]["dht_refused"]


async def _rogue(bootstrap: str, swarm: str, learner_id: str, rollout_id: str, slow_url: str, flood: int) -> dict:
    """Store the forged cards, then (if `flood`) that many validly signed cards from fresh keys."""
    from hivemind.dht.node import DHTNode
    from hivemind.p2p import P2P

    from echo2swarm.overlay.dht_keys import peers_key
    from echo2swarm.wire.peer_keys import PeerKey
    from echo2swarm.wire.records import PeerCard
    from echo2swarm.wire.signing import DOMAIN_CARD

    p2p = await asyncio.wait_for(P2P.create(initial_peers=[bootstrap], host_maddrs=["/ip4/127.0.0.1/tcp/0"]), 60)
    node = await asyncio.wait_for(DHTNode.create(p2p=p2p, initial_peers=[bootstrap], client_mode=True), 60)
    key = peers_key(swarm)
    outcome: dict[str, Any] = {}

    async def store(value: dict, subkey: str, ttl: float = 60.0) -> bool:
        return bool(await asyncio.wait_for(node.store(key, value, time.time() + ttl, subkey=subkey), STORE_TIMEOUT_S))

    try:
        found = await asyncio.wait_for(node.get(key, latest=True), STORE_TIMEOUT_S)
        assert found is not None, "the rogue reads no cards at all"
        cards = {k: v.value for k, v in found.value.items()}
        rogue = PeerKey.generate()
        now_ms = int(time.time() * 1000)

        # (a) The learner's card pointing at a slow server: its own signature no longer covers it...
        slow = dict(cards[learner_id], chunk_url=slow_url, updated_ms=now_ms, expires_ms=now_ms + 60_000)
        outcome["learner_tampered"] = await store(slow, learner_id)
        # ...and a fresh signature by the rogue's key does not name the learner's peer id.
        forged = PeerCard.model_validate({**slow, "signature": ""})
        forged = forged.model_copy(update={"signature": rogue.sign(DOMAIN_CARD, forged.signing_payload(swarm)).hex()})
        outcome["learner_forged"] = await store(forged.model_dump(mode="json"), learner_id)
        # (b) The honest rollout peer marked `stopping`.
        outcome["stopping"] = await store(dict(cards[rollout_id], state="stopping"), rollout_id)
        # (c) Price 0 and a huge µ under the rogue's own key, unsigned.
        cheap = PeerCard(peer_id=rogue.peer_id, role="rollout", price=0.0, state="ready", software="0.1",
                         rollouts_per_s=1e7, chunk_url=slow_url, updated_ms=now_ms)
        outcome["unsigned"] = await store(cheap.model_dump(mode="json"), rogue.peer_id)
        # (d) A replay: the rollout peer's genuine card, kept far past its signed expiry.
        outcome["replay"] = await store(cards[rollout_id], rollout_id, ttl=1800.0)

        if flood:
            async def one() -> bool:
                fake = PeerKey.generate()
                card = PeerCard(peer_id=fake.peer_id, role="rollout", price=0.0, state="ready", software="0.1",
                                rollouts_per_s=1e7, chunk_url=slow_url, version=1, held=[1],
                                updated_ms=int(time.time() * 1000)).signed(fake, swarm, 120.0)
                return await store(card.model_dump(mode="json"), fake.peer_id, ttl=120.0)

            stored = 0
            for _ in range(0, flood, 50):  # batches: one client, many keys
                stored += sum(await asyncio.gather(*(one() for _ in range(50))))
            outcome["flood_stored"] = stored
    finally:
        await node.shutdown()
        await p2p.shutdown()
    return outcome


@pytest.mark.slow
def test_forged_cards_are_refused_and_a_flood_of_signed_cards_stays_bounded(
    local_swarm: LocalSwarm, tiny_model_dir: Path, policy_key: Path, tmp_path: Path
):
    local_swarm.bootstrap()
    config = learner_toml(tmp_path / "learner.toml", tiny_model_dir, policy_key, steps=100_000)
    learner = local_swarm.start("learner", "--config", str(config))
    rollout = local_swarm.rollout("gen", trust=Path(f"{policy_key}.pub"))
    for d in (learner, rollout):
        local_swarm.ready(d)
    addr, swarm = local_swarm.bootstrap_addr, local_swarm.swarm
    assert addr is not None
    learner_id, rollout_id = learner.info["peer_id"], rollout.info["peer_id"]
    learner_source = f"learner:{learner_id[-8:]}"

    wait_until(lambda: _info(rollout)["version"] and _info(rollout)["version"] >= 2, 120, interval=0.5,
               what="the rollout peer to follow the training learner to v2")

    # A server that accepts connections and never answers: the "slow chunk_url".
    with socket.socket() as tarpit:
        tarpit.bind(("127.0.0.1", 0))
        tarpit.listen(64)
        slow_url = f"http://127.0.0.1:{tarpit.getsockname()[1]}"

        learner_refused, rollout_refused = _refused(learner), _refused(rollout)
        version_before = _info(learner)["version"]
        outcome = asyncio.run(asyncio.wait_for(_rogue(addr, swarm, learner_id, rollout_id, slow_url, flood=0), 120))
        # Every honest node refused every forged record: nobody stored them.
        assert not any(outcome.values()), outcome
        wait_until(lambda: _refused(learner) >= learner_refused + 5 and _refused(rollout) >= rollout_refused + 5, 30,
                   interval=0.5, what="the learner and the rollout peer to count the five refused cards")

        peers = {p["peer_id"]: p for p in peers_json(addr, swarm)}
        assert set(peers) == {d.info["peer_id"] for d in local_swarm.daemons}
        assert peers[learner_id]["chunk_url"] == learner.info["chunk_url"]
        assert peers[rollout_id]["state"] != "stopping"

        # The follower still gets each new version from the learner (the only other peer holding it;
        # the tiny model's versions share their chunks, so mostly manifests), never from the tarpit.
        wait_until(lambda: _info(rollout)["version"] >= version_before + 2, 120, interval=0.5,
                   what="the rollout peer to fetch two more versions from the learner")
        assert set(_info(rollout)["stats"]["fetched_from"]) <= {learner_source}

        # A flood of validly signed cards, each from a fresh key: stored (they are genuine cards),
        # but neither `peers` nor the learner is swamped.
        outcome = asyncio.run(asyncio.wait_for(_rogue(addr, swarm, learner_id, rollout_id, slow_url, flood=FLOOD), 300))
        assert outcome["flood_stored"] >= FLOOD * 0.9, outcome
        version_after_flood = _info(learner)["version"]

        def honest_listed() -> bool:
            result = run_cli("peers", "--initial-peers", addr, "--swarm", swarm, "--json", timeout=60)
            if result.returncode != 0:
                return False
            import json

            listed = {p["peer_id"]: p for p in json.loads(result.stdout)}
            return (all(d.info["peer_id"] in listed for d in local_swarm.daemons)
                    and listed[learner_id]["chunk_url"] == learner.info["chunk_url"])

        wait_until(honest_listed, 90, interval=1.0, what="peers --json to list the honest peers through the flood")
        wait_until(lambda: _info(learner)["version"] >= version_after_flood + 3, 120, interval=0.5,
                   what="the learner to keep training through the flood")
        wait_until(lambda: _info(rollout)["version"] >= version_after_flood + 2, 120, interval=0.5,
                   what="the rollout peer to keep following through the flood")
    assert learner.running() and rollout.running()


def test_peers_says_what_to_check_when_it_reads_no_card(local_swarm: LocalSwarm):
    """A swarm name nobody uses: no card at all. Exit non-zero with a hint, in --json mode too."""
    local_swarm.bootstrap()
    assert local_swarm.bootstrap_addr is not None
    for extra in ((), ("--json",)):
        result = run_cli("peers", "--initial-peers", local_swarm.bootstrap_addr, "--swarm", "nobody-here", *extra,
                         "--timeout", "20", timeout=90)
        assert result.returncode != 0, result.stdout
        assert "no peer card readable in swarm 'nobody-here'" in result.stderr
        assert "--swarm" in result.stderr and "reachable" in result.stderr
        assert result.stdout.strip() == ""
