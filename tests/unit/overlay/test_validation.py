"""Store-time validation of the swarm's DHT records (echo2swarm/overlay/validation.py)."""

from __future__ import annotations

import logging
import time

import pytest
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.validation import DHTRecord
from hivemind.utils.serializer import MSGPackSerializer

from echo2swarm.overlay.dht_keys import head_key, peers_key
from echo2swarm.wire.records import MAX_RECORD_BYTES
from echo2swarm.overlay.validation import SwarmRecordValidator, key_id
from echo2swarm.wire.peer_keys import PeerKey
from echo2swarm.wire.records import HeadRecord, PeerCard
from echo2swarm.wire.signing import PolicyKey

SWARM = "demo"
PEER_KEY = PeerKey.generate()
PEER_ID = PEER_KEY.peer_id
OTHER_PEER_ID = PeerKey.generate().peer_id
EXPIRES = time.time() + 60  # records must expire within MAX_RECORD_TTL_S

dumps = MSGPackSerializer.dumps


@pytest.fixture(scope="module")
def key() -> PolicyKey:
    return PolicyKey.generate()


@pytest.fixture
def validator() -> SwarmRecordValidator:
    return SwarmRecordValidator(SWARM)


def signed_card(key: PeerKey = PEER_KEY, swarm: str = SWARM, ttl_s: float = 120.0, **fields: object) -> PeerCard:
    values: dict[str, object] = {
        "peer_id": key.peer_id, "role": "rollout", "price": 0.3, "version": 2, "state": "ready",
        "software": "echo2swarm 0.1", "maddrs": [f"/ip4/127.0.0.1/tcp/4001/p2p/{key.peer_id}"],
        "chunk_url": "http://127.0.0.1:8080", "updated_ms": int(time.time() * 1000),
    }
    values.update(fields)
    return PeerCard(**values).signed(key, swarm, ttl_s)  # type: ignore[arg-type]


def card(**changes: object) -> dict[str, object]:
    """A card signed by PEER_KEY, then changed (a change to a signed field breaks the signature)."""
    value = signed_card().model_dump(mode="json")
    value.update(changes)
    return value


def head(key: PolicyKey, swarm: str = SWARM, version: int = 3) -> HeadRecord:
    return HeadRecord(
        swarm=swarm, version=version, manifest_sha256="ab" * 32, manifest_size=1234,
        publisher=PEER_ID, published_ms=1_700_000_000_000, expires_ms=int(EXPIRES * 1000), public_key=key.public.text,
    ).signed(key)


def peers_record(value: object, subkey: object = PEER_ID) -> DHTRecord:
    return DHTRecord(key_id(peers_key(SWARM)), dumps(subkey), dumps(value), EXPIRES)


def head_record(value: object, subkey: object) -> DHTRecord:
    return DHTRecord(key_id(head_key(SWARM)), dumps(subkey), dumps(value), EXPIRES)


def assert_refused(
    validator: SwarmRecordValidator, record: DHTRecord, caplog: pytest.LogCaptureFixture | None = None, why: str = ""
) -> None:
    before = validator.refused
    if caplog is not None:
        caplog.clear()
        caplog.set_level(logging.INFO, logger="echo2swarm.overlay.validation")
    assert validator.validate(record) is False
    assert validator.refused == before + 1
    if caplog is not None:
        assert why in caplog.text  # refused for the reason the test is about, not an incidental one


def assert_accepted(validator: SwarmRecordValidator, record: DHTRecord) -> None:
    before = validator.refused
    assert validator.validate(record) is True
    assert validator.refused == before


def test_key_ids_are_hivemind_key_hashes() -> None:
    assert key_id(peers_key(SWARM)) != key_id(head_key(SWARM))
    assert key_id(peers_key(SWARM)) == key_id("demo/peers")
    assert len(key_id(peers_key(SWARM))) == 20


def test_good_card_under_its_own_peer_id(validator: SwarmRecordValidator) -> None:
    assert_accepted(validator, peers_record(card()))
    quiet = signed_card(version=None, chunk_url=None, state="starting", price=0).model_dump(mode="json")
    assert_accepted(validator, peers_record(quiet))


def test_good_signed_head_under_its_public_key(validator: SwarmRecordValidator, key: PolicyKey) -> None:
    h = head(key)
    assert_accepted(validator, head_record(h.model_dump(mode="json"), key.public.text))


