"""A learner over 1,000 signed rollout cards: a test with that many records, not that many processes.

Two real DHT nodes (real p2pd, in this process): the learner's and one that stores, in the DHT,
1,000 cards signed by 1,000 fresh keys (as 1,000 rollout peers would: first in the one shard a
swarm starts with, then in the shards the learner's depth asks for). The learner reads them all,
every store passes its validator's shard check, and its cost-aware activation (learner/
activation_loop.py, the code a running learner uses) plans over all 1,000.
"""

from __future__ import annotations

import asyncio
import math
import random
import time

import pytest
from helpers.overlays import overlay_pair
from hivemind.dht.routing import DHTID
from hivemind.p2p import PeerID
from hivemind.utils.serializer import MSGPackSerializer

from echo2swarm.config.rl import ActivationConfig, TrainConfig
from echo2swarm.learner.activation_loop import LearnerActivation
from echo2swarm.overlay.dht_keys import shard_key, shard_of
from echo2swarm.overlay.node import Overlay
from echo2swarm.wire.peer_keys import PeerKey
from echo2swarm.wire.records import HeadRecord, PeerCard
from echo2swarm.wire.signing import PolicyKey

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]
PEERS = 1000
BATCH = 100  # cards per store request (~70 KB)
MU = 0.5  # rollouts/s each peer delivers


def _cards(swarm: str, n: int) -> list[tuple[str, bytes, float]]:
    rng = random.Random(7)
    out = []
    for _ in range(n):
        key = PeerKey.generate()
        card = PeerCard(peer_id=key.peer_id, role="rollout", price=round(rng.uniform(0.1, 1.0), 4), state="ready",
                        software="0.1", version=3, rollouts_per_s=MU, updated_ms=int(time.time() * 1000)
                        ).signed(key, swarm, 120.0)
        out.append((key.peer_id, MSGPackSerializer.dumps(card.model_dump(mode="json")), card.price))
    return out


async def _store(writer: Overlay, learner: Overlay, cards: list[tuple[str, bytes, float]], bits: int) -> int:
    """Store each card in its shard at depth `bits`, on both DHT nodes (the writer's own storage and the
    learner's, over the network, where its validator checks every card); how many the learner's node took."""
    swarm, expires = writer.config.swarm, time.time() + 120.0
    target = PeerID.from_base58(learner.peer_id)
    took = 0
    for i in range(0, len(cards), BATCH):
        batch = cards[i:i + BATCH]
        keys = [DHTID.generate(source=shard_key(swarm, bits, shard_of(p, bits))) for p, _, _ in batch]
        for key, (peer, value, _) in zip(keys, batch):
            writer.node.protocol.storage.store(key, value, expires, subkey=MSGPackSerializer.dumps(peer))
        reply = await asyncio.wait_for(writer.node.protocol.call_store(
            target, keys, [v for _, v, _ in batch], expires, subkeys=[p for p, _, _ in batch]), 60)
        took += sum(reply or [])
    return took


def test_a_learner_reads_and_plans_over_a_thousand_signed_cards() -> None:
    async def scenario() -> None:
        async with overlay_pair("many") as (learner, writer):
            cards = _cards("many", PEERS)
            price = {p: c for p, _, c in cards}

            # A swarm that grew to 1,000 peers in the one shard it started with: a read keeps max_cards of
            # them, says how many it left out (never silently), and asks for a depth that fits them.
            assert await _store(writer, learner, cards, 0) == PEERS
            first, _ = await learner.get_cards()
            assert len(first) == learner.config.max_cards == 256
            assert learner.cards_dropped == PEERS - 256
            bits = learner.cards.depth.wanted(learner.config.max_card_shard_bits)
            assert bits == math.ceil(math.log2(PEERS / 128)) == 3

            # The learner's head carries the depth; the peers store their cards in those shards (the
            # learner reads the old one too until every card is re-announced).
            learner.set_card_shards(bits)
            assert await _store(writer, learner, cards, bits) == PEERS
            before = learner.cards.reads["shared"]
            read, bad = await learner.get_cards()
            assert bad == 0 and {c.peer_id for c in read} == set(price)  # all 1,000, none left out
            # 8 shards; the one of depth 0, still read while the depth before is held, held more than max_cards
            # at the first read, so within a TTL its kept cards are reused rather than read again
            assert learner.cards.reads["shared"] - before == 8
            assert learner.cards.depth.count == PEERS
            sizes = [learner.cards.shard_sizes[shard_key("many", 3, s)] for s in range(8)]
            assert sum(sizes) == PEERS and max(sizes) < 256  # no shard near a reader's bound

            # A daemon takes the depth from the learner's signed head and stores its own card in its shard at
            # the new depth and, while the old one is held, at the old one (Overlay.store_card).
            policy = PolicyKey.generate()
            head = HeadRecord(swarm="many", version=1, manifest_sha256="ab" * 32, manifest_size=1,
                              publisher=learner.peer_id, published_ms=1, expires_ms=int(time.time() * 1000) + 30_000,
                              public_key=policy.public.text, card_shard_bits=bits).signed(policy)
            writer.shards_from([head])
            assert writer.cards.depth.depths() == [3, 0]
            assert await writer.store_card(PeerCard(peer_id=writer.peer_id, role="relay", price=0.0, state="ready",
                                                    software="0.1", updated_ms=int(time.time() * 1000)))
            for depth in (3, 0):
                found = await learner.node.get(shard_key("many", depth, shard_of(writer.peer_id, depth)), latest=True)
                assert found is not None and writer.peer_id in found.value

            # A card in a shard its id does not hash into is refused by the learner's node.
            wrong = shard_key("many", 3, shard_of(cards[0][0], 3) ^ 1)
            reply = await learner_store(writer, learner, wrong, cards[0])
            assert reply == [False] and learner.validator.reasons["shard"] >= 1

            # The learner's activation over every card: each peer delivered and passed verification, so
            # the plan is the cheapest set whose µ meets the floor, chosen from all 1,000.
            train = TrainConfig(prompts_per_step=8, group_size=8)
            activation = LearnerActivation(ActivationConfig(min_steps=2, plan_after_groups=2), train)
            for _ in range(3):
                activation.on_step(1.0)
            for peer in price:
                activation.on_delivery(peer, 8, 8 / MU)
                activation.on_verified([peer, peer])
            started = time.monotonic()
            activation.replan(read, seen=set(price))
            took = time.monotonic() - started
            plan = activation.last_plan
            assert len(activation.workers) == PEERS and plan["feasible"], plan["reason"]
            active = set(plan["active"])
            need = math.ceil(plan["floor"] / MU - 1e-9)
            assert len(active) == need
            assert active == set(sorted(price, key=lambda p: (price[p], p))[:need])  # the cheapest, from every shard
            assert {shard_of(p, 3) for p in active} == set(range(8))
            assert took < activation.config.replan_period_s, f"a re-plan over {PEERS} peers took {took:.1f} s"

    asyncio.run(asyncio.wait_for(scenario(), 200))


async def learner_store(writer: Overlay, learner: Overlay, key: str, card: tuple[str, bytes, float]) -> list[bool]:
    reply = await writer.node.protocol.call_store(PeerID.from_base58(learner.peer_id), [DHTID.generate(source=key)],
                                                   [card[1]], time.time() + 60, subkeys=[card[0]])
    return list(reply or [])
