"""Owner-signed peer cards at the DHT validator, and the bounded card reads of Overlay.get_cards."""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace

import pytest
from hivemind.dht.validation import DHTRecord
from hivemind.utils.serializer import MSGPackSerializer

from echo2swarm.config.models import OverlayConfig
from echo2swarm.overlay.dht_keys import card_key, peers_key, roster_key
from echo2swarm.overlay.node import Overlay
from echo2swarm.overlay.validation import SwarmRecordValidator, key_id
from echo2swarm.wire.peer_keys import PeerKey
from echo2swarm.wire.records import MAX_CARD_BYTES, PeerCard, RosterEntry, RosterRecord
from echo2swarm.wire.signing import DOMAIN_CARD

SWARM = "demo"
dumps = MSGPackSerializer.dumps


def card(key: PeerKey, **fields: object) -> PeerCard:
    values: dict[str, object] = {
        "peer_id": key.peer_id, "role": "rollout", "price": 0.3, "state": "ready", "software": "0.1",
        "chunk_url": "http://127.0.0.1:8080", "updated_ms": int(time.time() * 1000),
    }
    values.update(fields)
    return PeerCard(**values)  # type: ignore[arg-type]


def record(value: object, subkey: str, expiration: float | None = None) -> DHTRecord:
    return DHTRecord(key_id(peers_key(SWARM)), dumps(subkey), dumps(value), expiration or time.time() + 30)


def refused(validator: SwarmRecordValidator, rec: DHTRecord, caplog: pytest.LogCaptureFixture, why: str) -> None:
    before = validator.refused
    caplog.clear()
    caplog.set_level(logging.INFO, logger="echo2swarm.overlay.validation")
    assert validator.validate(rec) is False
    assert validator.refused == before + 1
    assert why in caplog.text


@pytest.fixture
def validator() -> SwarmRecordValidator:
    return SwarmRecordValidator(SWARM)


def test_owner_signed_card_is_accepted(validator: SwarmRecordValidator) -> None:
    key = PeerKey.generate()
    assert validator.validate(record(card(key).signed(key, SWARM, 30).model_dump(mode="json"), key.peer_id))
    assert validator.refused == 0


def test_card_forged_under_another_peers_id(validator: SwarmRecordValidator, caplog: pytest.LogCaptureFixture) -> None:
    learner, attacker = PeerKey.generate(), PeerKey.generate()
    forged = card(learner, role="learner", chunk_url="http://127.0.0.1:9")
    forged = forged.model_copy(update={
        "expires_ms": forged.updated_ms + 30_000,
        "signature": attacker.sign(DOMAIN_CARD, forged.model_copy(update={"expires_ms": forged.updated_ms + 30_000})
                                   .signing_payload(SWARM)).hex(),
    })
    refused(validator, record(forged.model_dump(mode="json"), learner.peer_id), caplog, "bad signature")
    # Its own, validly signed card does not help it either when stored under the learner's id.
    own = card(attacker).signed(attacker, SWARM, 30).model_dump(mode="json")
    refused(validator, record(own, learner.peer_id), caplog, "stored under subkey")


def test_stopping_card_forged_from_an_honest_card(validator: SwarmRecordValidator, caplog: pytest.LogCaptureFixture) -> None:
    honest = PeerKey.generate()
    value = card(honest).signed(honest, SWARM, 30).model_dump(mode="json")
    assert validator.validate(record(value, honest.peer_id))
    refused(validator, record(dict(value, state="stopping"), honest.peer_id), caplog, "bad signature")


@pytest.mark.parametrize("field, value", [("price", 0.0), ("rollouts_per_s", 1e7), ("chunk_url", "http://127.0.0.1:9"),
                                          ("maddrs", ["/ip4/6.6.6.6/tcp/1"]), ("role", "learner")])
def test_tampered_field(validator: SwarmRecordValidator, caplog: pytest.LogCaptureFixture, field: str, value: object) -> None:
    key = PeerKey.generate()
    signed = card(key, rollouts_per_s=3.0).signed(key, SWARM, 30).model_dump(mode="json")
    refused(validator, record(dict(signed, **{field: value}), key.peer_id), caplog, "bad signature")


def test_bad_and_missing_signatures(validator: SwarmRecordValidator, caplog: pytest.LogCaptureFixture) -> None:
    key = PeerKey.generate()
    signed = card(key).signed(key, SWARM, 30).model_dump(mode="json")
    refused(validator, record(dict(signed, signature="00" * 64), key.peer_id), caplog, "bad signature")
    refused(validator, record(dict(signed, signature="ab"), key.peer_id), caplog, "bad signature")
    refused(validator, record(dict(signed, signature="abc"), key.peer_id), caplog, "schema")  # odd hex length
    refused(validator, record(dict(signed, public_key="0812"), key.peer_id), caplog, "no usable key")
    refused(validator, record(dict(signed, signature=""), key.peer_id), caplog, "not signed")
    unsigned = {k: v for k, v in signed.items() if k not in ("signature", "expires_ms")}
    refused(validator, record(unsigned, key.peer_id), caplog, "not signed")
    assert validator.reasons["bad_signature"] == 2 and validator.reasons["unsigned"] == 2
    assert validator.reasons["bad_key"] == 1