def test_undecodable_value_bytes(validator: SwarmRecordValidator, caplog: pytest.LogCaptureFixture) -> None:
    record = DHTRecord(key_id(peers_key(SWARM)), dumps(PEER_ID), b"\xc1\xff\x00", EXPIRES)
    assert_refused(validator, record, caplog, "undecodable")
    assert_refused(validator, DHTRecord(key_id(head_key(SWARM)), dumps("x"), b"\xc1", EXPIRES), caplog, "undecodable")


def test_undecodable_subkey_bytes(validator: SwarmRecordValidator) -> None:
    assert_refused(validator, DHTRecord(key_id(peers_key(SWARM)), b"\xc1", dumps(card()), EXPIRES))


def test_card_under_another_peers_subkey(validator: SwarmRecordValidator, caplog: pytest.LogCaptureFixture) -> None:
    assert_refused(validator, peers_record(card(), subkey=OTHER_PEER_ID), caplog, "stored under subkey")


@pytest.mark.parametrize(
    "changes",
    [{"price": -1.0}, {"price": float("nan")}, {"role": "miner"}, {"state": "dead"}, {"peer_id": "0OIl"},
     {"chunk_url": "ftp://x"}, {"extra": 1}, {"maddrs": ["/ip4/1.2.3.4/tcp/1"] * 9}],
)
def test_bad_card_is_refused(
    validator: SwarmRecordValidator, changes: dict[str, object], caplog: pytest.LogCaptureFixture
) -> None:
    record = peers_record(card(**changes), subkey=changes.get("peer_id", PEER_ID))
    assert_refused(validator, record, caplog, "peer card does not match the schema")


def test_card_that_is_not_a_mapping(validator: SwarmRecordValidator) -> None:
    assert_refused(validator, peers_record([1, 2, 3]))
    assert_refused(validator, peers_record("card"))


def test_head_under_another_signers_subkey(
    validator: SwarmRecordValidator, key: PolicyKey, caplog: pytest.LogCaptureFixture
) -> None:
    other = PolicyKey.generate()
    record = head_record(head(key).model_dump(mode="json"), other.public.text)
    assert_refused(validator, record, caplog, "another signer's subkey")


def test_head_with_a_bad_signature(validator: SwarmRecordValidator, key: PolicyKey, caplog: pytest.LogCaptureFixture) -> None:
    tampered = head(key).model_copy(update={"version": 99})
    assert_refused(validator, head_record(tampered.model_dump(mode="json"), key.public.text), caplog, "bad signature")
    unsigned = head(key).model_copy(update={"signature": ""})
    assert_refused(validator, head_record(unsigned.model_dump(mode="json"), key.public.text), caplog, "bad signature")


def test_head_for_another_swarm(validator: SwarmRecordValidator, key: PolicyKey, caplog: pytest.LogCaptureFixture) -> None:
    record = head_record(head(key, swarm="other").model_dump(mode="json"), key.public.text)
    assert_refused(validator, record, caplog, "head for swarm 'other'")


def test_malformed_head(validator: SwarmRecordValidator, key: PolicyKey) -> None:
    assert_refused(validator, head_record({"swarm": SWARM}, key.public.text))
    assert_refused(validator, head_record(None, key.public.text))


def test_oversized_value_under_our_key(validator: SwarmRecordValidator, caplog: pytest.LogCaptureFixture) -> None:
    big = card(software="x" * 20)
    big["padding"] = "x" * (MAX_RECORD_BYTES + 1)
    assert_refused(validator, peers_record(big), caplog, "exceeds")


def test_oversized_value_under_an_unknown_key(validator: SwarmRecordValidator) -> None:
    record = DHTRecord(key_id("someone-else/stuff"), DHTProtocol.IS_REGULAR_VALUE, b"x" * (MAX_RECORD_BYTES + 1), EXPIRES)
    assert_refused(validator, record)


def test_value_of_exactly_the_limit_under_an_unknown_key(validator: SwarmRecordValidator) -> None:
    record = DHTRecord(key_id("someone-else/stuff"), dumps("sub"), b"x" * MAX_RECORD_BYTES, EXPIRES)
    assert_accepted(validator, record)


