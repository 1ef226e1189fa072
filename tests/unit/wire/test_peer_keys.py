"""libp2p identity keys and owner-signed records (echo2swarm/wire/peer_keys.py, wire/records.py)."""

from __future__ import annotations

import math
import time

import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.utils.serializer import MSGPackSerializer

from echo2swarm.wire.peer_keys import (
    KEY_ED25519,
    PeerKey,
    PeerKeyError,
    PeerPublicKey,
    b58decode,
    b58encode,
    decode_key_proto,
    embedded_public_key,
    encode_key_proto,
)
from echo2swarm.wire.records import (
    MAX_BANS_ON_CARD,
    MAX_CARD_BYTES,
    MAX_RECORD_BYTES,
    Arrival,
    BanNote,
    HeadRecord,
    PeerCard,
    RecordError,
    parse_card,
    parse_head,
)
from echo2swarm.wire.signing import DOMAIN_CARD, DOMAIN_HEAD, PolicyKey, float_text

SWARM = "demo"


@pytest.fixture(scope="module")
def rsa_key() -> PeerKey:
    return PeerKey(rsa.generate_private_key(public_exponent=65537, key_size=2048))


def make_card(key: PeerKey, **fields: object) -> PeerCard:
    values: dict[str, object] = {
        "peer_id": key.peer_id, "role": "rollout", "price": 0.3, "state": "ready", "software": "0.1",
        "chunk_url": "http://127.0.0.1:8080", "rollouts_per_s": 12.5, "updated_ms": int(time.time() * 1000),
        "arrivals": [Arrival(version=3, seconds=1.25)],
    }
    values.update(fields)
    return PeerCard(**values)  # type: ignore[arg-type]


def test_base58_round_trip_keeps_leading_zeros() -> None:
    for data in (b"", b"\0", b"\0\0\x01\x02", bytes(range(40))):
        assert b58decode(b58encode(data)) == data
    assert b58encode(b"\0\0\x01") == "112"
    with pytest.raises(PeerKeyError):
        b58decode("0OIl")


def test_key_protobuf_round_trip() -> None:
    blob = encode_key_proto(KEY_ED25519, b"k" * 32)
    assert blob[:4] == b"\x08\x01\x12\x20"  # field 1 = 1 (Ed25519), field 2 = 32 bytes
    assert decode_key_proto(blob) == (KEY_ED25519, b"k" * 32)
    with pytest.raises(PeerKeyError):
        decode_key_proto(blob[:-1])
    with pytest.raises(PeerKeyError):
        decode_key_proto(b"\x08\x01")


def test_ed25519_peer_ids_embed_their_key() -> None:
    key = PeerKey.generate()
    assert key.peer_id.startswith("12D3KooW")  # what p2pd prints for Ed25519 identities
    assert key.public.embedded
    assert embedded_public_key(key.peer_id) == key.public.proto
    assert PeerKey.from_proto(key.to_proto()).peer_id == key.peer_id
    signature = key.sign(DOMAIN_CARD, b"payload")
    assert PeerPublicKey.for_peer(key.peer_id).verify(DOMAIN_CARD, b"payload", signature)
    assert not PeerPublicKey.for_peer(key.peer_id).verify(DOMAIN_HEAD, b"payload", signature)  # domain-separated
    assert not PeerPublicKey.for_peer(PeerKey.generate().peer_id).verify(DOMAIN_CARD, b"payload", signature)


def test_rsa_peer_ids_are_hashes_and_need_the_key(rsa_key: PeerKey) -> None:
    assert rsa_key.peer_id.startswith("Qm") and not rsa_key.public.embedded
    assert embedded_public_key(rsa_key.peer_id) is None
    with pytest.raises(PeerKeyError, match="must carry the public key"):
        PeerPublicKey.for_peer(rsa_key.peer_id)
    with pytest.raises(PeerKeyError, match="does not hash"):
        PeerPublicKey.for_peer(rsa_key.peer_id, PeerKey.generate().public.proto)
    public = PeerPublicKey.for_peer(rsa_key.peer_id, rsa_key.public.proto)
    assert public.verify(DOMAIN_CARD, b"m", rsa_key.sign(DOMAIN_CARD, b"m"))
    assert PeerKey.from_proto(rsa_key.to_proto()).peer_id == rsa_key.peer_id


def test_hivemind_rsa_identity_file_loads(tmp_path) -> None:
    from hivemind.p2p import P2P
    from hivemind.p2p.p2p_daemon_bindings.datastructures import PeerID

    path = tmp_path / "id.key"
    P2P.generate_identity(str(path))
    assert PeerKey.load(path).peer_id == PeerID.from_identity(path.read_bytes()).to_base58()


def test_key_file_is_private_and_never_overwritten(tmp_path) -> None:
    key = PeerKey.generate()
    path = tmp_path / "id.key"
    key.save(path)
    assert path.stat().st_mode & 0o077 == 0
    assert PeerKey.load(path).peer_id == key.peer_id
    with pytest.raises(FileExistsError):
        PeerKey.generate().save(path)
    (tmp_path / "junk.key").write_bytes(b"not a key")
    with pytest.raises(PeerKeyError, match="not a libp2p private key"):
        PeerKey.load(tmp_path / "junk.key")


def test_float_text_is_exact_binary64() -> None:
    assert float_text(0.5) == "f64:3fe0000000000000"
    assert float_text(0.1) != float_text(math.nextafter(0.1, 1.0))  # neighbouring doubles differ