def test_cheap_fake_card_without_signature(validator: SwarmRecordValidator, caplog: pytest.LogCaptureFixture) -> None:
    """The flood's opening move: price 0, huge µ, under a fresh key, not signed."""
    key = PeerKey.generate()
    fake = card(key, price=0.0, rollouts_per_s=1e7).model_dump(mode="json")
    refused(validator, record(fake, key.peer_id), caplog, "not signed")


def test_far_future_or_past_updated_ms(validator: SwarmRecordValidator, caplog: pytest.LogCaptureFixture) -> None:
    key = PeerKey.generate()
    future = card(key, updated_ms=int((time.time() + 86400) * 1000)).signed(key, SWARM, 30)
    refused(validator, record(future.model_dump(mode="json"), key.peer_id), caplog, "ahead")
    past = card(key, updated_ms=int((time.time() - 2 * 3600) * 1000)).signed(key, SWARM, 3600)
    refused(validator, record(past.model_dump(mode="json"), key.peer_id), caplog, "expired")


def test_replay_with_a_later_dht_expiry(validator: SwarmRecordValidator, caplog: pytest.LogCaptureFixture) -> None:
    key = PeerKey.generate()
    signed = card(key).signed(key, SWARM, 30)
    value = signed.model_dump(mode="json")
    assert validator.validate(record(value, key.peer_id, signed.expires_ms / 1000))
    refused(validator, record(value, key.peer_id, signed.expires_ms / 1000 + 900), caplog, "past its signed expiry")


def test_card_signed_for_another_swarm(validator: SwarmRecordValidator, caplog: pytest.LogCaptureFixture) -> None:
    key = PeerKey.generate()
    refused(validator, record(card(key).signed(key, "other", 30).model_dump(mode="json"), key.peer_id), caplog,
            "bad signature")


def test_oversized_card(validator: SwarmRecordValidator, caplog: pytest.LogCaptureFixture) -> None:
    key = PeerKey.generate()
    value = dict(card(key).signed(key, SWARM, 30).model_dump(mode="json"), padding="x" * MAX_CARD_BYTES)
    refused(validator, record(value, key.peer_id), caplog, "exceeds")


def test_verdicts_are_cached_but_every_refusal_counts(validator: SwarmRecordValidator) -> None:
    key = PeerKey.generate()
    value = dict(card(key).signed(key, SWARM, 30).model_dump(mode="json"), price=0.0)
    for _ in range(3):
        assert validator.validate(record(value, key.peer_id)) is False
    assert validator.refused == 3 and len(validator._cards) == 1


# -- bounded reads -----------------------------------------------------------------------------
class _FakeNode:
    """What the DHT returns per key: `entries` under the shared peers key, `keys` under any other."""

    def __init__(self, entries: dict[str, tuple[dict, float]], keys: dict[str, dict[str, tuple[dict, float]]] | None = None):
        self.entries = entries
        self.keys = keys or {}
        self.asked: list[str] = []

    async def get_many(self, keys: list[str], sufficient_expiration_time: float | None = None) -> dict:
        self.asked += keys
        out = {}
        for key in keys:
            entries = self.entries if key == peers_key(SWARM) else self.keys.get(key)
            items = None if entries is None else {k: SimpleNamespace(value=v, expiration_time=e) for k, (v, e) in entries.items()}
            out[key] = None if items is None else SimpleNamespace(value=items)
        return out


class _FakeP2P:
    peer_id = SimpleNamespace(to_base58=lambda: PeerKey.generate().peer_id)


def _overlay(entries: dict[str, tuple[dict, float]], max_cards: int) -> Overlay:
    config = OverlayConfig(swarm=SWARM, new_swarm=True, max_cards=max_cards)
    return Overlay(config, _FakeP2P(), _FakeNode(entries), SwarmRecordValidator(SWARM), PeerKey.generate())  # type: ignore[arg-type]


def _signed(key: PeerKey, age_s: float = 0.0, **fields: object) -> tuple[dict, float]:
    c = card(key, updated_ms=int((time.time() - age_s) * 1000), **fields).signed(key, SWARM, 60)
    return c.model_dump(mode="json"), c.expires_ms / 1000


