"""Card shards (overlay/dht_keys.py): where a card lives at each depth, the depth a learner asks for, the
validator's shard check, and which shards a whole, sampled or paged read looks in."""

from __future__ import annotations

import asyncio
import hashlib
import time
from types import SimpleNamespace

import pytest
from hivemind.dht.validation import DHTRecord
from hivemind.utils.serializer import MSGPackSerializer

from echo2swarm.config.models import OverlayConfig
from echo2swarm.overlay.cards import PAGE_SHARDS
from echo2swarm.overlay.shards import ShardDepth
from echo2swarm.overlay.dht_keys import CARDS_PER_SHARD, MAX_SHARD_BITS, peers_key, shard_key, shard_keys, shard_of
from echo2swarm.overlay.node import Overlay
from echo2swarm.overlay.validation import SwarmRecordValidator, key_id
from echo2swarm.wire.peer_keys import PeerKey
from echo2swarm.wire.records import HeadRecord, PeerCard, parse_head
from echo2swarm.wire.signing import PolicyKey

SWARM = "shards"


def test_shard_of_is_the_leading_bits_of_the_peer_ids_sha256() -> None:
    # Test vectors for docs/protocol.md §4.1 (an independent implementation must agree).
    peer = "12D3KooWJ6B2dR1cj3sPNvLxGcUW4bXJmXhAEc3X8aMdkQx4yWqb"
    top = int.from_bytes(hashlib.sha256(peer.encode()).digest()[:2], "big")
    assert shard_of(peer, 0) == 0
    for bits in range(1, MAX_SHARD_BITS + 1):
        assert shard_of(peer, bits) == top >> (16 - bits)
        assert shard_of(peer, bits) >> 1 == shard_of(peer, bits - 1)  # a deeper shard splits the shallower one
    assert shard_key(SWARM, 0, 0) == peers_key(SWARM) == "shards/peers"
    assert shard_key(SWARM, 3, 5) == "shards/peers/3/5"
    assert len(shard_keys(SWARM, 4)) == 16
    with pytest.raises(ValueError):
        shard_key(SWARM, 2, 4)
    with pytest.raises(ValueError):
        shard_of(peer, MAX_SHARD_BITS + 1)
    # Fresh ids spread evenly: 4,096 ids over 16 shards, none far from 256.
    counts = [0] * 16
    for i in range(4096):
        counts[shard_of(f"12D3KooW{i:044d}", 4)] += 1
    assert max(counts) < 256 * 1.3 and min(counts) > 256 * 0.7


def _head(key: PolicyKey, bits: int) -> HeadRecord:
    return HeadRecord(swarm=SWARM, version=3, manifest_sha256="ab" * 32, manifest_size=100,
                      publisher="12D3KooWJ6B2dR1cj3sPNvLxGcUW4bXJmXhAEc3X8aMdkQx4yWqb", published_ms=1,
                      expires_ms=int(time.time() * 1000) + 30_000, public_key=key.public.text,
                      card_shard_bits=bits).signed(key)


def test_a_head_at_depth_zero_is_the_record_daemons_without_shards_sign_and_read() -> None:
    key = PolicyKey.generate()
    flat = _head(key, 0)
    wire = flat.model_dump(mode="json")
    assert "card_shard_bits" not in wire and "card_shard_bits" not in flat.model_dump_json()
    # the signed bytes are those of a head without the field (what an older daemon verifies)
    older = {k: v for k, v in wire.items() if k not in ("signature", "chunk_url", "maddrs")}
    from echo2swarm.wire.signing import canonical_bytes
    assert flat._payload() == canonical_bytes(older)
    assert parse_head(wire).signature_ok()
    deep = _head(key, 4)
    assert deep.model_dump(mode="json")["card_shard_bits"] == 4 and parse_head(deep.model_dump(mode="json")).signature_ok()
    tampered = dict(deep.model_dump(mode="json"), card_shard_bits=10)  # nobody but the learner sets the depth
    assert not parse_head(tampered).signature_ok()
    with pytest.raises(Exception):
        parse_head(dict(wire, card_shard_bits=MAX_SHARD_BITS + 1))


def _card_record(key: PeerKey, shard_key_text: str) -> DHTRecord:
    card = PeerCard(peer_id=key.peer_id, role="rollout", price=0.2, state="ready", software="0.1",
                    updated_ms=int(time.time() * 1000)).signed(key, SWARM, 30)
    return DHTRecord(key_id(shard_key_text), MSGPackSerializer.dumps(key.peer_id),
                     MSGPackSerializer.dumps(card.model_dump(mode="json")), time.time() + 30)


