"""Fetching a version: the manifest, then every missing chunk, each verified before it is stored.

    route(i) ──► [plan parent (may hold the request until it has chunk i), holders, learner last] ──► PolicyFetcher
        manifest: first source whose bytes match the head's sha256 and the pinned signature
        chunks:   `parallel_chunks` in flight, in manifest order (so chains pipeline); each chunk
                  tries its route in order, moves on when a source is busy, missing the chunk,
                  unreachable or stalled, and bans a source for this version on a hash mismatch

A chunk whose bytes do not hash to its name is never written, so it can never be served onward.
Sources are a Protocol with two transports: HTTP (`HttpSource`) and libp2p streams
(`policy/p2p.py`); `PeerSource` uses a peer's HTTP server and falls back to libp2p when the
server cannot be reached.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Callable
from typing import Protocol

import aiohttp

from echo2swarm.config.models import FetchConfig
from echo2swarm.policy.manifest import ChunkRef, Manifest, ManifestError, verify_manifest
from echo2swarm.wire.records import HeadRecord
from echo2swarm.wire.signing import PublicKey
from echo2swarm.policy.store import Assembly, ChunkHashError, ChunkStore
from echo2swarm.runtime.logging import get_logger

logger = get_logger(__name__)
CONNECT_TIMEOUT_S = 10.0  # a peer that does not accept a TCP connection within this is unreachable over HTTP


class SourceError(Exception):
    """A source failed to deliver (network, status, size); another source may still work."""


class SourceBusy(SourceError):
    """All the source's upload slots are taken; not its fault, try another and come back."""


class SourceMissing(SourceError):
    """The source does not hold what was asked (yet)."""


class SourceUnreachable(SourceError):
    """The transport could not reach the source at all."""


class FetchError(Exception):
    """A version could not be fetched from any source."""


class ChunkSource(Protocol):
    name: str
    peer_id: str | None

    async def manifest(self, version: int, max_bytes: int) -> bytes: ...

    async def plan(self, version: int, max_bytes: int) -> bytes: ...

    async def chunk(self, ref: ChunkRef, wait: float = 0.0, version: int | None = None) -> bytes: ...


# A chunk's route: sources to try in order, each with how long it may hold the request for a
# chunk it is itself still fetching.
Route = Callable[[int, ChunkRef], list[tuple[ChunkSource, float]]]


def rotating(sources: list[ChunkSource]) -> Route:
    """A route over equal sources: chunk i starts at source i mod n, which spreads the load."""

    def route(index: int, ref: ChunkRef) -> list[tuple[ChunkSource, float]]:
        k = index % len(sources) if sources else 0
        return [(s, 0.0) for s in sources[k:] + sources[:k]]

    return route


class HttpSource:
    """A peer's chunk server, addressed by the `chunk_url` of its card."""

    def __init__(self, session: aiohttp.ClientSession, url: str, config: FetchConfig, name: str | None = None,
                 peer_id: str | None = None):
        self.session = session
        self.url = url.rstrip("/")
        self.config = config
        self.name = name or self.url
        self.peer_id = peer_id

    async def _get(self, path: str, max_bytes: int, timeout: float, wait: float = 0.0) -> bytes:
        limits = aiohttp.ClientTimeout(
            total=timeout + wait, sock_connect=min(timeout, CONNECT_TIMEOUT_S), sock_read=self.config.stall_timeout_s + wait
        )
        try:
            async with self.session.get(self.url + path, timeout=limits) as resp:
                if resp.status == 503:
                    raise SourceBusy(f"{self.name}{path}: busy")
                if resp.status == 404:
                    raise SourceMissing(f"{self.name}{path}: not held")
                if resp.status != 200:
                    raise SourceError(f"{self.name}{path}: HTTP {resp.status}")
                if resp.content_length is not None:
                    if resp.content_length > max_bytes:
                        raise SourceError(f"{self.name}{path}: {resp.content_length} bytes exceeds the {max_bytes} limit")
                    return await resp.read()  # one buffer, no per-piece copies; aiohttp stops at Content-Length
                buf = bytearray()
                async for piece in resp.content.iter_chunked(1 << 16):
                    buf += piece
                    if len(buf) > max_bytes:
                        raise SourceError(f"{self.name}{path}: response exceeds the {max_bytes} byte limit")
                return bytes(buf)
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
            # Refused, unroutable or filtered: this transport cannot reach the peer (libp2p may).
            raise SourceUnreachable(f"{self.name}: {type(e).__name__}: {e}") from None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise SourceError(f"{self.name}{path}: {type(e).__name__}: {e}") from None

    async def manifest(self, version: int, max_bytes: int) -> bytes:
        return await self._get(f"/v1/manifest/{version}", max_bytes, self.config.manifest_timeout_s)

    async def plan(self, version: int, max_bytes: int) -> bytes:
        return await self._get(f"/v1/plan/{version}", max_bytes, self.config.manifest_timeout_s)

    async def chunk(self, ref: ChunkRef, wait: float = 0.0, version: int | None = None) -> bytes:
        query = f"?wait={wait:g}&v={version}" if wait > 0 and version is not None else ""
        data = await self._get(
            f"/v1/chunk/{ref.sha256}{query}", min(ref.size, self.config.max_chunk_bytes), self.config.chunk_timeout_s, wait
        )
        if len(data) != ref.size:
            raise SourceError(f"{self.name}: chunk {ref.sha256[:12]} is {len(data)} bytes, expected {ref.size}")
        return data