def test_get_cards_is_bounded_and_keeps_preferred_worked_and_newest_peers() -> None:
    honest = [PeerKey.generate() for _ in range(3)]
    entries = {k.peer_id: _signed(k, age_s=1.0) for k in honest}
    flood = [PeerKey.generate() for _ in range(60)]
    entries.update({k.peer_id: _signed(k, age_s=5.0) for k in flood})
    worker, learner = PeerKey.generate(), PeerKey.generate()
    entries[worker.peer_id] = _signed(worker, age_s=50.0)
    entries[learner.peer_id] = _signed(learner, age_s=50.0, role="learner")
    entries["garbage"] = ({"peer_id": "nope"}, time.time() + 30)
    overlay = _overlay(entries, max_cards=8)
    overlay.saw_work(worker.peer_id, "delivered")
    cards, bad = asyncio.run(overlay.get_cards(prefer=[learner.peer_id]))
    ids = {c.peer_id for c in cards}
    assert len(cards) == 8
    assert {worker.peer_id, learner.peer_id} | {k.peer_id for k in honest} <= ids
    assert overlay.cards_dropped == len(entries) - 8 - bad


def test_get_cards_keeps_incumbents_over_newer_newcomers() -> None:
    first = [PeerKey.generate() for _ in range(4)]
    entries = {k.peer_id: _signed(k, age_s=20.0) for k in first}
    overlay = _overlay(entries, max_cards=8)
    assert len(asyncio.run(overlay.get_cards())[0]) == 4
    entries.update({k.peer_id: _signed(k) for k in (PeerKey.generate() for _ in range(30))})
    ids = {c.peer_id for c in asyncio.run(overlay.get_cards())[0]}
    assert {k.peer_id for k in first} <= ids


def test_get_cards_refuses_what_the_validator_would() -> None:
    good, bad = PeerKey.generate(), PeerKey.generate()
    value, expiry = _signed(bad)
    entries = {good.peer_id: _signed(good), bad.peer_id: (dict(value, price=0.0), expiry)}
    cards, refused_count = asyncio.run(_overlay(entries, max_cards=8).get_cards())
    assert [c.peer_id for c in cards] == [good.peer_id] and refused_count == 1


# -- reads that name peers: own keys and rosters (overlay/cards.py) --------------------------------
def _own(key: PeerKey, **fields: object) -> dict[str, dict[str, tuple[dict, float]]]:
    """What the DHT holds under `key`'s own card key."""
    return {card_key(SWARM, key.peer_id): {key.peer_id: _signed(key, **fields)}}


def _roster_of(signer: PeerKey, peers: list[PeerKey]) -> dict[str, dict[str, tuple[dict, float]]]:
    entries = [RosterEntry(peer_id=k.peer_id, work=["delivered"], seen_ms=int(time.time() * 1000)) for k in peers]
    roster = RosterRecord(peer_id=signer.peer_id, peers=entries, updated_ms=int(time.time() * 1000)).signed(signer, SWARM, 60)
    return {roster_key(SWARM, signer.peer_id): {signer.peer_id: (roster.model_dump(mode="json"), roster.expires_ms / 1000)}}


def _flooded(n: int) -> dict[str, tuple[dict, float]]:
    return {k.peer_id: _signed(k) for k in (PeerKey.generate() for _ in range(n))}  # newest of all


def test_a_flood_under_the_shared_key_hides_no_peer_a_reader_has_reason_to_trust() -> None:
    learner, delivering, on_roster, asker = (PeerKey.generate() for _ in range(4))
    keys = {**_own(learner, role="learner"), **_own(delivering), **_own(on_roster), **_own(asker),
            **_roster_of(learner, [on_roster])}
    config = OverlayConfig(swarm=SWARM, new_swarm=True, max_cards=8)
    node = _FakeNode(_flooded(40), keys)  # none of them in the shared key (the reply carried only the flood)
    overlay = Overlay(config, _FakeP2P(), node, SwarmRecordValidator(SWARM), PeerKey.generate())  # type: ignore[arg-type]
    overlay.saw_work(delivering.peer_id, "delivered")
    overlay.work.saw(asker.peer_id, "asked")
    cards, bad = asyncio.run(overlay.get_cards(prefer=[learner.peer_id]))
    order = [learner, delivering, on_roster, asker]
    assert [c.peer_id for c in cards[:4]] == [k.peer_id for k in order] and len(cards) == 8 and bad == 0
    assert overlay.cards.rosters[learner.peer_id].peers[0].peer_id == on_roster.peer_id
    # Only the preferred peers' rosters are read: a reader names no one on a stranger's say-so.
    assert roster_key(SWARM, delivering.peer_id) not in node.asked


