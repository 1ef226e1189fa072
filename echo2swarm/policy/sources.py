"""Where chunks come from: the source protocol, its two transports and how a source can fail.

    HttpSource  a peer's chunk server over HTTP (aiohttp), held to `MinRate` once a body has started
    PeerSource  a peer's HTTP server, falling back to libp2p streams (policy/p2p.py) when unreachable
    rotating    a route over equal sources (chunk i starts at source i mod n)
    Progress    what a request reports as it runs (its body began, bytes received): hedging reads it

Every failure is a `SourceError` subclass: busy and missing are the source's honest answers;
unreachable, stalled, slow, truncated and oversized (`SourceFault`) get a source banned
(`fetcher.SourceBans`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import aiohttp

from echo2swarm.config.models import FetchConfig
from echo2swarm.policy.manifest import ChunkRef
from echo2swarm.runtime.logging import get_logger

logger = get_logger(__name__)

OFF_PATH_HEADER = "X-E2S-Off-Path"  # on a 404 for a chunk: "1" when the server is on another path of the version
CONNECT_TIMEOUT_S = 10.0  # a peer that does not accept a TCP connection within this is unreachable over HTTP
class SourceError(Exception):
    """A source failed to deliver (network, status, size); another source may still work."""


class SourceBusy(SourceError):
    """All the source's upload slots are taken; not its fault, try another and come back."""


class SourceMissing(SourceError):
    """The source does not hold what was asked (yet)."""


class SourceOffPath(SourceMissing):
    """The source fetches or holds the version by a path without this chunk: it will not hold it (§7.6)."""


class SourceUnreachable(SourceError):
    """The transport could not reach the source at all."""


class SourceFault(SourceError):
    """The source misbehaved while sending a body: it gets banned. `reason` names how (a stats label)."""

    reason = "fault"


class SourceStalled(SourceFault):
    """Nothing arrived from the source for `fetch.stall_timeout_s` (plus the wait it was asked to hold)."""

    reason = "stalled"


class SourceSlow(SourceFault):
    """The body came slower than `fetch.min_rate_bps` after the grace period, or not within the request's timeout."""

    reason = "slow"


class SourceTruncated(SourceFault):
    """The body ended before its `Content-Length` or the size the manifest names."""

    reason = "truncated"


class SourceOversized(SourceFault):
    """The body (or its `Content-Length`) is larger than what was asked for."""

    reason = "oversized"


class Progress:
    """How far one request has come, as its source reports it: when its body began (the header of an
    answer with the bytes) and the bytes received so far. `on_begin` is called once, when it begins.
    The fetcher's hedging (`policy/hedge.py`) reads it; a source given none reports nothing."""

    def __init__(self, on_begin: Callable[[], None] = lambda: None):
        self.begun_at: float | None = None  # monotonic seconds
        self.received = 0
        self._on_begin = on_begin

    def begin(self) -> None:
        if self.begun_at is None:
            self.begun_at = time.monotonic()
            self._on_begin()


class ChunkSource(Protocol):
    name: str
    peer_id: str | None

    async def manifest(self, version: int, max_bytes: int, progress: Progress | None = None) -> bytes: ...

    async def plan(self, version: int, max_bytes: int) -> bytes: ...

    async def chunk(self, ref: ChunkRef, wait: float = 0.0, version: int | None = None,
                    progress: Progress | None = None) -> bytes: ...


# A chunk's route: sources to try in order, each with how long it may hold the request for a
# chunk it is itself still fetching.
Route = Callable[[int, ChunkRef], list[tuple[ChunkSource, float]]]


def rotating(sources: list[ChunkSource]) -> Route:
    """A route over equal sources: chunk i starts at source i mod n, which spreads the load."""

    def route(index: int, ref: ChunkRef) -> list[tuple[ChunkSource, float]]:
        k = index % len(sources) if sources else 0
        return [(s, 0.0) for s in sources[k:] + sources[:k]]

    return route


