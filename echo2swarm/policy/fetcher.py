"""Fetching a version: the manifest, then every missing chunk, each verified before it is stored.

    sources (learner today; any holder once peers re-serve) ──► PolicyFetcher
        manifest: first source whose bytes match the head's sha256 and the pinned signature
        chunks:   `parallel_chunks` in flight; chunk i starts at source i mod n (spreads load),
                  moves on after an error, bans a source for this version on a hash mismatch

A chunk whose bytes do not hash to its name is never written, so it can never be served onward.
Sources are a Protocol: adding peer sources or the libp2p transport needs no change here.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Protocol

import aiohttp

from echo2swarm.config.models import FetchConfig
from echo2swarm.policy.manifest import ChunkRef, HeadRecord, Manifest, ManifestError, verify_manifest
from echo2swarm.policy.signing import PublicKey
from echo2swarm.policy.store import ChunkHashError, ChunkStore
from echo2swarm.runtime.logging import get_logger

logger = get_logger(__name__)


class SourceError(Exception):
    """A source failed to deliver (network, status, size); another source may still work."""


class FetchError(Exception):
    """A version could not be fetched from any source."""


class ChunkSource(Protocol):
    name: str

    async def manifest(self, version: int, max_bytes: int) -> bytes: ...

    async def chunk(self, ref: ChunkRef) -> bytes: ...


class HttpSource:
    """A peer's chunk server, addressed by the `chunk_url` of its card."""

    def __init__(self, session: aiohttp.ClientSession, url: str, config: FetchConfig, name: str | None = None):
        self.session = session
        self.url = url.rstrip("/")
        self.config = config
        self.name = name or self.url

    async def _get(self, path: str, max_bytes: int, timeout: float) -> bytes:
        try:
            async with self.session.get(self.url + path, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                if resp.status != 200:
                    raise SourceError(f"{self.name}{path}: HTTP {resp.status}")
                if resp.content_length is not None and resp.content_length > max_bytes:
                    raise SourceError(f"{self.name}{path}: {resp.content_length} bytes exceeds the {max_bytes} limit")
                buf = bytearray()
                async for piece in resp.content.iter_chunked(1 << 16):
                    buf += piece
                    if len(buf) > max_bytes:
                        raise SourceError(f"{self.name}{path}: response exceeds the {max_bytes} byte limit")
                return bytes(buf)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise SourceError(f"{self.name}{path}: {type(e).__name__}: {e}") from None

    async def manifest(self, version: int, max_bytes: int) -> bytes:
        return await self._get(f"/v1/manifest/{version}", max_bytes, self.config.manifest_timeout_s)

    async def chunk(self, ref: ChunkRef) -> bytes:
        data = await self._get(f"/v1/chunk/{ref.sha256}", min(ref.size, self.config.max_chunk_bytes), self.config.chunk_timeout_s)
        if len(data) != ref.size:
            raise SourceError(f"{self.name}: chunk {ref.sha256[:12]} is {len(data)} bytes, expected {ref.size}")
        return data


class PolicyFetcher:
    """Fetch and verify one version at a time into a ChunkStore. `stats` counts every outcome."""

    def __init__(self, config: FetchConfig, chunks: ChunkStore):
        self.config = config
        self.chunks = chunks
        self.stats: Counter[str] = Counter()

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

    async def fetch_chunks(self, manifest: Manifest, sources: list[ChunkSource]) -> int:
        """Fetch every chunk not yet stored. Returns the number fetched."""
        missing = [ref for ref in manifest.chunk_refs() if not self.chunks.has(ref.sha256)]
        banned: set[str] = set()
        slots = asyncio.Semaphore(self.config.parallel_chunks)

        async def fetch_one(index: int, ref: ChunkRef) -> None:
            async with slots:
                for attempt in range(self.config.attempts_per_chunk):
                    usable = [s for s in sources if s.name not in banned]
                    if not usable:
                        raise FetchError(f"v{manifest.version}: every source is banned or gone")
                    source = usable[(index + attempt) % len(usable)]
                    try:
                        data = await source.chunk(ref)
                    except SourceError as e:
                        self.stats["source_error"] += 1
                        logger.info("chunk %s: %s", ref.sha256[:12], e)
                        continue
                    try:
                        await asyncio.to_thread(self.chunks.put, ref.sha256, data)
                    except ChunkHashError:
                        self.stats["bad_chunk"] += 1
                        banned.add(source.name)
                        logger.warning(
                            "chunk %s from %s does not match its hash: refused, source banned for v%d",
                            ref.sha256[:12], source.name, manifest.version,
                        )
                        continue
                    self.stats["chunks_fetched"] += 1
                    self.stats["bytes_fetched"] += ref.size
                    return
                raise FetchError(f"chunk {ref.sha256[:12]} of v{manifest.version} failed {self.config.attempts_per_chunk} attempts")

        # gather, not a TaskGroup: callers get the FetchError itself rather than an ExceptionGroup.
        tasks = [asyncio.create_task(fetch_one(i, ref)) for i, ref in enumerate(missing)]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return len(missing)
