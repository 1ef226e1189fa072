"""The libp2p fallback transport between two real overlay nodes in one process (real p2pd, real DHT)."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest

from echo2swarm.config.models import ChunkServerConfig, FetchConfig, OverlayConfig
from echo2swarm.learner.versions import VersionWriter
from echo2swarm.overlay.node import Overlay
from echo2swarm.overlay.streams import StreamError, open_frames, stream_name
from echo2swarm.policy.fetcher import PolicyFetcher
from echo2swarm.policy.sources import SourceMissing, SourceOffPath, rotating
from echo2swarm.policy.limiter import RateLimiter
from echo2swarm.policy.p2p import P2PSource, serve_p2p
from echo2swarm.policy.server import ChunkService
from echo2swarm.wire.signing import PolicyKey
from echo2swarm.policy.store import ChunkStore, VersionStore

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]
LOCAL = ["/ip4/127.0.0.1/tcp/0"]


async def _pair(swarm: str) -> tuple[Overlay, Overlay]:
    a = await Overlay.start(OverlayConfig(swarm=swarm, new_swarm=True, host_maddrs=LOCAL))
    b = await Overlay.start(OverlayConfig(swarm=swarm, initial_peers=await a.visible_maddrs(), host_maddrs=LOCAL))
    return a, b


def test_chunks_travel_over_libp2p_verified_and_at_the_upload_limit(tmp_path: Path, tiny_model_dir: Path):
    async def scenario() -> tuple[int, float, dict]:
        key = PolicyKey.generate()
        a, b = await _pair("p2p")
        try:
            chunks, versions = ChunkStore(tmp_path / "a"), VersionStore(tmp_path / "a")
            writer = VersionWriter("p2p", key, chunks, versions, 64 * 1024, a.peer_id)
            head = writer.sign_head(writer.write_dir(tiny_model_dir, 1), ttl_s=60)
            limit = 2 * 1024 * 1024
            service = ChunkService(ChunkServerConfig(), chunks, versions, RateLimiter(limit))
            await serve_p2p(a, service)

            source = P2PSource(b, a.peer_id, await a.visible_maddrs(), FetchConfig())
            store = ChunkStore(tmp_path / "b")
            fetcher = PolicyFetcher(FetchConfig(parallel_chunks=3), store)
            connects = []  # p2pd connect requests b makes (the real client's, counted)
            connect = b.p2p._client.connect

            async def counted(*args: object, **kwargs: object) -> None:
                connects.append(args)
                await connect(*args, **kwargs)

            b.p2p._client.connect = counted
            manifest, _ = await fetcher.fetch_manifest(head, [source], trusted=key.public, swarm="p2p")
            loop = asyncio.get_running_loop()
            started = loop.time()
            n = await fetcher.fetch_chunks(manifest, rotating([source]))
            elapsed = loop.time() - started
            assert n == len(manifest.chunk_refs()) > 1
            # The first request connects; the chunks that follow open streams on that connection (CONNECTED_S).
            assert len(connects) <= 3 < n
            for ref in manifest.chunk_refs():
                assert hashlib.sha256(store.get(ref.sha256)).hexdigest() == ref.sha256
            other = manifest.chunk_refs()[0].model_copy(update={"sha256": "e" * 64})
            with pytest.raises(SourceMissing) as missing:
                await source.chunk(other)
            assert not isinstance(missing.value, SourceOffPath)
            # of a version it holds, not in its files: it will never hold it, and says so (off path)
            with pytest.raises(SourceOffPath):
                await source.chunk(other, version=head.version)
            return manifest.total_bytes, elapsed, dict(service.stats)
        finally:
            await b.stop()
            await a.stop()

    total, elapsed, stats = asyncio.run(scenario())
    assert stats["chunks_served"] >= 2 and stats["bytes_served"] >= total
    # The limiter allows one 256 KiB burst; everything beyond it goes at 2 MiB/s.
    assert elapsed >= (total - 256 * 1024) / (2 * 1024 * 1024) * 0.9, (total, elapsed)


def test_garbage_requests_are_refused_and_the_handler_keeps_serving(tmp_path: Path):
    async def scenario() -> list:
        a, b = await _pair("p2pbad")
        outcomes = []
        try:
            await serve_p2p(a, ChunkService(ChunkServerConfig(), ChunkStore(tmp_path), VersionStore(tmp_path)))
            name, maddrs = stream_name("p2pbad", "chunks"), await a.visible_maddrs()
            for request in ({"op": "format-disk"}, {"op": "chunk", "sha256": "../../etc/passwd"},
                            {"op": "manifest", "version": -1}, {"op": "chunk", "sha256": "a" * 64, "wait": "x"}):
                async with open_frames(b.p2p, a.peer_id, maddrs, name, request, 10) as (head, _):
                    outcomes.append(head["status"])
            # A header frame far over the limit: refused from its length alone, nothing more is read.
            _, reader, writer = await b.p2p.call_binary_stream_handler(a.p2p.peer_id, name)
            writer.write((10**9).to_bytes(4, "big"))
            await writer.drain()
            outcomes.append(await asyncio.wait_for(reader.read(), 10))
            writer.close()
            async with open_frames(b.p2p, a.peer_id, maddrs, name, {"op": "chunk", "sha256": "a" * 64}, 10) as (head, _):
                outcomes.append(head["status"])  # still serving
            with pytest.raises(StreamError):
                async with open_frames(b.p2p, b.peer_id, [], stream_name("p2pbad", "nothing"), {}, 5):
                    pass
        finally:
            await b.stop()
            await a.stop()
        return outcomes

    outcomes = asyncio.run(scenario())
    assert outcomes[:4] == [400, 400, 400, 400]
    import msgpack

    refusal = outcomes[4]
    assert msgpack.unpackb(refusal[4:4 + int.from_bytes(refusal[:4], "big")])["status"] == 400
    assert outcomes[5] == 404