def test_a_shard_takes_only_the_cards_whose_ids_hash_into_it() -> None:
    validator = SwarmRecordValidator(SWARM)
    key = PeerKey.generate()
    for bits in (0, 1, 5, MAX_SHARD_BITS):
        mine = shard_of(key.peer_id, bits)
        assert validator.validate(_card_record(key, shard_key(SWARM, bits, mine)))
        if bits:
            assert not validator.validate(_card_record(key, shard_key(SWARM, bits, mine ^ 1)))
    assert validator.reasons["shard"] == 3
    # a key that is no shard of ours (depth past the bound) is not validated as one
    assert validator.kind(_card_record(key, f"{SWARM}/peers/11/0")) is None


def test_the_learner_deepens_at_once_and_shallows_only_after_a_sparse_spell() -> None:
    now = [0.0]
    depth = ShardDepth(hold_s=30.0, clock=lambda: now[0])
    depth.observe([(0, CARDS_PER_SHARD)])
    assert depth.wanted(10) == 0
    depth.observe([(0, 1000)])
    assert depth.wanted(10) == 3 and depth.wanted(2) == 2 and depth.wanted(0) == 0
    assert depth.set(3) and depth.depths() == [3, 0]  # cards still at depth 0 are read and written for a TTL
    now[0] = 31.0
    assert depth.depths() == [3]
    depth.observe([(3, 100)] * 8)  # 800 cards: a quarter of the shards' 1,024 or more, not sparse
    assert depth.wanted(10) == 3
    depth.observe([(3, 20)] * 8)  # 160 cards: sparse from now on
    now[0] = 60.0
    depth.observe([(3, 20)] * 8)
    assert depth.wanted(10) == 3  # a sparse spell shorter than 2 TTLs changes nothing
    depth.observe([(3, 100)] * 8)  # and one full read ends the spell
    now[0] = 100.0
    depth.observe([(3, 20)] * 8)
    now[0] = 159.0
    depth.observe([(3, 20)] * 8)
    assert depth.wanted(10) == 3
    now[0] = 161.0
    assert depth.wanted(10) == 2  # one level at a time
    assert depth.wanted(1) == 1  # an operator's bound below the depth wins at once
    assert ShardDepth(30.0).wanted(10) == 0


def test_the_learner_does_not_go_back_to_a_depth_it_found_flooded() -> None:
    """A flood left in the one shard of depth 0 is met again at depth 0: after it moved the honest cards
    deeper, the learner must not flap back (seen in the card flood test before this rule)."""
    now = [0.0]
    depth = ShardDepth(hold_s=4.0, clock=lambda: now[0])
    depth.observe([(0, 450)])  # the flood's cards, at depth 0
    assert depth.wanted(10) == 2 and depth.set(2)
    now[0] = 10.0
    depth.observe([(2, 1)] * 4)  # honest cards alone at depth 2: sparse
    now[0] = 20.0
    assert depth.wanted(10) == 1 and depth.set(1)  # depth 1 was never seen full: one level up
    for t in range(30, 3600, 10):  # sparse at depth 1 for an hour, the flood still at depth 0
        now[0] = float(t)
        depth.observe([(1, 1)] * 2)
        assert depth.wanted(10) == 1
    now[0] = 3620.0
    depth.observe([(1, 1)] * 2)
    assert depth.wanted(10) == 0  # an hour on: every record of the flood has expired


class _ShardNode:
    """A DHT that answers each shard key with the cards whose ids fall in it (as real nodes store them)."""

    def __init__(self, cards: dict[str, dict[str, tuple[dict, float]]]):
        self.cards = cards
        self.asked: list[str] = []

    async def get_many(self, keys: list[str], sufficient_expiration_time: float | None = None) -> dict:
        self.asked += keys
        out = {}
        for key in keys:
            entries = self.cards.get(key)
            out[key] = None if entries is None else SimpleNamespace(
                value={k: SimpleNamespace(value=v, expiration_time=e) for k, (v, e) in entries.items()})
        return out


def _swarm_of(n: int, bits: int) -> tuple[dict[str, dict[str, tuple[dict, float]]], list[str]]:
    shards: dict[str, dict[str, tuple[dict, float]]] = {}
    ids = []
    for _ in range(n):
        key = PeerKey.generate()
        card = PeerCard(peer_id=key.peer_id, role="rollout", price=0.2, state="ready", software="0.1",
                        updated_ms=int(time.time() * 1000)).signed(key, SWARM, 60)
        shards.setdefault(shard_key(SWARM, bits, shard_of(key.peer_id, bits)), {})[key.peer_id] = (
            card.model_dump(mode="json"), card.expires_ms / 1000)
        ids.append(key.peer_id)
    return shards, ids


class _P2P:
    def __init__(self) -> None:
        self.peer_id = SimpleNamespace(to_base58=lambda: self.id)
        self.id = PeerKey.generate().peer_id


