"""Schemas of the small records peers publish in the DHT (bulk data never goes through the DHT).

Both sides speak these: the overlay validates them where they are stored, the policy plane (head)
and the daemon (peer cards) write them, and the learner and followers read them. They live below
all of those, so none has to reach into another's package for them.

    PeerCard    a daemon's self-description, in its card shard and under a key of its own, subkey = its peer id;
                signed by the libp2p key of that peer id (wire/peer_keys.py), so only the peer
                itself can write or replace its card
    HeadRecord  the learner's signed pointer to its newest policy version, subkey = its public key;
                also carries the learner's own addresses, so followers need no card to reach it
    RosterRecord  the peers a daemon (the learner) saw doing work, under a key of its own; signed
                by its libp2p key like its card, so readers who trust its heads can read those
                peers' cards first, however many other cards the swarm holds
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, ValidationError, field_validator, model_serializer,
)

from echo2swarm.wire.ids import MAX_VERIFIERS, PEER_ID_PATTERN
from echo2swarm.wire.peer_keys import MAX_PUBLIC_KEY_BYTES, PeerKey, PeerKeyError, PeerPublicKey
from echo2swarm.wire.reach import HolepunchTransport, Reachability
from echo2swarm.wire.schema import schema_error
from echo2swarm.wire.signing import DOMAIN_CARD, DOMAIN_HEAD, PolicyKey, PublicKey, canonical_bytes, float_text

MAX_RECORD_BYTES = 16 * 1024
# A card is much smaller than any record may be (~1 KiB with a few addresses; under 6 KiB at every
# field's maximum with an RSA-4096 key): the cap keeps a dictionary of cards, which one DHT reply carries whole, small.
MAX_CARD_BYTES = 10 * 1024  # the largest legal card (RSA key, 8 maddrs, 32 held, 16 bans) fits
# How far a card's `updated_ms` may be ahead of a node's clock before the node refuses it.
CARD_CLOCK_SKEW_S = 30.0
MAX_SUBKEY_BYTES = 256
MAX_RECORD_TTL_S = 3600.0
MAX_CARD_SHARD_BITS = 10  # a swarm's card shards: at most 2**10 (overlay/dht_keys.py)
MAX_VERSION = 10**12

PeerState = Literal["starting", "syncing", "ready", "stopping"]
PEER_STATES: tuple[str, ...] = ("starting", "syncing", "ready", "stopping")
_PEER_ID = re.compile(PEER_ID_PATTERN)
HEAD_FORMAT = "echo2swarm-head/1"
# How far past its signed expiry a head may live in the DHT (clock skew between peers).
HEAD_EXPIRY_SLACK_S = 5.0
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", description="lowercase hex sha256")]


class RecordError(ValueError):
    """A record that must not be used. `reason` is a short counter label."""

    def __init__(self, message: str, reason: str = "malformed"):
        super().__init__(message)
        self.reason = reason


class _Strict(BaseModel):
    # strict: "5" or 5.0 is not the int 5, so each signed object has exactly one wire form.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Arrival(BaseModel):
    """How long one policy version took to arrive at a peer: from first seeing its head to installed."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    version: int = Field(ge=1, le=MAX_VERSION)
    seconds: float = Field(ge=0, le=1e6, allow_inf_nan=False)
    # delta versions (policy/catchup.py): the path that installed it and the bytes fetched for it
    path: Literal["delta", "chain", "composite", "keyframe"] | None = None
    fetched_bytes: int | None = Field(None, ge=0, le=10**15)


class VersionNote(_Strict):
    """A version the learner published: dense (a keyframe) or a delta, and its sizes (`echo2swarm peers`)."""

    version: int = Field(ge=1, le=MAX_VERSION)
    kind: Literal["dense", "delta"]
    dense_bytes: int = Field(ge=0, le=10**15)
    delta_bytes: int | None = Field(None, ge=0, le=10**15, description="the delta from the version before it")


class BanNote(_Strict):
    """A peer the learner banned for the run, and why (shown by `echo2swarm peers`)."""

    peer_id: str = Field(pattern=_PEER_ID.pattern)
    reason: str = Field(max_length=120)


MAX_BANS_ON_CARD = 16