@pytest.mark.parametrize("key_kind", ["ed25519", "rsa"])
def test_signed_card_survives_the_dht_round_trip(key_kind: str, rsa_key: PeerKey) -> None:
    key = PeerKey.generate() if key_kind == "ed25519" else rsa_key
    card = make_card(key).signed(key, SWARM, ttl_s=30)
    assert (card.public_key is None) == (key_kind == "ed25519")
    assert card.expires_ms == card.updated_ms + 30_000
    wire = MSGPackSerializer.loads(MSGPackSerializer.dumps(card.model_dump(mode="json")))
    again = parse_card(wire)
    again.check_signature(SWARM)
    again.check_times()
    with pytest.raises(RecordError, match="bad signature"):
        again.check_signature("other-swarm")  # the swarm is signed too: no replay into another swarm


def test_card_signing_payload_has_no_floats_and_covers_every_field() -> None:
    key = PeerKey.generate()
    card = make_card(key).signed(key, SWARM, 30)
    payload = card.signing_payload(SWARM)
    assert b"f64:" in payload and b"12.5" not in payload
    for field, value in {"price": 0.0, "rollouts_per_s": 1e6, "state": "stopping", "chunk_url": "http://10.0.0.1:1",
                         "updated_ms": card.updated_ms + 1, "expires_ms": card.expires_ms + 1, "held": [1]}.items():
        tampered = card.model_copy(update={field: value})
        with pytest.raises(RecordError, match="bad signature"):
            tampered.check_signature(SWARM)


def test_card_refusals() -> None:
    owner, attacker = PeerKey.generate(), PeerKey.generate()
    with pytest.raises(ValueError):
        make_card(owner).signed(attacker, SWARM, 30)  # the API refuses to sign someone else's card
    forged = make_card(owner, chunk_url="http://127.0.0.1:9")
    forged = forged.model_copy(update={"signature": attacker.sign(DOMAIN_CARD, forged.signing_payload(SWARM)).hex()})
    with pytest.raises(RecordError, match="bad signature") as e:
        forged.check_signature(SWARM)
    assert e.value.reason == "bad_signature"
    with pytest.raises(RecordError, match="not signed") as e:
        make_card(owner).check_signature(SWARM)
    assert e.value.reason == "unsigned"
    future = make_card(owner, updated_ms=int((time.time() + 86400) * 1000)).signed(owner, SWARM, 30)
    future.check_signature(SWARM)  # a valid signature does not make a date believable
    with pytest.raises(RecordError, match="ahead"):
        future.check_times()
    old = make_card(owner, updated_ms=int((time.time() - 7200) * 1000)).signed(owner, SWARM, 30)
    with pytest.raises(RecordError, match="expired"):
        old.check_times()
    fresh = make_card(owner).signed(owner, SWARM, 30)
    with pytest.raises(RecordError, match="past its signed expiry"):
        fresh.check_times(expiration_s=fresh.expires_ms / 1000 + 600)
    fresh.check_times(expiration_s=fresh.expires_ms / 1000)


def test_largest_card_fits_the_card_limit(rsa_key: PeerKey) -> None:
    card = make_card(
        rsa_key, software="s" * 32, maddrs=["/ip4/" + "1" * 251] * 8, chunk_url="http://" + "h" * 249,
        held=list(range(10**12 - 32, 10**12)), fetching=10**12, version=10**12, upload_bps=10**12,
        arrivals=[Arrival(version=10**12, seconds=123456.789)] * 8, t_bcast_s=1.5, active=True,
        bans=[BanNote(peer_id="Qm" + "z" * 126, reason="r" * 120)] * MAX_BANS_ON_CARD,
    ).signed(rsa_key, SWARM, 3600)
    size = len(MSGPackSerializer.dumps(card.model_dump(mode="json")))
    assert size <= MAX_CARD_BYTES < MAX_RECORD_BYTES, size


def head(key: PolicyKey, **fields: object) -> HeadRecord:
    values: dict[str, object] = dict(
        swarm=SWARM, version=3, manifest_sha256="ab" * 32, manifest_size=1234, publisher=PeerKey.generate().peer_id,
        published_ms=1, expires_ms=2, public_key=key.public.text,
    )
    values.update(fields)
    return HeadRecord(**values).signed(key)  # type: ignore[arg-type]


def test_head_carries_the_publishers_address_under_its_signature() -> None:
    key = PolicyKey.generate()
    h = head(key, chunk_url="http://127.0.0.1:8080", maddrs=["/ip4/127.0.0.1/tcp/4001"])
    assert parse_head(h.model_dump(mode="json")).signature_ok()
    for change in ({"chunk_url": "http://127.0.0.1:9"}, {"chunk_url": None}, {"maddrs": []},
                   {"maddrs": ["/ip4/6.6.6.6/tcp/1"]}):
        assert not h.model_copy(update=change).signature_ok(), change


def test_head_without_an_address_signs_the_same_bytes_as_before() -> None:
    key = PolicyKey.generate()
    h = head(key)
    assert b"chunk_url" not in h._payload() and b"maddrs" not in h._payload()
    legacy = {k: v for k, v in h.model_dump(mode="json").items() if k not in ("chunk_url", "maddrs")}
    assert parse_head(legacy).signature_ok()


def test_largest_head_fits_the_record_limit() -> None:
    h = head(PolicyKey.generate(), chunk_url="http://" + "h" * 249, maddrs=["/ip4/" + "1" * 251] * 8)
    assert len(MSGPackSerializer.dumps(h.model_dump(mode="json"))) < MAX_RECORD_BYTES
