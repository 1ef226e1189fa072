"""Cards under their own keys and the roster, through two real DHT nodes (real p2pd, in this process)."""

from __future__ import annotations

import asyncio
import time

from helpers.overlays import overlay_pair
from hivemind.dht.routing import DHTID

from echo2swarm.overlay.dht_keys import card_key, peers_key
from echo2swarm.overlay.storage import BoundedStorage
from echo2swarm.wire.records import PeerCard


def _card(peer_id: str, role: str = "rollout") -> PeerCard:
    return PeerCard(peer_id=peer_id, role=role, price=0.1, state="ready", software="0.1", updated_ms=int(time.time() * 1000))


def test_a_card_is_stored_under_both_keys_and_a_roster_names_the_peers_seen_working() -> None:
    async def scenario() -> None:
        async with overlay_pair("named") as (learner, worker):
            assert isinstance(worker.node.protocol.storage, BoundedStorage)  # what every node keeps is bounded
            assert await worker.store_card(_card(worker.peer_id))
            assert await learner.store_card(_card(learner.peer_id, role="learner"))
            # The worker's card, read by its own key, and under the shared key.
            own = await learner.node.get(card_key("named", worker.peer_id), latest=True)
            shared = await learner.node.get(peers_key("named"), latest=True)
            assert own is not None and set(own.value) == {worker.peer_id}
            assert shared is not None and {worker.peer_id, learner.peer_id} <= set(shared.value)

            # The learner saw the worker deliver; its roster says so, signed, under its own key.
            learner.saw_work(worker.peer_id, "delivered")
            roster = await learner.store_roster()
            assert [e.peer_id for e in roster.peers] == [worker.peer_id]
            cards, bad = await worker.get_cards(prefer=[learner.peer_id])
            assert [c.peer_id for c in cards] == [learner.peer_id, worker.peer_id] and bad == 0
            assert worker.cards.rosters[learner.peer_id].peers[0].work == ["delivered"]

            # Gone from the shared key (as a flood that filled it before the worker's renewal would leave
            # it), the worker's card is still read by name.
            shared_id = DHTID.generate(source=peers_key("named"))
            for node in (learner.node, worker.node):
                del node.protocol.storage.get(shared_id).value[worker.peer_id]
            cards, _ = await learner.get_cards()
            assert worker.peer_id in {c.peer_id for c in cards}
            # A named read (a follower's, placed by a plan) finds it by its own key alone.
            shared_reads = learner.cards.reads["shared"]
            cards, bad = await learner.get_named_cards([worker.peer_id])
            assert [c.peer_id for c in cards] == [worker.peer_id] and bad == 0
            assert learner.cards.reads["shared"] == shared_reads

    asyncio.run(asyncio.wait_for(scenario(), 120))