class _PeerSigned:
    """Signing and checks of a record its peer signs with its libp2p key (cards, rosters).

    The record has `peer_id`, `updated_ms`, `expires_ms`, `public_key` and `signature` fields; its
    payload is canonical JSON of {KIND: fields but signature, "swarm": swarm} after DOMAIN.
    """

    DOMAIN: ClassVar[bytes]
    KIND: ClassVar[str]
    if TYPE_CHECKING:  # fields of the model this is mixed into (declared there, in its own order)
        peer_id: str
        updated_ms: int
        expires_ms: int
        public_key: str | None
        signature: str

    def signing_payload(self, swarm: str) -> bytes:
        """What the owner signs (after DOMAIN): canonical JSON of {KIND: fields but signature, "swarm": swarm}.

        Floats are written as `float_text` (exact binary64 bits), since canonical JSON has none.
        """

        def exact(value: object) -> object:
            if isinstance(value, float):
                return float_text(value)
            if isinstance(value, dict):
                return {k: exact(v) for k, v in value.items()}
            if isinstance(value, list):
                return [exact(v) for v in value]
            return value

        fields = self.model_dump(mode="json", exclude={"signature"})  # type: ignore[attr-defined]
        return canonical_bytes({self.KIND: exact(fields), "swarm": swarm})

    def signed(self: P, key: PeerKey, swarm: str, ttl_s: float) -> P:
        """This record signed by its peer's libp2p key, alive for `ttl_s` from `updated_ms`."""
        if key.peer_id != self.peer_id:
            raise ValueError(f"{self.KIND} of {self.peer_id} cannot be signed by the key of {key.peer_id}")
        unsigned = self.model_copy(update={  # type: ignore[attr-defined]
            "expires_ms": self.updated_ms + int(ttl_s * 1000),
            "public_key": None if key.public.embedded else key.public.proto.hex(),
            "signature": "",
        })
        signature = key.sign(self.DOMAIN, unsigned.signing_payload(swarm)).hex()
        return unsigned.model_copy(update={"signature": signature})  # type: ignore[no-any-return]

    def check_signature(self, swarm: str) -> None:
        """Raises RecordError unless the key that owns `peer_id` signed exactly this record for `swarm`."""
        what = f"{self.KIND} of {self.peer_id[-8:]}"
        if not self.signature:
            raise RecordError(f"{what} is not signed", "unsigned")
        try:
            key = PeerPublicKey.for_peer(self.peer_id, bytes.fromhex(self.public_key) if self.public_key else None)
        except (PeerKeyError, ValueError) as e:
            raise RecordError(f"{what}: no usable key for its peer id: {e}", "bad_key") from None
        if not key.verify(self.DOMAIN, self.signing_payload(swarm), bytes.fromhex(self.signature)):
            raise RecordError(f"{what} with a bad signature", "bad_signature")

    def check_times(self, expiration_s: float | None = None, now_s: float | None = None) -> None:
        """Raises RecordError if the record is dated in the future, already expired, or kept past its signed expiry.

        `expiration_s` is the DHT expiration it is stored with: at most the signed `expires_ms`
        (plus the clock skew), so nobody can replay an old record with a later DHT expiry.
        """
        check_times(f"{self.KIND} of {self.peer_id[-8:]}", self.updated_ms, self.expires_ms, expiration_s, now_s)


def check_times(what: str, updated_ms: int, expires_ms: int, expiration_s: float | None = None,
                now_s: float | None = None) -> None:
    """The time checks of a peer-signed record (`_PeerSigned.check_times`) from its two signed times."""
    now = time.time() if now_s is None else now_s
    if updated_ms > (now + CARD_CLOCK_SKEW_S) * 1000:
        raise RecordError(f"{what} dated {updated_ms / 1000 - now:.0f} s ahead", "future")
    if not updated_ms <= expires_ms <= updated_ms + int(MAX_RECORD_TTL_S * 1000):
        raise RecordError(f"{what} with a signed lifetime outside 0..{MAX_RECORD_TTL_S:.0f} s", "lifetime")
    if expires_ms < (now - CARD_CLOCK_SKEW_S) * 1000:
        raise RecordError(f"{what} expired {now - expires_ms / 1000:.0f} s ago", "expired")
    if expiration_s is not None and expiration_s > expires_ms / 1000 + CARD_CLOCK_SKEW_S:
        raise RecordError(f"{what} stored past its signed expiry (a replay?)", "replay")


P = TypeVar("P", bound=_PeerSigned)


