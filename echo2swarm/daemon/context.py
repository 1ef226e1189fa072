"""What the supervisor hands a role service, and what it asks back: the contract between them.

    supervisor ── DaemonContext (overlay, stores, HTTP session, in-flight version, announcer) ──► service
    supervisor ◄── CardFields (into the peer card), stats (into /v1/info), head and plan (served) ── service

Every role service (learner, follower = rollout or relay, bootstrap) implements `RoleService`.
The supervisor never probes a service for optional methods: a role without a head or plans
answers None.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from echo2swarm.overlay.announcer import Announcer
from echo2swarm.overlay.node import Overlay
from echo2swarm.policy.pipeline import InFlight
from echo2swarm.policy.server import Handler
from echo2swarm.policy.store import ChunkStore, VersionStore
from echo2swarm.wire.records import HeadRecord, PeerState

# What a service reports in /v1/info under "stats": JSON values only (str keys, numbers, lists...).
Stats = Mapping[str, Any]


@dataclass
class DaemonContext:
    """The shared parts of one daemon, built by the supervisor before the role service."""

    overlay: Overlay
    chunks: ChunkStore
    versions: VersionStore
    session: aiohttp.ClientSession
    inflight: InFlight          # the version being fetched, re-served chunk by chunk as it arrives
    announcer: Announcer        # `announcer.trigger()`: our card changed, tell the swarm now


@dataclass(frozen=True)
class CardFields:
    """The role's part of the peer card (the supervisor adds identity, addresses, price, holdings)."""

    version: int | None = None       # policy version held (learner: published)
    state: PeerState = "ready"
    fetching: int | None = None      # version being fetched
    arrival_s: Mapping[int, float] = field(default_factory=dict)  # version -> seconds it took to arrive
    t_bcast_s: float | None = None   # learner: time until the planned peers held a version
    rollouts_per_s: float | None = None  # rollout: measured µ
    active: bool | None = None       # rollout: False while the learner keeps it on standby
    bans: Mapping[str, str] = field(default_factory=dict)  # learner: peer id -> why it was banned (newest last)
    # followers: version -> (fetch path, bytes fetched) of recent versions (delta versions, policy/catchup.py)
    fetch_paths: Mapping[int, tuple[str, int]] = field(default_factory=dict)
    # learner: its newest versions as {version, kind, dense_bytes, delta_bytes} (the card's `versions`)
    published: list[dict[str, Any]] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("arrival_s", "fetch_paths")}
        out["fetch_paths"] = {str(v): list(p) for v, p in self.fetch_paths.items()}
        out["arrival_s"] = {str(v): round(s, 3) for v, s in self.arrival_s.items()}
        return out


class RoleService(Protocol):
    async def start(self) -> None:
        """Load what the role needs (model, held versions) before the service runs."""

    async def run(self, stop: asyncio.Event) -> None:
        """The role's work until `stop` is set; the supervisor restarts it if it raises."""

    async def announce(self) -> None:
        """Store the role's own DHT records (the learner's head), every announce period."""

    def card_fields(self) -> CardFields: ...

    def stats(self) -> Stats: ...

    def head(self) -> HeadRecord | None:
        """The signed head this daemon serves at /v1/head (the learner's), else None."""

    def signed_plan(self, version: int) -> bytes | None:
        """The signed broadcast plan of `version` this daemon serves (the learner's), else None."""

    def http_routes(self) -> list[tuple[str, Handler]]:
        """Extra GET routes (path, handler) on the daemon's HTTP server (the learner's live page)."""


class BootstrapService:
    """Keeps the DHT reachable; holds no policy."""

    async def start(self) -> None:
        return None

    async def run(self, stop: asyncio.Event) -> None:
        await stop.wait()

    async def announce(self) -> None:
        return None

    def card_fields(self) -> CardFields:
        return CardFields()

    def stats(self) -> Stats:
        return {}

    def head(self) -> HeadRecord | None:
        return None

    def signed_plan(self, version: int) -> bytes | None:
        return None

    def http_routes(self) -> list[tuple[str, Handler]]:
        return []
