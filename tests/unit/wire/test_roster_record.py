"""The learner's roster of peers seen working (wire/records.py RosterRecord): signed by its peer key,
bounded, expiring, and refused by every DHT node when forged, tampered, oversized or replayed."""

from __future__ import annotations

import time

import pytest
from hivemind.dht.validation import DHTRecord
from hivemind.utils.serializer import MSGPackSerializer

from echo2swarm.overlay.dht_keys import card_key, peers_key, roster_key
from echo2swarm.overlay.roster import signed_roster
from echo2swarm.overlay.validation import SwarmRecordValidator, key_id
from echo2swarm.wire.peer_keys import PeerKey
from echo2swarm.wire.records import (
    MAX_RECORD_BYTES,
    MAX_ROSTER_PEERS,
    RecordError,
    RosterEntry,
    RosterRecord,
    parse_roster,
)
from echo2swarm.wire.signing import DOMAIN_CARD

SWARM = "demo"
dumps = MSGPackSerializer.dumps


def entries(n: int, work: list[str] | None = None) -> list[RosterEntry]:
    now = int(time.time() * 1000)
    return [RosterEntry(peer_id=PeerKey.generate().peer_id, work=work or ["delivered"], seen_ms=now) for _ in range(n)]  # type: ignore[arg-type]


def roster(key: PeerKey, n: int = 3, ttl: float = 30.0) -> RosterRecord:
    return RosterRecord(peer_id=key.peer_id, peers=entries(n), updated_ms=int(time.time() * 1000)).signed(key, SWARM, ttl)


def record(value: dict, subkey: str, key: str | None = None, expiration: float | None = None) -> DHTRecord:
    return DHTRecord(key_id(key or roster_key(SWARM, subkey)), dumps(subkey), dumps(value), expiration or time.time() + 30)


def test_a_roster_signed_by_its_peer_verifies_for_its_swarm_only() -> None:
    key = PeerKey.generate()
    signed = roster(key)
    again = parse_roster(signed.model_dump(mode="json"))
    again.check_signature(SWARM)
    again.check_times()
    with pytest.raises(RecordError, match="bad signature"):
        again.check_signature("other-swarm")


def test_a_forged_or_tampered_roster_is_refused() -> None:
    learner, attacker = PeerKey.generate(), PeerKey.generate()
    honest = roster(learner)
    # The attacker's own signature over a roster that names the learner as its signer.
    forged = honest.model_copy(update={"signature": ""})
    forged = forged.model_copy(update={"signature": attacker.sign(forged.DOMAIN, forged.signing_payload(SWARM)).hex()})
    with pytest.raises(RecordError, match="bad signature"):
        forged.check_signature(SWARM)
    # The learner's signature, with one of the attacker's keys slipped in.
    tampered = honest.model_copy(update={"peers": [*honest.peers[:-1], *entries(1)]})
    with pytest.raises(RecordError, match="bad signature"):
        tampered.check_signature(SWARM)
    # A card's signature is never a roster's: the domains differ.
    crossed = honest.model_copy(update={"signature": learner.sign(DOMAIN_CARD, honest.model_copy(
        update={"signature": ""}).signing_payload(SWARM)).hex()})
    with pytest.raises(RecordError, match="bad signature"):
        crossed.check_signature(SWARM)
    with pytest.raises(RecordError, match="not signed"):
        honest.model_copy(update={"signature": ""}).check_signature(SWARM)


def test_every_node_refuses_forged_misfiled_and_replayed_rosters() -> None:
    validator = SwarmRecordValidator(SWARM)
    learner, attacker = PeerKey.generate(), PeerKey.generate()
    good = roster(learner)
    assert validator.validate(record(good.model_dump(mode="json"), learner.peer_id))
    # Under the learner's key by the attacker: signed by the wrong key, or filed under the wrong subkey.
    theirs = roster(attacker).model_dump(mode="json")
    assert not validator.validate(record(theirs, learner.peer_id, key=roster_key(SWARM, learner.peer_id)))
    assert not validator.validate(record(dict(theirs, peer_id=learner.peer_id), learner.peer_id))
    # Kept in the DHT past its signed end of life (a replay), or already expired.
    assert not validator.validate(record(good.model_dump(mode="json"), learner.peer_id, expiration=time.time() + 600))
    old = RosterRecord(peer_id=learner.peer_id, updated_ms=int((time.time() - 300) * 1000)).signed(learner, SWARM, 60)
    assert not validator.validate(record(old.model_dump(mode="json"), learner.peer_id, expiration=time.time() + 1))
    assert validator.reasons["replay"] == 1 and validator.reasons["expired"] == 1
    # A roster is no card: refused under the signer's card key and under the shared peers key.
    assert not validator.validate(record(good.model_dump(mode="json"), learner.peer_id, key=card_key(SWARM, learner.peer_id)))
    assert not validator.validate(record(good.model_dump(mode="json"), learner.peer_id, key=peers_key(SWARM)))


@pytest.mark.parametrize("change,why", [
    (lambda v: dict(v, peers=v["peers"] + v["peers"][:1]), "twice"),
    (lambda v: dict(v, peers=[dict(v["peers"][0], work=["delivered", "delivered"])]), "twice"),
    (lambda v: dict(v, peers=[dict(v["peers"][0], work=["asked"])]), "work"),
    (lambda v: dict(v, peers=[dict(v["peers"][0], work=[])]), "work"),
    (lambda v: dict(v, format="echo2swarm-roster/2"), "format"),
    (lambda v: dict(v, extra=1), "extra"),
])
def test_the_schema_bounds_a_roster(change, why: str) -> None:
    value = roster(PeerKey.generate()).model_dump(mode="json")
    with pytest.raises(RecordError, match="schema"):
        parse_roster(change(value))


def test_a_roster_holds_at_most_max_roster_peers_and_always_fits_a_record() -> None:
    key = PeerKey.generate()
    with pytest.raises(ValueError):
        RosterRecord(peer_id=key.peer_id, peers=entries(MAX_ROSTER_PEERS + 1), updated_ms=0)
    full = signed_roster(key, SWARM, entries(MAX_ROSTER_PEERS, ["delivered", "served"]), 30.0)
    assert len(full.peers) == MAX_ROSTER_PEERS
    assert len(dumps(full.model_dump(mode="json"))) <= MAX_RECORD_BYTES
    # Peer ids at the schema's longest would overflow a record: the writer drops its last entries to fit.
    now = int(time.time() * 1000)
    long_ids = [RosterEntry(peer_id="1" * 100 + PeerKey.generate().peer_id[:28], work=["delivered", "served"],
                            seen_ms=now) for _ in range(MAX_ROSTER_PEERS)]
    trimmed = signed_roster(key, SWARM, long_ids, 30.0)
    assert 0 < len(trimmed.peers) < MAX_ROSTER_PEERS
    assert len(dumps(trimmed.model_dump(mode="json"))) <= MAX_RECORD_BYTES
    trimmed.check_signature(SWARM)