class PeerCard(_PeerSigned, BaseModel):
    """What a daemon tells the swarm about itself; re-announced every announce period."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    DOMAIN: ClassVar[bytes] = DOMAIN_CARD
    KIND: ClassVar[str] = "card"

    peer_id: str = Field(max_length=128)
    role: Literal["learner", "rollout", "relay", "verifier", "bootstrap"]
    price: float = Field(ge=0, le=10_000, allow_inf_nan=False, description="USD per hour")
    version: int | None = Field(None, ge=0, le=MAX_VERSION, description="policy version held; None: none yet")
    state: PeerState
    software: str = Field(max_length=32)
    maddrs: list[Annotated[str, Field(max_length=256)]] = Field(default_factory=list, max_length=8)
    chunk_url: str | None = Field(None, max_length=256)
    reachability: Reachability | None = Field(
        None, description="how others reach this peer (overlay/reachability.py); None: not measured (older peers)"
    )
    holepunch: list[HolepunchTransport] = Field(
        default_factory=list, max_length=2, description="behind NAT: transports on which this peer holds direct "
        "(hole-punched) connections to other NAT'd peers lately (overlay/reachability.py); empty: none seen"
    )
    upload_bps: int | None = Field(None, ge=0, le=10**12, description="upload cap in bytes/s; None: unlimited")
    uplink_bps: int | None = Field(
        None, ge=0, le=10**12, description="measured upload bytes/s sustained while busy (policy/uplink.py); None: not yet"
    )
    held: list[Annotated[int, Field(ge=1, le=MAX_VERSION)]] = Field(
        default_factory=list, max_length=32, description="complete versions this peer serves"
    )
    fetching: int | None = Field(None, ge=1, le=MAX_VERSION, description="version being fetched (served as it arrives)")
    arrivals: list[Arrival] = Field(default_factory=list, max_length=8, description="recent versions' arrival times")
    t_bcast_s: float | None = Field(
        None, ge=0, le=1e6, allow_inf_nan=False, description="learner: time until every planned peer held a version (EWMA)"
    )
    rollouts_per_s: float | None = Field(
        None, ge=0, le=1e7, allow_inf_nan=False, description="rollout: measured rollouts/s; None: not measured yet"
    )
    active: bool | None = Field(None, description="rollout: False while the learner keeps it on standby; None: not told")
    versions: list[VersionNote] = Field(
        default_factory=list, max_length=8, description="learner: the newest versions' kind and bytes"
    )
    bans: list[BanNote] = Field(
        default_factory=list, max_length=MAX_BANS_ON_CARD, description="learner: the peers it banned most recently"
    )
    updated_ms: int = Field(ge=0)
    expires_ms: int = Field(0, ge=0, description="signed end of life: no node keeps the card longer (set when signed)")
    public_key: str | None = Field(
        None, pattern=r"^(?:[0-9a-f]{2})+$", max_length=2 * MAX_PUBLIC_KEY_BYTES,
        description="hex libp2p PublicKey protobuf; only for peer ids that do not embed their key (RSA)",
    )
    signature: str = Field("", pattern=r"^((?:[0-9a-f]{2}){1,512})?$", description="hex; by the key of peer_id")

    @field_validator("peer_id")
    @classmethod
    def _peer_id(cls, v: str) -> str:
        if not _PEER_ID.fullmatch(v):
            raise ValueError("peer_id must be a base58 libp2p peer id")
        return v

    @field_validator("holepunch")
    @classmethod
    def _transports(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("holepunch lists a transport twice")
        return v

    @field_validator("chunk_url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"http://[^/\s]+", v):
            raise ValueError("chunk_url must be http://host:port")
        return v

R = TypeVar("R", bound=BaseModel)


def _parse(model: type[R], value: object, what: str) -> R:
    """A record from a DHT value, or RecordError naming what is wrong with it (attacker-controlled input)."""
    if not isinstance(value, dict):
        raise RecordError(f"{what} is {type(value).__name__}, not a mapping")
    try:
        return model.model_validate(value)
    except ValidationError as e:
        raise RecordError(f"{what} does not match the schema: {schema_error(e)}") from None


def parse_card(value: object) -> PeerCard:
    return _parse(PeerCard, value, "peer card")


# Beside the other signing domains (wire/signing.py): a roster signature is never a card's or a head's.
DOMAIN_ROSTER = b"echo2swarm/roster/v1\n"
ROSTER_FORMAT = "echo2swarm-roster/1"
MAX_ROSTER_PEERS = 128  # ~13.5 KiB signed with Ed25519 ids; the writer trims its oldest entries to fit MAX_RECORD_BYTES
WorkKind = Literal["delivered", "served"]


class RosterEntry(_Strict):
    """A peer its roster's signer saw doing work: which kinds, and when last (the signer's clock)."""

    peer_id: str = Field(pattern=_PEER_ID.pattern)
    work: list[WorkKind] = Field(
        min_length=1, max_length=2,
        description="delivered: groups the learner accepted; served: chunks that verified against a signed manifest",
    )
    seen_ms: int = Field(ge=0)

    @field_validator("work")
    @classmethod
    def _kinds(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("work lists a kind twice")
        return v


class RosterRecord(_PeerSigned, _Strict):
    """The peers a daemon saw doing work lately, newest evidence first (docs/protocol.md §4.9).

    Stored under `<swarm>/roster/<peer_id>` (overlay/dht_keys.py), subkey = the signer's peer id,
    signed by that peer's libp2p key exactly as its card is. The learner publishes one; readers that
    trust a learner (its heads name it as publisher) read the cards of its roster's peers first.
    """

    DOMAIN: ClassVar[bytes] = DOMAIN_ROSTER
    KIND: ClassVar[str] = "roster"

    format: Literal["echo2swarm-roster/1"] = ROSTER_FORMAT
    peer_id: str = Field(pattern=_PEER_ID.pattern, description="the signer (a learner)")
    peers: list[RosterEntry] = Field(default_factory=list, max_length=MAX_ROSTER_PEERS)
    updated_ms: int = Field(ge=0)
    expires_ms: int = Field(0, ge=0, description="signed end of life: no node keeps the roster longer (set when signed)")
    public_key: str | None = Field(None, pattern=r"^(?:[0-9a-f]{2})+$", max_length=2 * MAX_PUBLIC_KEY_BYTES)
    signature: str = Field("", pattern=r"^((?:[0-9a-f]{2}){1,512})?$")

    @field_validator("peers")
    @classmethod
    def _distinct(cls, v: list[RosterEntry]) -> list[RosterEntry]:
        if len({e.peer_id for e in v}) != len(v):
            raise ValueError("a roster lists a peer twice")
        return v


def parse_roster(value: object) -> RosterRecord:
    return _parse(RosterRecord, value, "roster")


class HeadRecord(_Strict):
    """The DHT record announcing the newest version. Stored under subkey = public key text."""

    format: Literal["echo2swarm-head/1"] = HEAD_FORMAT
    swarm: str = Field(max_length=64)
    version: int = Field(ge=1, le=MAX_VERSION)
    manifest_sha256: Sha256
    manifest_size: int = Field(gt=0)
    publisher: str = Field(pattern=_PEER_ID.pattern, description="peer id of the learner that serves the manifest")
    published_ms: int = Field(ge=0)
    expires_ms: int = Field(
        ge=0, description="signed end of life; nodes refuse to keep the record longer, so a replay dies with it"
    )
    public_key: str = Field(max_length=80)
    # Where followers reach the publisher (its chunk server and libp2p addresses), signed with the
    # rest, so a forged card cannot send them elsewhere. Absent from the signed bytes when empty.
    chunk_url: str | None = Field(None, max_length=256, pattern=r"^http://[^/\s]+$")
    maddrs: list[Annotated[str, Field(max_length=256)]] = Field(default_factory=list, max_length=8)
    # The swarm's card shard depth (overlay/dht_keys.py): where every peer stores its card and readers
    # look for cards. Absent from the signed bytes (and from the record) at 0, so a head of a swarm that
    # never deepened its shards is the same record daemons before shards existed sign and read.
    card_shard_bits: int = Field(0, ge=0, le=MAX_CARD_SHARD_BITS)
    # Peer ids of the verifier daemons the learner has run its exact checks (learner/verifiers.py):
    # signed, so a verifier serves only the learner that lists it. Absent from the record when empty.
    verifiers: list[Annotated[str, Field(pattern=PEER_ID_PATTERN)]] = Field(default_factory=list,
                                                                           max_length=MAX_VERIFIERS)
    signature: str = Field("", pattern=r"^([0-9a-f]{128})?$")

    def _payload(self) -> bytes:
        exclude = {"signature"}
        if self.chunk_url is None:
            exclude.add("chunk_url")
        if not self.maddrs:
            exclude.add("maddrs")
        if not self.verifiers:
            exclude.add("verifiers")
        return canonical_bytes(self.model_dump(mode="json", exclude=exclude))

    @model_serializer(mode="wrap")
    def _without_default_shards(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Every dump leaves out `card_shard_bits` at 0 and `verifiers` when empty: the record daemons
        without card shards or verifiers parse."""
        out = handler(self)
        if out.get("card_shard_bits") == 0:
            del out["card_shard_bits"]
        if out.get("verifiers") == []:
            del out["verifiers"]
        return out

    def signed(self, key: PolicyKey) -> "HeadRecord":
        if key.public.text != self.public_key:
            raise ValueError("head public_key must be the signing key's")
        return self.model_copy(update={"signature": key.sign(DOMAIN_HEAD, self._payload()).hex()})

    def signature_ok(self) -> bool:
        try:
            key = PublicKey.parse(self.public_key)
            return key.verify(DOMAIN_HEAD, self._payload(), bytes.fromhex(self.signature))
        except ValueError:
            return False


def parse_head(value: object) -> HeadRecord:
    return _parse(HeadRecord, value, "head record")