def _sharded(n: int, bits: int) -> tuple[Overlay, _ShardNode, dict[str, dict[str, tuple[dict, float]]], list[str]]:
    """An overlay over `n` cards at depth `bits`, past the hold (that depth alone), max_cards 64."""
    shards, ids = _swarm_of(n, bits)
    node = _ShardNode(shards)
    config = OverlayConfig(swarm=SWARM, new_swarm=True, max_cards=64)
    overlay = Overlay(config, _P2P(), node, SwarmRecordValidator(SWARM), PeerKey.generate())  # type: ignore[arg-type]
    overlay.set_card_shards(bits)
    overlay.cards.depth._until = float("-inf")
    return overlay, node, shards, ids


def test_whole_sampled_and_paged_reads() -> None:
    overlay, node, shards, ids = _sharded(300, 5)

    cards, bad = asyncio.run(overlay.get_cards())
    assert {c.peer_id for c in cards} == set(ids) and bad == 0  # every card: none left out (≤ 64 a shard)
    assert len(node.asked) == 32 and overlay.cards.depth.count == 300

    node.asked.clear()
    sample, _ = asyncio.run(overlay.get_cards(whole=False))
    own = shard_key(SWARM, 5, shard_of(overlay.peer_id, 5))
    assert len(node.asked) == 2 and node.asked[0] == own
    assert {c.peer_id for c in sample} == {p for k in node.asked for p in shards.get(k, {})}
    node.asked.clear()
    asyncio.run(overlay.get_cards(whole=False))
    assert node.asked[0] == own and len(node.asked) == 2  # the other shard goes round

    assert overlay.cards.pages() == 2
    node.asked.clear()
    first, _ = asyncio.run(overlay.get_card_page(0))
    second, _ = asyncio.run(overlay.get_card_page(1))
    assert node.asked == shard_keys(SWARM, 5)[:PAGE_SHARDS] + shard_keys(SWARM, 5)[PAGE_SHARDS:]
    assert {c.peer_id for c in first} | {c.peer_id for c in second} == set(ids)
    assert not {c.peer_id for c in first} & {c.peer_id for c in second}


def test_a_sample_reads_by_their_own_keys_only_the_peers_asked_for_and_seen_working() -> None:
    overlay, node, _, ids = _sharded(200, 4)
    sampled = {shard_of(overlay.peer_id, 4), 0, 1}  # its own shard, and the first in turn (0, or 1 when 0 is its own)
    outside = [p for p in ids if shard_of(p, 4) not in sampled]
    publisher, worker, asker = outside[:3]
    overlay.saw_work(worker, "served")
    overlay.work.saw(asker, "asked")
    asyncio.run(overlay.get_cards(prefer=[publisher], whole=False))
    own_keys = [k for k in node.asked if "/card/" in k]
    assert {k.rsplit("/", 1)[1] for k in own_keys} == {publisher, worker}  # never the asker
    node.asked.clear()
    asyncio.run(overlay.get_cards(prefer=[publisher]))  # a whole read names the asker too
    assert not [k for k in node.asked if "/card/" in k]  # ... and found every one of them in the shards


def test_a_read_the_dht_did_not_answer_in_time_is_no_count_of_the_cards() -> None:
    """A DHT outage makes a whole read find nothing: counted as an empty swarm, it would make the learner
    shallow its shards, then deepen them again when the DHT answers."""
    overlay, node, _, _ = _sharded(300, 5)
    asyncio.run(overlay.get_cards())
    assert overlay.cards.depth.count == 300

    async def stuck(keys: list[str], sufficient_expiration_time: float | None = None) -> dict:
        await asyncio.sleep(3600)  # the outage itself: a DHT that never answers (the read gives up)
        return {}

    node.get_many = stuck  # type: ignore[method-assign]
    overlay.config = overlay.cards.config = overlay.config.model_copy(update={"dht_timeout_s": 0.01})
    cards, _ = asyncio.run(overlay.get_cards())
    assert overlay.cards.reads["timed_out"] > 0
    assert overlay.cards.depth.count == 300  # the last count the DHT answered


def test_the_learners_other_readers_share_a_fresh_whole_read() -> None:
    overlay, node, _, ids = _sharded(100, 3)
    first, _ = asyncio.run(overlay.get_cards())
    asked = len(node.asked)
    again, _ = asyncio.run(overlay.get_cards(max_age_s=60.0))  # a re-plan right after the tracker's read
    assert len(node.asked) == asked and {c.peer_id for c in again} == {c.peer_id for c in first}
    asyncio.run(overlay.get_cards(prefer=[ids[0]], max_age_s=60.0))  # another kind of read: read anew
    assert len(node.asked) > asked
    asked = len(node.asked)
    asyncio.run(overlay.get_cards(max_age_s=0.0))
    assert len(node.asked) == asked + 8