@dataclass(frozen=True)
class MinRate:
    """The minimum-rate rule for one body, which began (its response header came) at `started`.

    After `grace_s` the body must have brought `rate_bps` bytes per second of its age beyond the
    grace: `received >= rate_bps * (now - started - grace_s)`. So the next bytes are due by
    `deadline(received)`. A source that sends in bursts (an upload limiter hands out 256 KiB
    blocks in turn) passes as long as it keeps the average; one that drips a byte now and then
    is cut at about `started + grace_s`.
    """

    rate_bps: int
    grace_s: float
    started: float

    def deadline(self, received: int) -> float | None:
        """When the body is too slow unless more bytes have come; None: no minimum."""
        if self.rate_bps <= 0:
            return None
        return self.started + self.grace_s + received / self.rate_bps

    def describe(self, received: int, now: float) -> str:
        return (f"{received} bytes in {now - self.started:.1f} s, below {self.rate_bps} bytes/s "
                f"after a {self.grace_s:g} s grace")


async def read_body(
    readany: Callable[[], Awaitable[bytes]], max_bytes: int, rule: MinRate, what: str,
    clock: Callable[[], float] = time.monotonic, progress: Progress | None = None,
) -> bytes:
    """Read a body piece by piece (`readany` returns b"" at its end), at most `max_bytes`, held to `rule`;
    each piece is counted in `progress`.

    Raises SourceOversized past `max_bytes` and SourceSlow when the next bytes are not there by
    `rule.deadline`. Errors of the transport itself (a stall, a reset) propagate as they are.
    """
    buf = bytearray()
    while True:
        deadline = rule.deadline(len(buf))
        if deadline is None:
            piece = await readany()
        else:
            left = deadline - clock()
            try:
                if left <= 0:
                    raise asyncio.TimeoutError
                piece = await asyncio.wait_for(readany(), left)
            except aiohttp.ServerTimeoutError:
                raise  # the transport's own stall timeout: not ours to rename
            except asyncio.TimeoutError:
                raise SourceSlow(f"{what}: {rule.describe(len(buf), clock())}") from None
        if not piece:
            return bytes(buf)
        buf += piece
        if progress is not None:
            progress.received += len(piece)
        if len(buf) > max_bytes:
            raise SourceOversized(f"{what}: response exceeds the {max_bytes} byte limit")


class HttpSource:
    """A peer's chunk server, addressed by the `chunk_url` of its card."""

    def __init__(self, session: aiohttp.ClientSession, url: str, config: FetchConfig, name: str | None = None,
                 peer_id: str | None = None):
        self.session = session
        self.url = url.rstrip("/")
        self.config = config
        self.name = name or self.url
        self.peer_id = peer_id

    async def _get(self, path: str, max_bytes: int, timeout: float, wait: float = 0.0,
                   progress: Progress | None = None) -> bytes:
        limits = aiohttp.ClientTimeout(
            total=timeout + wait, sock_connect=min(timeout, CONNECT_TIMEOUT_S), sock_read=self.config.stall_timeout_s + wait
        )
        what = f"{self.name}{path}"
        try:
            async with self.session.get(self.url + path, timeout=limits) as resp:
                if resp.status in (429, 503):  # its budget, or our share of it, is full: try another holder
                    raise SourceBusy(f"{what}: busy ({resp.status})")
                if resp.status == 404:
                    if resp.headers.get(OFF_PATH_HEADER) == "1":
                        raise SourceOffPath(f"{what}: not on its path of the version")
                    raise SourceMissing(f"{what}: not held")
                if resp.status != 200:
                    raise SourceError(f"{what}: HTTP {resp.status}")
                if resp.content_length is not None and resp.content_length > max_bytes:
                    raise SourceOversized(f"{what}: {resp.content_length} bytes exceeds the {max_bytes} limit")
                # aiohttp stops at Content-Length, and raises ClientPayloadError if the body ends before it.
                rule = MinRate(self.config.min_rate_bps, self.config.min_rate_grace_s, time.monotonic())
                if progress is not None:
                    progress.begin()
                return await read_body(resp.content.readany, max_bytes, rule, what, progress=progress)
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
            # Refused, unroutable or filtered: this transport cannot reach the peer (libp2p may).
            raise SourceUnreachable(f"{self.name}: {type(e).__name__}: {e}") from None
        except aiohttp.ClientPayloadError as e:
            raise SourceTruncated(f"{what}: the body ended early ({type(e).__name__}: {e})") from None
        except aiohttp.ServerTimeoutError:  # sock_read: not a byte for stall_timeout_s (+ the wait asked)
            raise SourceStalled(f"{what}: nothing for {self.config.stall_timeout_s + wait:g} s") from None
        except asyncio.TimeoutError:  # the whole request's timeout: bytes came, too slowly to finish
            raise SourceSlow(f"{what}: not done within {timeout + wait:g} s") from None
        except (aiohttp.ClientError, OSError) as e:
            raise SourceError(f"{what}: {type(e).__name__}: {e}") from None

    async def manifest(self, version: int, max_bytes: int, progress: Progress | None = None) -> bytes:
        return await self._get(f"/v1/manifest/{version}", max_bytes, self.config.manifest_timeout_s, progress=progress)

    async def plan(self, version: int, max_bytes: int) -> bytes:
        return await self._get(f"/v1/plan/{version}", max_bytes, self.config.manifest_timeout_s)

    async def chunk(self, ref: ChunkRef, wait: float = 0.0, version: int | None = None,
                    progress: Progress | None = None) -> bytes:
        # `v` names the version the chunk is of: a holder on another path of it says so (404 off path)
        query = "" if version is None else f"?wait={wait:g}&v={version}" if wait > 0 else f"?v={version}"
        data = await self._get(
            f"/v1/chunk/{ref.sha256}{query}", min(ref.size, self.config.max_chunk_bytes), self.config.chunk_timeout_s, wait,
            progress,
        )
        if len(data) != ref.size:  # never more: read_body stops at min(ref.size, max_chunk_bytes)
            raise SourceTruncated(f"{self.name}: chunk {ref.sha256[:12]} is {len(data)} bytes, expected {ref.size}")
        return data


