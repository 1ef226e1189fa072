"""Typed configuration, one root model per role, every field documented with its unit.

Precedence (lowest first): defaults < TOML file < `ECHO2SWARM_*` environment < CLI flags.
`extra="forbid"` everywhere, so a misspelt key is an error rather than a silently ignored setting.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from echo2swarm.config.maddr import MaddrError, check_listen_maddr, check_peer_maddr
from echo2swarm.config.metrics import MetricsConfig
from echo2swarm.config.rl import ActivationConfig, Device, EngineConfig, LeaseConfig, PeersConfig, TrainConfig, VerifyConfig, WorkerConfig
from echo2swarm.config.units import parse_bytes

Role = Literal["learner", "rollout", "relay", "verifier", "bootstrap"]
_SWARM_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
MiB = 1024 * 1024
# Manifests a follower walks back from a target at most (policy/catchup.py): a keyframe period is no longer.
MAX_KEYFRAME_EVERY = 64


class StrictModel(BaseModel):
    # Env values are parsed as JSON, so ECHO2SWARM_OVERLAY__SWARM=2024 arrives as a number.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, coerce_numbers_to_str=True)


class OverlayConfig(StrictModel):
    """How this daemon joins the hivemind DHT. Flag names mirror hivemind/petals."""

    swarm: str = Field("echo2swarm", description="Swarm name: the namespace of every DHT key of this run.")
    initial_peers: list[str] = Field(
        default_factory=list,
        description="Multiaddrs (/ip4/.../tcp/N/p2p/ID) of peers already in the swarm. Empty requires new_swarm.",
    )
    new_swarm: bool = Field(False, description="Start a new swarm instead of joining one (only with no initial_peers).")
    host_maddrs: list[str] = Field(
        default_factory=lambda: ["/ip4/0.0.0.0/tcp/0", "/ip4/0.0.0.0/udp/0/quic-v1"],
        description="Multiaddrs to listen on; port 0 picks a free port. Keep QUIC (`/udp/N/quic-v1`) beside TCP "
        "unless UDP is blocked: peers behind NAT punch holes over it (operations.md, 'Behind NAT').",
    )
    announce_maddrs: list[str] = Field(
        default_factory=list, description="Public multiaddrs to advertise instead of the listen addresses (explicit ports)."
    )
    identity: Path | None = Field(
        None, description="Private key file for a persistent peer id; created if missing. None: a fresh id per start."
    )
    client_mode: bool = Field(
        False, description="Do not accept incoming DHT connections. False: decided at start, client mode when an "
        "initial peer's dial-back probe reached none of our ports (behind NAT or a firewall).",
    )
    use_relay: bool = Field(True, description="Allow connections through libp2p circuit relays.")
    use_auto_relay: bool = Field(
        True,
        description="Behind NAT, reserve a slot on a circuit relay (`relays`, else the initial peers) and advertise "
        "its /p2p-circuit address (operations.md, 'Behind NAT'). False: never reserve.",
    )
    relays: list[str] = Field(
        default_factory=list,
        description="Public peers (/ip4/.../tcp/N/p2p/ID) to reserve circuit relay slots on when behind NAT. "
        "Empty: the --initial-peers (bootstrap peers relay by default).",
    )
    relay_service: bool = Field(
        True, description="Serve as a libp2p circuit relay (v2) for peers behind NAT once AutoNAT finds this peer public."
    )
    relay_max_circuits: int = Field(16, ge=1, le=4096, description="Relayed connections open at once per relayed peer.")
    relay_max_reservations: int = Field(128, ge=1, le=65536, description="Peers that may hold a relay slot here at once.")
    relay_data_limit: int = Field(
        1 << 32, ge=1 << 20, le=1 << 40,
        description="Bytes one relayed connection may carry in each direction before the relay resets it.",
    )
    relay_time_limit_s: float = Field(
        1800.0, ge=10, le=86400, description="Seconds one relayed connection may last before the relay resets it."
    )
    reachability_period_s: float = Field(
        60.0, ge=1, le=3600,
        description="Seconds between reachability probes (a public peer dials our addresses and chunk URL back); "
        "our addresses are re-read every announce period.",
    )
    bootstrap_timeout_s: float = Field(
        15.0, gt=0, description="Seconds to reach at least one initial peer before giving up with exit code 2."
    )
    dht_timeout_s: float = Field(5.0, gt=0, description="Seconds to wait for one DHT request to a peer.")
    p2p_startup_timeout_s: float = Field(20.0, gt=0, description="Seconds for the libp2p daemon (p2pd) to start.")
    announce_period_s: float = Field(10.0, gt=0, description="Seconds between re-announcements of this peer's records.")
    record_ttl_s: float = Field(
        30.0, gt=0, le=3600, description="Seconds a record lives in the DHT without re-announcement (~3x announce_period_s)."
    )
    max_cards: int = Field(
        256, ge=8, le=100_000,
        description="Most peer cards one read keeps from each card shard (new keys are free: a shard may hold any "
        "number): peers seen doing work first, then those seen before, then the newest (docs/protocol.md §4.1).",
    )
    max_card_shard_bits: int = Field(
        10, ge=0, le=10,
        description="Learner: the deepest card sharding its heads may ask for (2**N shards of ~128 cards). 0 keeps "
        "every card under <swarm>/peers, the one key daemons older than card shards read (docs/protocol.md §4.1).",
    )

    @field_validator("swarm")
    @classmethod
    def _swarm_name(cls, v: str) -> str:
        if not _SWARM_NAME.fullmatch(v):
            raise ValueError("swarm names are 1-64 chars of a-z, 0-9, '.', '_', '-' and start with a letter or digit")
        return v

    @field_validator("initial_peers", "relays", mode="before")
    @classmethod
    def _split_peers(cls, v: object) -> object:
        # Accept "a b", "a,b" and ["a", "b"]: env vars and copy-pasted hivemind output use all three.
        if isinstance(v, str):
            return [p for p in re.split(r"[\s,]+", v) if p]
        return v

    @field_validator("initial_peers", "relays")
    @classmethod
    def _peer_maddrs(cls, v: list[str]) -> list[str]:
        for addr in v:
            try:
                check_peer_maddr(addr)
            except MaddrError as e:
                raise ValueError(str(e)) from None
        return v

    @field_validator("host_maddrs", "announce_maddrs")
    @classmethod
    def _listen_maddrs(cls, v: list[str]) -> list[str]:
        for addr in v:
            try:
                check_listen_maddr(addr)
            except MaddrError as e:
                raise ValueError(str(e)) from None
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "OverlayConfig":
        if self.record_ttl_s <= self.announce_period_s:
            raise ValueError(
                f"record_ttl_s ({self.record_ttl_s}) must exceed announce_period_s ({self.announce_period_s}), "
                "or records expire between announcements; use about 3x"
            )
        if self.new_swarm and self.initial_peers:
            raise ValueError("new_swarm and initial_peers exclude each other: join with --initial-peers or start with --new-swarm")
        return self


class ChunkServerConfig(StrictModel):
    """The HTTP server (and libp2p stream handler) that hands out manifests and verified chunks.

    Its capacity is split into budgets, each capped for all clients together and per client (an IP
    address over HTTP, a peer id over libp2p): connections, control requests (manifests, plans,
    /v1/head, /v1/info), held chunk requests and chunk uploads. Control requests have a budget of
    their own, so a flood of chunk requests cannot keep the swarm from its manifests. Held requests
    and connections keep a reserve for peers seen working (protocol.md §6). Past a per-client cap
    the answer is 429, past a global one 503, both with Retry-After.
    """

    enabled: bool = Field(True, description="Serve verified chunks to other peers over HTTP.")
    host: str = Field("0.0.0.0", description="Interface to bind.")
    port: int = Field(0, ge=0, le=65535, description="TCP port; 0 picks a free one.")
    public_url: str | None = Field(
        None, max_length=200,
        description="URL other peers use (http://host:port). None: derived from the bound port and overlay addresses.",
    )
    max_connections: int = Field(
        256, ge=1, le=65536,
        description="Open HTTP connections (all clients) at most, and libp2p requests being answered at most. "
        "A connection past it is answered once (503 for a chunk request) and closed; past twice it, closed at once.",
    )
    max_connections_per_client: int = Field(
        32, ge=1,
        description="Open HTTP connections from one IP address (libp2p: requests being answered for one peer id) at "
        "most; past it, 429 (protocol.md §6). Default: 32, at most half of max_connections.",
    )
    control_slots: int = Field(
        16, ge=1, le=4096,
        description="Manifest, plan, /v1/head and /v1/info requests (and any other non-chunk request) answered "
        "at once at most, both transports: a reserve that chunk traffic and held requests cannot take; more get 503.",
    )
    control_slots_per_client: int = Field(
        4, ge=1,
        description="Control requests answered at once for one client at most; more get 429. "
        "Default: 4, at most half of control_slots.",
    )
    max_waiting: int = Field(
        32, ge=1, le=4096,
        description="Chunk requests held at once (waiting for a chunk of the version being fetched) at most, "
        "both transports; more get 503.",
    )
    max_waiting_per_client: int = Field(
        8, ge=1,
        description="Chunk requests held at once for one client at most; more get 429. "
        "Default: 8, at most half of max_waiting.",
    )
    upload_slots: int = Field(
        16, ge=1, le=1024, description="Chunk bodies uploaded at once at most (HTTP and libp2p); more get 503 ('busy')."
    )
    upload_slots_per_client: int = Field(
        8, ge=1,
        description="Chunk bodies uploaded at once to one client at most; more get 429. "
        "Default: 8, at most half of upload_slots.",
    )
    wait_s: float = Field(
        15.0, ge=0, le=300,
        description="Seconds a request for a chunk this peer is still fetching is held until it arrives (pipelining). "
        "Only a version whose signed manifest this peer has verified is waited for.",
    )
    idle_timeout_s: float = Field(
        30.0, gt=0, le=3600,
        description="Seconds an HTTP connection may stay open without a request in progress: a new connection "
        "must send its whole request head within it, and an idle keep-alive connection is closed after it.",
    )
    retry_after_s: int = Field(
        2, ge=1, le=3600,
        description="Seconds a refused client is told to wait (HTTP Retry-After; libp2p error text) with every 429 "
        "and 503; an HTTP client refused a held request or connection again sooner gets its answer only then.",
    )
    held_reserve: int = Field(
        8, ge=0, le=4095,
        description="Held requests (of max_waiting) only peers seen working may take; all others together hold "
        "the rest (protocol.md §6). Default: 8, at most a quarter of max_waiting; 0: none.",
    )
    connection_reserve: int = Field(
        32, ge=0, le=65535,
        description="Connections (of max_connections; libp2p: requests being answered) only peers seen working "
        "may take (protocol.md §6). Default: 32, at most a quarter of max_connections; 0: none.",
    )
    working_ttl_s: float = Field(
        300.0, gt=0, le=86400,
        description="Seconds a peer counts as working after it was last seen at it: groups the learner accepted, "
        "or a whole version's worth of chunks fetched here with signed requests.",
    )
    auth_window_s: float = Field(
        30.0, gt=0, le=3600,
        description="Seconds a request credential's time (X-E2S-Peer, protocol.md §6) may be off our clock; "
        "outside it the request counts as anyone's.",
    )
    request_timeout_s: float = Field(120.0, gt=0, description="Seconds one chunk response may take before it is cut.")

    @model_validator(mode="before")
    @classmethod
    def _per_client_defaults(cls, data: object) -> object:
        # A per-client cap left unset follows its global cap down: its default, or half the global
        # cap where that is less (at least 1); a reserve likewise, a quarter (at least 0). So lowering a
        # global cap alone stays valid.
        if isinstance(data, dict):
            for share, total, part, least in (*((p, t, 2, 1) for p, t in cls.per_client_caps()),
                                              ("held_reserve", "max_waiting", 4, 0),
                                              ("connection_reserve", "max_connections", 4, 0)):
                if share not in data:
                    try:
                        given = int(data.get(total, cls.model_fields[total].default))
                    except (TypeError, ValueError):
                        continue  # the field's own validation reports it
                    default = cls.model_fields[share].default
                    data = {**data, share: min(default, max(least, given // part))}
        return data

    @field_validator("public_url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"http://[^/\s]+(:\d+)?/?", v):
            raise ValueError("public_url must look like http://203.0.113.5:8080")
        return v.rstrip("/") if v else v

    @model_validator(mode="after")
    def _caps(self) -> "ChunkServerConfig":
        for per_client, total in self.per_client_caps():
            mine, all_ = getattr(self, per_client), getattr(self, total)
            if mine > all_ or (mine == all_ and all_ > 1):
                raise ValueError(
                    f"chunk_server.{per_client} ({mine}) must be below chunk_server.{total} ({all_}), "
                    "or one client could take the whole budget"
                )
        for reserve, total in (("held_reserve", "max_waiting"), ("connection_reserve", "max_connections")):
            if getattr(self, reserve) >= getattr(self, total):
                raise ValueError(f"chunk_server.{reserve} ({getattr(self, reserve)}) must be below chunk_server.{total} "
                                 f"({getattr(self, total)}), or no client not seen working could be served")
        budgets = self.control_slots + self.max_waiting + self.upload_slots
        if self.max_connections < budgets:
            raise ValueError(
                f"chunk_server.max_connections ({self.max_connections}) must be at least control_slots + max_waiting "
                f"+ upload_slots ({budgets}), or chunk traffic could leave no connection for manifests"
            )
        mine = self.control_slots_per_client + self.max_waiting_per_client + self.upload_slots_per_client
        if self.max_connections_per_client < mine:
            raise ValueError(
                f"chunk_server.max_connections_per_client ({self.max_connections_per_client}) must be at least "
                f"control_slots_per_client + max_waiting_per_client + upload_slots_per_client ({mine})"
            )
        return self

    @staticmethod
    def per_client_caps() -> tuple[tuple[str, str], ...]:
        """(per-client cap, its global cap) field names."""
        return (
            ("max_connections_per_client", "max_connections"),
            ("control_slots_per_client", "control_slots"),
            ("max_waiting_per_client", "max_waiting"),
            ("upload_slots_per_client", "upload_slots"),
        )


class FetchConfig(StrictModel):
    """How followers fetch policy versions."""

    head_poll_s: float = Field(2.0, gt=0, description="Seconds between looks at the learner's head record.")
    head_wait_s: float = Field(
        10.0, ge=0, le=300,
        description="Seconds the learner's chunk server is asked to hold a head request until a newer head is out "
        "(long-poll; at most its chunk_server.wait_s). 0: heads from the DHT and lease replies only.",
    )
    holders_refresh_s: float = Field(
        2.0, ge=0.2, le=60, description="Seconds between reads of the peer cards (who holds what) during a fetch; "
        "every read costs every DHT node some CPU, and holders change on the scale of whole versions.",
    )
    upstream_cards: bool = Field(
        True, description="A follower the broadcast plan places reads only its upstream peers' cards, by their own "
        "keys. Off: the swarm's cards at every fetch, as before (per follower, a read of every card per version).",
    )
    delta_order_items: int = Field(
        2**27, ge=0, le=2**40,
        description="Largest held version, in parameters, whose delta visiting orders are kept (4 bytes each; "
        "2**27: 512 MiB) so that rebuilds skip their sorts (operations.md, 'Delta versions'). 0: never.",
    )
    manifest_timeout_s: float = Field(15.0, gt=0, description="Seconds to fetch one manifest.")
    chunk_timeout_s: float = Field(120.0, gt=0, description="Seconds to fetch one chunk from one source.")
    parallel_chunks: int = Field(4, ge=1, le=64, description="Chunks in flight at once.")
    attempts_per_chunk: int = Field(
        4, ge=1, description="Rounds over all known sources of one chunk before the version fetch fails."
    )
    peer_assist: bool = Field(
        True, description="Fetch from other peers (plan parent, then any holder, learner last). Off: learner only."
    )
    source_wait_s: float = Field(
        10.0, ge=0, le=300,
        description="Seconds to wait on a peer that is itself still fetching a chunk before trying another source.",
    )
    stall_timeout_s: float = Field(15.0, gt=0, description="Seconds without a byte from a source before moving on.")
    retry_backoff_s: float = Field(1.0, ge=0, description="Base of the exponential back-off after a failed version fetch.")
    min_rate_bps: int = Field(
        8 * 1024, ge=0, le=10**12,
        description="Slowest transfer a source may keep up after min_rate_grace_s, in bytes/s ('8KiB' accepted); "
        "slower, it is cut off and banned for ban_s (operations.md, 'Source bans'). 0: no minimum.",
    )
    min_rate_grace_s: float = Field(
        10.0, ge=0, le=600,
        description="Seconds of a body (from its response header) not held to min_rate_bps: latency, the first "
        "bytes, an upload limiter's queue. After it a body must have brought min_rate_bps x (elapsed - grace) bytes.",
    )
    hedge_after: float = Field(
        4.0, ge=0, le=100,
        description="A request that has run this many times the recent median chunk time is hedged: the next "
        "source is asked too, the first verified copy wins (operations.md, 'Hedged requests'). 0: never.",
    )
    hedge_min_s: float = Field(
        0.2, ge=0, le=600, description="Seconds a request runs at least before it is hedged, however fast the median.",
    )
    ban_s: float = Field(
        60.0, gt=0, le=86400,
        description="Seconds a source is not asked again after it stalled, was too slow or unreachable, or sent a "
        "bad body; doubles per repeat up to ban_max_s, across versions. The learner is never banned.",
    )
    ban_max_s: float = Field(1800.0, gt=0, le=86400, description="Longest ban of one source, in seconds.")
    max_manifest_bytes: int = Field(16 * MiB, ge=1024, description="Largest manifest accepted, in bytes.")
    max_chunk_bytes: int = Field(64 * MiB, ge=1024, description="Largest chunk accepted, in bytes.")

    @field_validator("max_manifest_bytes", "max_chunk_bytes", mode="before")
    @classmethod
    def _bytes(cls, v: object) -> int:
        return parse_bytes(v)  # type: ignore[arg-type]

    @field_validator("min_rate_bps", mode="before")
    @classmethod
    def _rate(cls, v: object) -> int:
        return parse_bytes(v.strip().removesuffix("/s") if isinstance(v, str) else v)  # type: ignore[arg-type]

    @model_validator(mode="after")
    def _bans(self) -> "FetchConfig":
        if self.ban_max_s < self.ban_s:
            raise ValueError(f"fetch.ban_max_s={self.ban_max_s} is below fetch.ban_s={self.ban_s}")
        return self


class StoreConfig(StrictModel):
    keep_versions: int = Field(2, ge=1, description="Newest policy versions kept on disk; older ones are "
                               "garbage-collected unless the rollout engine still reads them.")


class SupervisorConfig(StrictModel):
    """How the daemon restarts its role service and how long it takes to stop."""

    restart_backoff_s: float = Field(
        1.0, gt=0, le=60, description="Seconds before restarting a crashed role service; doubles with each "
        "consecutive crash, up to restart_backoff_max_s.",
    )
    restart_backoff_max_s: float = Field(30.0, gt=0, le=3600, description="Longest pause between restarts, in seconds.")
    stop_budget_s: float = Field(
        4.0, ge=1, le=120, description="Seconds a SIGTERM'd daemon takes at most to say `stopping` and stop its "
        "chunk server, DHT node and p2pd (operations.md, 'Stopping'; set systemd's stop timeout above it).",
    )
    stopping_card_timeout_s: float = Field(
        0.5, gt=0, le=30, description="Seconds spent storing the `stopping` card on the way out (part of the budget).",
    )


class PublishConfig(StrictModel):
    """What the learner publishes as signed policy versions."""

    model: Path | None = Field(None, description="Hugging Face model directory (safetensors) to publish and train.")
    policy_key: Path | None = Field(None, description="Ed25519 policy key written by `echo2swarm keygen`.")
    chunk_size: int | Literal["auto"] = Field(
        "auto",
        description="Bytes per chunk (64 KiB .. 64 MiB; accepts '8MiB'), or `auto`: about 256 chunks per version, a "
        "power of two within 64 KiB .. 8 MiB (operations.md, 'Chunk size').",
    )
    delta_chunk_size: int = Field(
        64 * 1024,
        description="Bytes per chunk of a delta file (16 KiB .. 64 MiB, at most chunk_size; accepts '64KiB'): finer "
        "than dense chunks, so a delta pipelines down the chains (operations.md, 'Delta versions').",
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="dtype of the published weights (what peers run): `auto` is the model directory's own; "
        "the learner trains fp32 master weights and publishes their cast.",
    )
    hold_ulps: float = Field(
        0.5, ge=0.5, le=2.0,
        description="fp32 masters to bf16/fp16: a published value is held until its master is more than this many "
        "ulps away (0.5: round to nearest). Fewer delta bytes, more lag: operations.md, 'Delta versions'.",
    )
    keyframe_every: int = Field(
        10, ge=1, le=MAX_KEYFRAME_EVERY,
        description="A dense version (keyframe) every this many versions, deltas between (1: all dense). At most "
        "64: a follower walks back at most 64 manifests to find a path.",
    )
    delta_max_ratio: float = Field(
        0.5, gt=0, le=1,
        description="Publish a keyframe instead of a delta when the delta exceeds this fraction of the dense weights.",
    )
    composites: bool = Field(
        True, description="Also offer, with each delta version, a composite delta from the last keyframe when it is "
        "smaller than the chain of deltas since (catch-up for peers that hold the keyframe).",
    )
    seeds: int = Field(
        2, ge=1, le=16,
        description="Peers the learner uploads each version to first (stripes of the broadcast plan); "
        "the rest flows peer to peer along chains or trees.",
    )
    plan_shape: Literal["auto", "chains", "trees"] = Field(
        "auto", description="Broadcast plan per stripe: a chain through every peer, or a tree over the fastest "
        "(protocol.md §5.5); auto: trees from 64 planned peers. chains: for swarms with daemons older than trees.",
    )
    plan_unproven: int = Field(
        32, ge=0, le=4096,
        description="Followers never seen working (relays, newcomers) a broadcast plan places after those seen "
        "working; the rest fetch from planned peers (foster parents: operations.md, 'Bandwidth and broadcast').",
    )
    cards_refresh_s: float | None = Field(
        None, gt=0, le=60, description="Seconds between the learner's reads of the peer cards while a version "
        "spreads: what T_bcast is measured with and the next plan is drawn from. None: half the overlay's "
        "announce period, at most 2 s.",
    )

    @field_validator("chunk_size", mode="before")
    @classmethod
    def _size(cls, v: object) -> int | str:
        if v == "auto":
            return v
        n = parse_bytes(v)  # type: ignore[arg-type]
        if not 64 * 1024 <= n <= 64 * MiB:
            raise ValueError("chunk_size must be between 64KiB and 64MiB")
        return n

    @field_validator("delta_chunk_size", mode="before")
    @classmethod
    def _delta_size(cls, v: object) -> int:
        n = parse_bytes(v)  # type: ignore[arg-type]
        if not 16 * 1024 <= n <= 64 * MiB:
            raise ValueError("delta_chunk_size must be between 16KiB and 64MiB")
        return n

    @model_validator(mode="after")
    def _delta_chunks(self) -> "PublishConfig":
        # With `auto` the publisher cuts deltas at most as finely as the size it picks (>= 64 KiB).
        if self.chunk_size != "auto" and self.delta_chunk_size > self.chunk_size:
            raise ValueError(f"publish.delta_chunk_size ({self.delta_chunk_size}) must be at most publish.chunk_size "
                             f"({self.chunk_size}): a manifest's chunks are at most its chunk_size")
        return self


VERSIONS_BEYOND_WINDOW = 4  # the learner keeps S + this many versions (LearnerConfig.versions_kept)
AUTO_CHUNKS = 256  # publish.chunk_size = "auto": about this many chunks per version
AUTO_CHUNK_MIN = 64 * 1024
AUTO_CHUNK_MAX = 8 * MiB


def auto_chunk_size(total_bytes: int) -> int:
    """`publish.chunk_size = "auto"` for a version of `total_bytes` (its dense weights and files): the largest
    power of two <= total_bytes / AUTO_CHUNKS, within AUTO_CHUNK_MIN .. AUTO_CHUNK_MAX.

    >>> auto_chunk_size(40 * 10**6), auto_chunk_size(10**9), auto_chunk_size(16 * 10**9)
    (131072, 2097152, 8388608)
    """
    target = max(1, total_bytes // AUTO_CHUNKS)
    return max(AUTO_CHUNK_MIN, min(AUTO_CHUNK_MAX, 1 << (target.bit_length() - 1)))


class _DaemonBase(StrictModel):
    state_dir: Path = Field(
        Path("~/.local/state/echo2swarm"), description="Directory for keys, pinned trust, chunks and policy versions."
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    price: float = Field(0.0, description="Advertised price of this peer in USD per hour (>= 0).")
    upload_limit: int | None = Field(
        None, description="Cap on this peer's total upload in bytes/s ('16MiB' accepted). None: unlimited."
    )
    overlay: OverlayConfig = Field(default_factory=OverlayConfig)
    chunk_server: ChunkServerConfig = Field(default_factory=ChunkServerConfig)
    supervisor: SupervisorConfig = Field(default_factory=SupervisorConfig)

    @field_validator("price")
    @classmethod
    def _price(cls, v: float) -> float:
        if not math.isfinite(v) or v < 0:
            raise ValueError("price is USD per hour and must be a finite number >= 0")
        if v > 10_000:
            raise ValueError("price is USD per hour; values above 10000 are surely a typo")
        return v

    @field_validator("upload_limit", mode="before")
    @classmethod
    def _rate(cls, v: object) -> int | None:
        if v is None:
            return None
        text = v.strip().removesuffix("/s") if isinstance(v, str) else v
        n = parse_bytes(text)  # type: ignore[arg-type]
        if not 64 * 1024 <= n <= 10**12:
            raise ValueError("upload_limit is bytes per second, between 64KiB and 1000GB (e.g. '16MiB')")
        return n

    @field_validator("state_dir")
    @classmethod
    def _expand(cls, v: Path) -> Path:
        return v.expanduser()


class _FollowerBase(_DaemonBase):
    trust: str | None = Field(
        None,
        description="Learner policy public key to pin: a path to KEY.pub or 'ed25519:<hex>'. None: trust on first use.",
    )
    fetch: FetchConfig = Field(default_factory=FetchConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)


class LearnerConfig(_DaemonBase):
    role: Literal["learner"] = "learner"
    publish: PublishConfig = Field(default_factory=PublishConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    leases: LeaseConfig = Field(default_factory=LeaseConfig)
    activation: ActivationConfig = Field(default_factory=ActivationConfig)
    peers: PeersConfig = Field(default_factory=PeersConfig)
    verify: VerifyConfig = Field(default_factory=VerifyConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)

    @model_validator(mode="after")
    def _needs_model(self) -> "LearnerConfig":
        if self.publish.model is None:
            raise ValueError("the learner needs a model directory: pass --model DIR (or [publish] model = ...)")
        if self.publish.policy_key is None:
            raise ValueError(
                "the learner needs a policy key: create one with `echo2swarm keygen KEY` and pass --policy-key KEY"
            )
        return self

    @property
    def versions_kept(self) -> int:
        """Newest versions the learner keeps (besides its delta chain): the staleness window, whose
        behaviour versions verification reads, plus a margin for followers still fetching one."""
        return max(self.store.keep_versions, self.train.staleness + VERSIONS_BEYOND_WINDOW)


class RolloutConfig(_FollowerBase):
    role: Literal["rollout"] = "rollout"
    engine: EngineConfig = Field(default_factory=EngineConfig)
    worker: WorkerConfig = Field(default_factory=WorkerConfig)


class RelayConfig(_FollowerBase):
    role: Literal["relay"] = "relay"


class CheckConfig(StrictModel):
    """How a verifier daemon computes the learner's exact checks (learner/verifiers.py)."""

    device: Device = Field(
        "auto", description="Torch device of the checks' forwards: auto (cuda when visible, else cpu), cpu, cuda or "
        "cuda:N. They run in fp32 whatever the published dtype, one module's weights at a time.",
    )
    threads: int | None = Field(None, ge=1, description="torch threads for the forwards. None: torch's default.")
    max_waiting: int = Field(
        4, ge=0, le=64, description="Checks queued behind the one running; more are answered `busy` (the learner "
        "asks another verifier or computes it itself).",
    )


class VerifierConfig(_FollowerBase):
    """Follows the learner's versions (fetch, verify, re-serve) and computes the exact checks of older
    versions for the learner whose signed head lists this daemon's peer id."""

    role: Literal["verifier"] = "verifier"
    check: CheckConfig = Field(default_factory=CheckConfig)
    store: StoreConfig = Field(
        default_factory=lambda: StoreConfig(keep_versions=8),
        description="Keep at least the learner's staleness window + 1 versions: older ones cannot be checked here.",
    )


class BootstrapConfig(_DaemonBase):
    """Keeps the DHT reachable; holds no policy, so its chunk server never starts."""

    role: Literal["bootstrap"] = "bootstrap"


DaemonConfig = Annotated[
    Union[LearnerConfig, RolloutConfig, RelayConfig, VerifierConfig, BootstrapConfig], Field(discriminator="role")
]
FollowerConfig = Union[RolloutConfig, RelayConfig, VerifierConfig]
