"""The fetcher against real HTTP servers on 127.0.0.1: an honest chunk server and lying ones."""

from __future__ import annotations

import asyncio
import hashlib
import shutil
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from echo2swarm.config.models import ChunkServerConfig, FetchConfig
from echo2swarm.learner.versions import VersionWriter
from echo2swarm.policy.fetcher import FetchError, PolicyFetcher
from echo2swarm.policy.sources import HttpSource, SourceMissing, SourceOffPath, rotating
from echo2swarm.policy.manifest import ChunkRef, ManifestError
from echo2swarm.policy.server import ChunkServer, ChunkService
from echo2swarm.wire.signing import PolicyKey
from echo2swarm.policy.store import ChunkStore, VersionStore

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(60)]
PEER_ID = "12D3KooWDNSVj168KNjs6cqwmWsqdg9DGvdYcN1E7seBqHR5mAL2"
CHUNK = 64 * 1024


class Liar:
    """A chunk server that serves the honest manifest but tampers with chunks, or sends too much."""

    def __init__(self, honest: ChunkStore, versions: VersionStore, mode: str):
        self.honest, self.versions, self.mode = honest, versions, mode
        self.runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/v1/manifest/{version}", self._manifest)
        app.router.add_get("/v1/chunk/{sha256}", self._chunk)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    async def _manifest(self, request: web.Request) -> web.Response:
        data = self.versions.manifest_bytes(int(request.match_info["version"]))
        if self.mode == "manifest":
            at = data.index(b'"created_ms":') + len(b'"created_ms":')
            data = data[:at] + (b"2" if data[at:at + 1] != b"2" else b"3") + data[at + 1:]  # same size, still JSON
        return web.Response(body=data)

    async def _chunk(self, request: web.Request) -> web.Response:
        data = bytearray(self.honest.get(request.match_info["sha256"]))
        if self.mode == "flip":
            data[len(data) // 2] ^= 0xFF
        elif self.mode == "oversize":
            data += b"\0" * 1024
        return web.Response(body=bytes(data))

    async def stop(self) -> None:
        if self.runner:
            await self.runner.cleanup()


@pytest.fixture
def published(tmp_path: Path, tiny_model_dir: Path):
    root = tmp_path / "learner"
    key = PolicyKey.generate()
    chunks, versions = ChunkStore(root), VersionStore(root)
    writer = VersionWriter("t", key, chunks, versions, CHUNK, PEER_ID)
    head = writer.sign_head(writer.write_dir(tiny_model_dir, 1), ttl_s=60)
    return key, chunks, versions, head


async def _fetch(tmp_path: Path, published, liar_modes: list[str], with_honest: bool = True):
    key, chunks, versions, head = published
    honest = ChunkServer(ChunkService(ChunkServerConfig(host="127.0.0.1"), chunks, versions))
    await honest.start()
    liars = [Liar(chunks, versions, m) for m in liar_modes]
    urls = [await liar.start() for liar in liars]
    store = ChunkStore(tmp_path / "follower")
    fetcher = PolicyFetcher(FetchConfig(parallel_chunks=3, attempts_per_chunk=4), store)
    try:
        async with aiohttp.ClientSession() as session:
            sources = [HttpSource(session, u, fetcher.config, name=f"liar{i}") for i, u in enumerate(urls)]
            if with_honest:
                sources.append(HttpSource(session, f"http://127.0.0.1:{honest.port}", fetcher.config, name="honest"))
            try:
                manifest, _ = await fetcher.fetch_manifest(head, sources, trusted=key.public, swarm="t")
                await fetcher.fetch_chunks(manifest, rotating(sources))
                return fetcher, store, manifest, None
            except (FetchError, ManifestError) as e:
                return fetcher, store, None, e
    finally:
        await honest.stop()
        for liar in liars:
            await liar.stop()


def _stored_chunks_are_all_genuine(store: ChunkStore) -> int:
    files = [p for p in store.root.rglob("*") if p.is_file()]
    for p in files:
        assert hashlib.sha256(p.read_bytes()).hexdigest() == p.name
    return len(files)


def test_flipped_bytes_are_refused_the_liar_banned_and_chunks_fetched_elsewhere(tmp_path: Path, published):
    fetcher, store, manifest, error = asyncio.run(_fetch(tmp_path, published, ["flip"]))
    assert error is None
    # The first bad chunk bans the liar; only requests already in flight can still come back bad.
    assert 1 <= fetcher.stats["bad_chunk"] <= fetcher.config.parallel_chunks
    assert all(store.has(ref.sha256) for ref in manifest.chunk_refs())
    assert _stored_chunks_are_all_genuine(store) == len(manifest.chunk_refs())


def test_only_liars_means_no_version_and_nothing_stored(tmp_path: Path, published):
    fetcher, store, _, error = asyncio.run(_fetch(tmp_path, published, ["flip", "oversize"], with_honest=False))
    assert isinstance(error, FetchError)
    assert fetcher.stats["bad_chunk"] >= 1 and fetcher.stats["source_error"] >= 1
    assert _stored_chunks_are_all_genuine(store) == 0


def test_oversized_chunk_responses_are_cut_off(tmp_path: Path, published):
    fetcher, store, manifest, error = asyncio.run(_fetch(tmp_path, published, ["oversize"]))
    assert error is None and fetcher.stats["source_error"] >= 1
    assert _stored_chunks_are_all_genuine(store) == len(manifest.chunk_refs())


def test_a_tampered_manifest_is_refused_and_the_next_source_used(tmp_path: Path, published):
    fetcher, store, manifest, error = asyncio.run(_fetch(tmp_path, published, ["manifest"]))
    assert error is None and manifest is not None
    assert fetcher.stats["manifest_hash_mismatch"] == 1


def test_served_chunks_are_the_verified_bytes(tmp_path: Path, published):
    """What a follower fetched, it can serve onward: the bytes a third peer gets hash to their names."""

    async def scenario() -> int:
        _, store, manifest, _ = await _fetch(tmp_path, published, [])
        versions = VersionStore(tmp_path / "follower")
        server = ChunkServer(ChunkService(ChunkServerConfig(host="127.0.0.1"), store, versions))
        await server.start()
        try:
            async with aiohttp.ClientSession() as session:
                for ref in manifest.chunk_refs():
                    async with session.get(f"http://127.0.0.1:{server.port}/v1/chunk/{ref.sha256}") as resp:
                        assert resp.status == 200
                        assert hashlib.sha256(await resp.read()).hexdigest() == ref.sha256
            return len(manifest.chunk_refs())
        finally:
            await server.stop()

    assert asyncio.run(scenario()) > 1


def test_a_holder_serves_chunks_of_files_it_rebuilt_and_says_off_path_for_the_rest(tmp_path: Path, published):
    """A follower that installed a version through a delta holds its dense files but not their chunks:
    asked for one, it copies the chunk from the files (hashed first) and serves it; a chunk of that
    version its files do not hold is answered "off path" (it will never hold it), where a version it
    neither holds nor fetches gets a plain "not held". A file changed on disk serves nothing."""
    _, _, versions, head = published
    manifest = versions.manifest(head.version)
    holder = tmp_path / "holder"
    shutil.copytree(versions.dir(head.version), VersionStore(holder).dir(head.version))
    shutil.copy(versions.manifest_path(head.version), VersionStore(holder).manifest_path(head.version))
    chunks = ChunkStore(holder)  # empty: the files are all it has
    refs = manifest.chunk_refs()
    weights = VersionStore(holder).dir(head.version) / "model.safetensors"
    first = next(f for f in manifest.files if f.name == "model.safetensors").chunks[0]  # at offset 0
    data = bytearray(weights.read_bytes())
    data[10] ^= 0xFF  # the safetensors header of the first weights chunk, changed on disk
    weights.write_bytes(bytes(data))

    async def scenario() -> tuple[dict[str, object], ChunkService]:
        service = ChunkService(ChunkServerConfig(host="127.0.0.1"), chunks, VersionStore(holder))
        server = ChunkServer(service)
        await server.start()
        answers: dict[str, object] = {}
        try:
            async with aiohttp.ClientSession() as session:
                source = HttpSource(session, f"http://127.0.0.1:{server.port}", FetchConfig(), name="relay:holder")
                for ref in refs:
                    try:
                        body = await source.chunk(ref, version=head.version)
                        answers[ref.sha256] = hashlib.sha256(body).hexdigest() == ref.sha256
                    except SourceMissing as e:
                        answers[ref.sha256] = type(e)
                other = ChunkRef(sha256="ab" * 32, size=10)  # a delta's chunk, say: not in its files
                for version in (head.version, head.version + 1, None):
                    try:
                        await source.chunk(other, version=version)
                    except SourceMissing as e:
                        answers[f"other v{version}"] = type(e)
            return answers, service
        finally:
            await server.stop()

    answers, service = asyncio.run(scenario())
    assert answers.pop(first.sha256) is SourceOffPath  # its bytes on disk no longer hash to its name
    assert answers.pop(f"other v{head.version}") is SourceOffPath
    assert answers.pop(f"other v{head.version + 1}") is SourceMissing and answers.pop("other vNone") is SourceMissing
    assert answers == {ref.sha256: True for ref in refs if ref.sha256 != first.sha256}
    assert service.stats["chunks_from_files"] == len(refs) - 1
    assert _stored_chunks_are_all_genuine(chunks) == len(refs) - 1