def test_only_the_signers_roster_counts_and_junk_under_a_peers_own_key_is_ignored() -> None:
    learner, attacker, honest = PeerKey.generate(), PeerKey.generate(), PeerKey.generate()
    fakes = [PeerKey.generate() for _ in range(3)]
    theirs = _roster_of(attacker, fakes)[roster_key(SWARM, attacker.peer_id)][attacker.peer_id]
    keys = {**_own(learner, role="learner"), **_own(honest), **{k2: v for k in fakes for k2, v in _own(k).items()}}
    # Under the learner's roster key: the attacker's roster under its own subkey, and junk beside it.
    keys[roster_key(SWARM, learner.peer_id)] = {attacker.peer_id: theirs, "junk": ({"x": 1}, time.time() + 30)}
    keys[card_key(SWARM, honest.peer_id)]["junk"] = ({"peer_id": "nope"}, time.time() + 30)
    config = OverlayConfig(swarm=SWARM, new_swarm=True, max_cards=8)
    overlay = Overlay(config, _FakeP2P(), _FakeNode({}, keys), SwarmRecordValidator(SWARM), PeerKey.generate())  # type: ignore[arg-type]
    overlay.saw_work(honest.peer_id, "served")
    cards, bad = asyncio.run(overlay.get_cards(prefer=[learner.peer_id]))
    assert [c.peer_id for c in cards] == [learner.peer_id, honest.peer_id] and bad == 0
    assert overlay.cards.rosters == {}


def test_a_flooded_shared_key_is_read_once_per_ttl_and_named_cards_stay_fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    import echo2swarm.overlay.cards as cards_module

    now = [1000.0]
    monkeypatch.setattr(cards_module.time, "monotonic", lambda: now[0])
    worker = PeerKey.generate()
    config = OverlayConfig(swarm=SWARM, new_swarm=True, max_cards=8)
    node = _FakeNode(_flooded(20), _own(worker))
    overlay = Overlay(config, _FakeP2P(), node, SwarmRecordValidator(SWARM), PeerKey.generate())  # type: ignore[arg-type]
    overlay.saw_work(worker.peer_id, "delivered")

    def read() -> list[str]:
        node.asked.clear()
        return [c.peer_id for c in asyncio.run(overlay.get_cards())[0]]

    first = read()
    assert peers_key(SWARM) in node.asked and first[0] == worker.peer_id and len(first) == 8
    now[0] += config.record_ttl_s / 2
    assert read() == first and peers_key(SWARM) not in node.asked  # the kept cards, not another flooded reply
    assert card_key(SWARM, worker.peer_id) in node.asked  # named peers are read afresh by their own keys
    now[0] += config.record_ttl_s
    read()
    assert peers_key(SWARM) in node.asked
    # What the reads cost, counted (/v1/info stats.card_reads): three calls, the shared key read twice, and
    # the worker's card (not in the shared dictionary, only under its own key) by its own key at each call
    assert overlay.cards.reads == {"calls": 3, "shared": 2, "own_keys": 3}
    # An honest swarm's shared key (no more cards than a reader keeps) is read at every call.
    quiet = _overlay({k: v for k, v in list(_flooded(5).items())}, max_cards=8)
    for _ in range(2):
        quiet.node.asked.clear()  # type: ignore[attr-defined]
        asyncio.run(quiet.get_cards())
        assert quiet.node.asked == [peers_key(SWARM)]  # type: ignore[attr-defined]


def test_a_named_read_asks_only_the_named_peers_own_keys_and_keeps_only_their_cards() -> None:
    parent, grandparent, gone, stranger = (PeerKey.generate() for _ in range(4))
    keys = {**_own(parent), **_own(grandparent), **_own(stranger)}
    keys[card_key(SWARM, parent.peer_id)]["junk"] = ({"peer_id": "nope"}, time.time() + 30)  # beside its card
    keys[card_key(SWARM, grandparent.peer_id)] = {stranger.peer_id: keys[card_key(SWARM, stranger.peer_id)][stranger.peer_id]}
    node = _FakeNode(_flooded(40), keys)
    overlay = Overlay(OverlayConfig(swarm=SWARM, new_swarm=True, max_cards=8), _FakeP2P(), node,  # type: ignore[arg-type]
                      SwarmRecordValidator(SWARM), PeerKey.generate())
    cards, bad = asyncio.run(overlay.get_named_cards([parent.peer_id, grandparent.peer_id, gone.peer_id]))
    # The parent's card; not the stranger's card stored under the grandparent's key; nothing for a peer
    # with no card; and the shared dictionary of every card never read.
    assert [c.peer_id for c in cards] == [parent.peer_id] and bad == 0
    assert peers_key(SWARM) not in node.asked
    assert set(node.asked) == {card_key(SWARM, k.peer_id) for k in (parent, grandparent, gone)}
    assert overlay.cards.reads == {"named": 1, "own_keys": 3}
