"""Schemas of the small records peers publish in the DHT (bulk data never goes through the DHT).

Both sides speak these: the overlay validates them where they are stored, the policy plane (head)
and the daemon (peer cards) write them, and the learner and followers read them. They live below
all of those, so none has to reach into another's package for them.

    PeerCard    a daemon's self-description, under the swarm's peers key, subkey = its peer id
    HeadRecord  the learner's signed pointer to its newest policy version, subkey = its public key
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from echo2swarm.wire.signing import DOMAIN_HEAD, PolicyKey, PublicKey, canonical_bytes

MAX_RECORD_BYTES = 16 * 1024
MAX_SUBKEY_BYTES = 256
MAX_RECORD_TTL_S = 3600.0
MAX_VERSION = 10**12

PeerState = Literal["starting", "syncing", "ready", "stopping"]
PEER_STATES: tuple[str, ...] = ("starting", "syncing", "ready", "stopping")
_PEER_ID = re.compile(r"^[1-9A-HJ-NP-Za-km-z]{20,128}$")
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


class PeerCard(BaseModel):
    """What a daemon tells the swarm about itself; re-announced every announce period."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    peer_id: str = Field(max_length=128)
    role: Literal["learner", "rollout", "relay", "bootstrap"]
    price: float = Field(ge=0, le=10_000, allow_inf_nan=False, description="USD per hour")
    version: int | None = Field(None, ge=0, le=MAX_VERSION, description="policy version held; None: none yet")
    state: PeerState
    software: str = Field(max_length=32)
    maddrs: list[Annotated[str, Field(max_length=256)]] = Field(default_factory=list, max_length=8)
    chunk_url: str | None = Field(None, max_length=256)
    upload_bps: int | None = Field(None, ge=0, le=10**12, description="upload cap in bytes/s; None: unlimited")
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
    updated_ms: int = Field(ge=0)

    @field_validator("peer_id")
    @classmethod
    def _peer_id(cls, v: str) -> str:
        if not _PEER_ID.fullmatch(v):
            raise ValueError("peer_id must be a base58 libp2p peer id")
        return v

    @field_validator("chunk_url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"http://[^/\s]+", v):
            raise ValueError("chunk_url must be http://host:port")
        return v


def parse_card(value: object) -> PeerCard:
    if not isinstance(value, dict):
        raise RecordError(f"peer card is {type(value).__name__}, not a mapping")
    try:
        return PeerCard.model_validate(value)
    except ValidationError as e:
        raise RecordError(f"peer card does not match the schema: {e.errors()[0]['loc']}: {e.errors()[0]['msg']}") from None


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
    signature: str = Field("", pattern=r"^([0-9a-f]{128})?$")

    def _payload(self) -> bytes:
        return canonical_bytes(self.model_dump(mode="json", exclude={"signature"}))

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
    if not isinstance(value, dict):
        raise RecordError(f"head record is {type(value).__name__}, not a mapping")
    try:
        return HeadRecord.model_validate(value)
    except ValidationError as e:
        raise RecordError(f"head record does not match the schema: {e.errors()[0]['msg']}") from None