class PeerSource:
    """A peer over HTTP when its card has a chunk URL we can reach, else over libp2p streams.

    Over libp2p a chunk request is also held to the minimum rate, as a whole: it must be done
    within wait + CONNECT_TIMEOUT_S + min_rate_grace_s + size / min_rate_bps (HTTP checks it as
    the bytes come, `read_body`).
    """

    def __init__(self, http: ChunkSource | None, p2p: ChunkSource | None, name: str, peer_id: str,
                 url: str | None = None, config: FetchConfig | None = None):
        assert http is not None or p2p is not None
        self.http, self.p2p = http, p2p
        self.url = url  # the card's chunk_url this source was built from
        self.name = name
        self.peer_id = peer_id
        self.config = config

    async def _call(self, method: str, *args: object, p2p_limit_s: float | None = None, **kwargs: object) -> bytes:
        if self.http is not None:
            try:
                return await getattr(self.http, method)(*args, **kwargs)
            except SourceUnreachable as e:
                if self.p2p is None:
                    raise
                logger.info("%s: HTTP unreachable (%s); using libp2p from now on", self.name, e)
                self.http = None
        assert self.p2p is not None
        if p2p_limit_s is None:
            return await getattr(self.p2p, method)(*args, **kwargs)
        try:
            return await asyncio.wait_for(getattr(self.p2p, method)(*args, **kwargs), p2p_limit_s)
        except asyncio.TimeoutError:
            raise SourceSlow(f"{self.name}: {method} over libp2p not done within {p2p_limit_s:.1f} s") from None

    def _p2p_limit_s(self, size: int, wait: float) -> float | None:
        if self.config is None or self.config.min_rate_bps <= 0:
            return None
        return wait + CONNECT_TIMEOUT_S + self.config.min_rate_grace_s + size / self.config.min_rate_bps

    async def manifest(self, version: int, max_bytes: int, progress: Progress | None = None) -> bytes:
        return await self._call("manifest", version, max_bytes, progress=progress)

    async def plan(self, version: int, max_bytes: int) -> bytes:
        return await self._call("plan", version, max_bytes)

    async def chunk(self, ref: ChunkRef, wait: float = 0.0, version: int | None = None,
                    progress: Progress | None = None) -> bytes:
        return await self._call("chunk", ref, wait=wait, version=version, progress=progress,
                                p2p_limit_s=self._p2p_limit_s(ref.size, wait))