@pytest.mark.parametrize("subkey", [b"", DHTProtocol.IS_REGULAR_VALUE, dumps(123)])
def test_record_under_our_key_without_a_string_subkey(
    validator: SwarmRecordValidator, subkey: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    record = DHTRecord(key_id(peers_key(SWARM)), subkey, dumps(card()), EXPIRES)
    assert_refused(validator, record, caplog, "without a string subkey")


def test_small_dictionary_entry_under_an_unrelated_key_is_accepted(validator: SwarmRecordValidator) -> None:
    assert_accepted(validator, DHTRecord(key_id("other/key"), dumps("sub"), b"\xc1 not even msgpack", EXPIRES))


def test_plain_values_are_refused_under_every_key(validator: SwarmRecordValidator) -> None:
    # A plain value would replace a per-peer card or roster dictionary that expires sooner, and the
    # validator cannot tell those keys from any other by their hash alone.
    for key in ("other/key", "demo/card/12D3KooWAnyPeerWhateverItIs1234567890abcdefghij"):
        assert not validator.validate(DHTRecord(key_id(key), DHTProtocol.IS_REGULAR_VALUE, dumps({"a": 1}), EXPIRES))


def test_other_swarms_keys_are_not_ours(key: PolicyKey) -> None:
    # A validator only enforces its own swarm's schema; another swarm's records pass the size check.
    validator = SwarmRecordValidator("other")
    assert_accepted(validator, peers_record(card(price=-1.0)))


def test_refused_counts_every_refusal(validator: SwarmRecordValidator, key: PolicyKey) -> None:
    bad = [
        peers_record(card(), subkey=OTHER_PEER_ID),
        peers_record(card(price=-1.0)),
        head_record(head(key, swarm="other").model_dump(mode="json"), key.public.text),
    ]
    for record in bad:
        validator.validate(record)
    validator.validate(peers_record(card()))
    assert validator.refused == 3


def test_validator_protocol_properties(validator: SwarmRecordValidator) -> None:
    assert validator.priority == 10
    assert validator.merge_with(SwarmRecordValidator(SWARM)) is False


def test_far_future_expiration_is_refused(validator: SwarmRecordValidator) -> None:
    record = DHTRecord(key_id(peers_key(SWARM)), dumps(PEER_ID), dumps(card()), time.time() + 10 * 3600)
    assert validator.validate(record) is False


def test_head_kept_past_its_signed_expiry_is_refused(validator: SwarmRecordValidator, key: PolicyKey) -> None:
    h = head(key)
    replay = DHTRecord(key_id(head_key(SWARM)), dumps(h.public_key), dumps(h.model_dump(mode="json")), EXPIRES + 600)
    assert validator.validate(replay) is False
    fresh = DHTRecord(key_id(head_key(SWARM)), dumps(h.public_key), dumps(h.model_dump(mode="json")), EXPIRES)
    assert validator.validate(fresh) is True


def test_cards_and_rosters_under_their_own_peer_keys_are_checked_like_shared_cards(validator: SwarmRecordValidator) -> None:
    from echo2swarm.overlay.dht_keys import card_key, roster_key
    from echo2swarm.wire.peer_keys import PeerKey
    from echo2swarm.wire.records import RosterRecord

    owner, other = PeerKey.generate(), PeerKey.generate()
    expires = time.time() + 30  # within the cards' signed 30 s
    mine = PeerCard(peer_id=owner.peer_id, role="rollout", price=0.1, state="ready", software="0.1",
                    updated_ms=int(time.time() * 1000)).signed(owner, SWARM, 30).model_dump(mode="json")
    at = DHTRecord(key_id(card_key(SWARM, owner.peer_id)), dumps(owner.peer_id), dumps(mine), expires)
    assert validator.kind(at) == "card"
    assert_accepted(validator, at)
    # Another peer's (valid) card under this peer's key and subkey: refused, as under the shared key.
    theirs = dict(mine, peer_id=other.peer_id)
    assert not validator.validate(DHTRecord(at.key, at.subkey, dumps(theirs), expires))
    unsigned = dict(mine, price=0.0)
    assert not validator.validate(DHTRecord(at.key, at.subkey, dumps(unsigned), expires))
    # Junk under another subkey of the same key is not ours to judge (only size-checked): readers skip it.
    assert validator.kind(DHTRecord(at.key, dumps("junk"), b"x", expires)) is None
    roster = RosterRecord(peer_id=owner.peer_id, updated_ms=int(time.time() * 1000)).signed(owner, SWARM, 30)
    at_roster = DHTRecord(key_id(roster_key(SWARM, owner.peer_id)), dumps(owner.peer_id),
                          dumps(roster.model_dump(mode="json")), expires)
    assert validator.kind(at_roster) == "roster"
    assert_accepted(validator, at_roster)
    assert not validator.validate(DHTRecord(at_roster.key, at_roster.subkey, dumps(mine), expires))