class PeerSource:
    """A peer over HTTP when its card has a chunk URL we can reach, else over libp2p streams."""

    def __init__(self, http: ChunkSource | None, p2p: ChunkSource | None, name: str, peer_id: str,
                 url: str | None = None):
        assert http is not None or p2p is not None
        self.http, self.p2p = http, p2p
        self.url = url  # the card's chunk_url this source was built from
        self.name = name
        self.peer_id = peer_id

    async def _call(self, method: str, *args: object, **kwargs: object) -> bytes:
        if self.http is not None:
            try:
                return await getattr(self.http, method)(*args, **kwargs)
            except SourceUnreachable as e:
                if self.p2p is None:
                    raise
                logger.info("%s: HTTP unreachable (%s); using libp2p from now on", self.name, e)
                self.http = None
        assert self.p2p is not None
        return await getattr(self.p2p, method)(*args, **kwargs)

    async def manifest(self, version: int, max_bytes: int) -> bytes:
        return await self._call("manifest", version, max_bytes)

    async def plan(self, version: int, max_bytes: int) -> bytes:
        return await self._call("plan", version, max_bytes)

    async def chunk(self, ref: ChunkRef, wait: float = 0.0, version: int | None = None) -> bytes:
        return await self._call("chunk", ref, wait=wait, version=version)


class PolicyFetcher:
    """Fetch and verify one version at a time into a ChunkStore. `stats` counts every outcome."""

    def __init__(self, config: FetchConfig, chunks: ChunkStore):
        self.config = config
        self.chunks = chunks
        self.stats: Counter[str] = Counter()
        self.bytes_from: Counter[str] = Counter()  # by source name, for the current version

    async def fetch_manifest(
        self, head: HeadRecord, sources: list[ChunkSource], *, trusted: PublicKey, swarm: str
    ) -> tuple[Manifest, bytes]:
        limit = min(head.manifest_size, self.config.max_manifest_bytes)
        last: Exception | None = None
        for source in sources:
            try:
                data = await source.manifest(head.version, limit)
                manifest = verify_manifest(
                    data, head, trusted=trusted, swarm=swarm, max_chunk_bytes=self.config.max_chunk_bytes
                )
                return manifest, data
            except SourceError as e:
                self.stats["source_error"] += 1
                last = e
            except ManifestError as e:
                # A signed head but a bad manifest means the source lies: try the next one.
                self.stats[f"manifest_{e.reason}"] += 1
                logger.warning("manifest v%d from %s refused: %s", head.version, source.name, e)
                last = e
        if isinstance(last, ManifestError):
            raise last
        raise FetchError(f"no source delivered manifest v{head.version}: {last}")

    def _keep(self, sha256: str, data: bytes, sink: Assembly | None) -> None:
        self.chunks.put(sha256, data)  # raises ChunkHashError before anything is kept
        if sink is not None:
            sink.write(sha256, data)

    async def fetch_chunks(
        self, manifest: Manifest, route: Route, on_chunk: Callable[[str], None] = lambda sha: None,
        sink: Assembly | None = None,
    ) -> int:
        """Fetch every chunk not yet stored, in manifest order. Returns the number fetched.

        Each chunk is hashed in memory, stored, and (with `sink`) written straight into the
        version's files being assembled.
        """
        missing = [(i, ref) for i, ref in enumerate(manifest.chunk_refs()) if not self.chunks.has(ref.sha256)]
        banned: set[str] = set()  # served bad bytes, or unreachable over every transport
        self.bytes_from = Counter()
        slots = asyncio.Semaphore(self.config.parallel_chunks)

        async def fetch_one(index: int, ref: ChunkRef) -> None:
            rounds = 0
            async with slots:
                deadline = time.monotonic() + self.config.chunk_timeout_s * self.config.attempts_per_chunk
                while True:
                    only_busy = True
                    candidates = [(s, w) for s, w in route(index, ref) if s.name not in banned]
                    if not candidates:
                        raise FetchError(f"v{manifest.version}: every source is banned or gone")
                    for source, wait in candidates:
                        if source.name in banned:
                            continue
                        try:
                            data = await source.chunk(ref, wait=wait, version=manifest.version)
                        except SourceBusy:
                            self.stats["source_busy"] += 1
                            continue
                        except SourceUnreachable as e:
                            self.stats["source_unreachable"] += 1
                            only_busy = False
                            banned.add(source.name)
                            logger.info("%s is unreachable; not asked again for v%d: %s", source.name, manifest.version, e)
                            continue
                        except SourceMissing:
                            self.stats["source_missing"] += 1
                            only_busy = False
                            continue
                        except SourceError as e:
                            self.stats["source_error"] += 1
                            only_busy = False
                            logger.info("chunk %s: %s", ref.sha256[:12], e)
                            continue
                        try:
                            await asyncio.to_thread(self._keep, ref.sha256, data, sink)
                        except ChunkHashError:
                            self.stats["bad_chunk"] += 1
                            banned.add(source.name)
                            only_busy = False
                            logger.warning(
                                "chunk %s from %s does not match its hash: refused, source banned for v%d",
                                ref.sha256[:12], source.name, manifest.version,
                            )
                            continue
                        self.stats["chunks_fetched"] += 1
                        self.stats["bytes_fetched"] += ref.size
                        self.bytes_from[source.name] += ref.size
                        on_chunk(ref.sha256)
                        return
                    # Busy sources are not failing, only full: retry them until the deadline.
                    rounds += 0 if only_busy else 1
                    if rounds >= self.config.attempts_per_chunk or time.monotonic() > deadline:
                        raise FetchError(
                            f"chunk {ref.sha256[:12]} of v{manifest.version} failed {rounds} rounds over its sources"
                        )
                    await asyncio.sleep(random.uniform(0.05, 0.25) * (1 + rounds))

        # gather, not a TaskGroup: callers get the FetchError itself rather than an ExceptionGroup.
        tasks = [asyncio.create_task(fetch_one(i, ref)) for i, ref in missing]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return len(missing)
