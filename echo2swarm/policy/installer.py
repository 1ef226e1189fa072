"""Installing a version by the cheapest path: walk back the hash links, choose, fetch, rebuild, check, install.

    PolicyFollower.step ─► VersionInstaller.catch_up(target)
        _walk_back: target, then the manifests its deltas name (local, else holders, else the learner)
        catchup.choose_path ─► hops ─► _install_hop each: fetch the hop's chunks (PolicyFetcher, routes
        from the follower), rebuild (catchup.rebuild) or check the dense weights, then install
    a refused hop: counted (`refused["delta_<reason>"]`), its chunks dropped, planned again without it

The pure parts (path choice, rebuild and tensor checks) are in policy/catchup.py; the follower owns
heads, sources and routes (`Links`).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from echo2swarm.policy.catchup import MAX_CHAIN, BaseOrders, DeltaRefused, Hop, Linked, check_dense, choose_path, rebuild
from echo2swarm.policy.fetcher import FetchError, PolicyFetcher
from echo2swarm.policy.manifest import BaseRef, ChunkRef, DeltaFile, FileEntry, Manifest, ManifestError, sha256_hex
from echo2swarm.policy.pipeline import InFlight
from echo2swarm.policy.sources import ChunkSource
from echo2swarm.policy.store import ChunkStore, VersionStore
from echo2swarm.runtime.logging import get_logger
from echo2swarm.wire.records import HeadRecord
from echo2swarm.wire.signing import PublicKey

if TYPE_CHECKING:
    from echo2swarm.policy.orders import Moved, TensorOrder

logger = get_logger(__name__)
MAX_PLANS = 3  # plans of one version's path, each without the deltas refused before


@dataclass
class Links:
    """What the installer needs from the follower: who holds a version, a chunk's route, whom to trust."""

    holders: Callable[[int], list[ChunkSource]]
    route: Callable[[HeadRecord, ChunkSource, int, ChunkRef, int, bool], list[tuple[ChunkSource, float]]]
    trusted: Callable[[], PublicKey]
    swarm: str
    peer_assist: bool


class VersionInstaller:
    """One per follower. `paths` counts installs by path; `path_of` keeps, for the last 16 versions,
    {"path", "bytes" fetched over every hop, "hops"}; `refused` is the follower's refusal counter."""

    def __init__(self, fetcher: PolicyFetcher, chunks: ChunkStore, versions: VersionStore, inflight: InFlight,
                 refused: Counter[str], links: Links):
        self.fetcher = fetcher
        self.chunks = chunks
        self.versions = versions
        self.inflight = inflight
        self.refused = refused
        self.links = links
        self.paths: Counter[str] = Counter()
        self.last_path: str | None = None
        self.path_of: dict[int, dict[str, object]] = {}
        self._refused_versions: set[tuple[int, str]] = set()  # (version, manifest sha256) whose rebuild failed
        # the held version's visiting orders, computed at idle priority for the next delta (catchup.BaseOrders)
        self.orders = BaseOrders(fetcher.config.delta_order_items)

    def refused_before(self, version: int, manifest_sha256: str) -> bool:
        """Whether this exact manifest was refused (its weights matched no path): not fetched again."""
        return (version, manifest_sha256) in self._refused_versions

    def held(self) -> dict[int, str]:
        """Installed versions -> their manifest envelope's sha256 (what delta links name)."""
        out = {}
        for v in self.versions.versions():
            data = self.versions.manifest_bytes(v)
            if data is not None:
                out[v] = sha256_hex(data)
        return out

    async def _linked(self, ref: BaseRef, head: HeadRecord, publisher: ChunkSource) -> Linked:
        data = self.versions.manifest_bytes(ref.version)
        if data is not None and sha256_hex(data) == ref.manifest_sha256:
            manifest = self.versions.manifest(ref.version)
            assert manifest is not None
            return Linked(manifest, data)
        sources = [s for s in self.links.holders(ref.version) if s.peer_id != head.publisher] + [publisher]
        manifest, data = await self.fetcher.fetch_linked_manifest(
            ref, sources if self.links.peer_assist else [publisher], trusted=self.links.trusted(), swarm=self.links.swarm,
            publisher=publisher.name)
        return Linked(manifest, data)

    @staticmethod
    def _link_back(manifest: Manifest, held: dict[int, str]) -> DeltaFile | None:
        """The link to walk back along: the primary delta; past a keyframe only when we hold an older
        version (its delta from the version before it may then beat the dense weights)."""
        if manifest.delta is not None:
            return manifest.delta
        if held and min(held) < manifest.version:
            return next((d for d in manifest.alternatives if d.base.version == manifest.version - 1), None)
        return None

    async def _walk_back(self, head: HeadRecord, publisher: ChunkSource, target: Linked) -> list[Linked]:
        """The target, then the manifests its primary deltas name, back to one we hold or a keyframe."""
        chain, held = [target], self.held()
        while (delta := self._link_back(chain[-1].manifest, held)) is not None and len(chain) < MAX_CHAIN:
            if held.get(delta.base.version) == delta.base.manifest_sha256:
                break
            try:
                chain.append(await self._linked(delta.base, head, publisher))
            except (FetchError, ManifestError) as e:  # that link is gone: plan with what we have
                logger.info("v%d: base manifest v%d unavailable (%s)", chain[-1].manifest.version, delta.base.version, e)
                break
        return chain

    async def catch_up(self, head: HeadRecord, publisher: ChunkSource, target: Linked,
                       spans: Counter[str] | None = None) -> Path | None:
        """Install the target version by the cheapest path; a refused delta is excluded and we plan
        again (at most 3 times). None: the version is refused (nothing installed, nothing announced)."""
        bad: set[tuple[int, int, str]] = set()
        before = self.fetcher.stats["bytes_fetched"]
        spans = Counter() if spans is None else spans
        for _ in range(3):
            planned = time.perf_counter()
            chain = await self._walk_back(head, publisher, target)
            choice = choose_path(chain, self.held(), bad)
            spans["path"] += time.perf_counter() - planned
            if choice is None:
                if bad:
                    break
                raise FetchError(f"v{target.manifest.version}: no path from the versions held "
                                 "(the chain's manifests are gone and no keyframe was reached)")
            hops, label = choice
            try:
                path = self.versions.dir(target.manifest.version)
                for hop in hops:
                    path = await self._install_hop(head, publisher, hop, spans)
            except DeltaRefused as e:
                self.refused[f"delta_{e.reason}"] += 1
                logger.warning("refused policy v%d rebuilt via %s (%s): %s; planning without it", hop.linked.manifest.version,
                               "a delta" if hop.delta else "its dense files", e.reason, e)
                if hop.delta is None:
                    break
                bad.add((hop.linked.manifest.version, hop.delta.base.version, hop.delta.file.sha256))
                continue
            version = target.manifest.version
            self.last_path = label
            self.paths[label] += 1
            self.path_of[version] = {"path": label, "bytes": self.fetcher.stats["bytes_fetched"] - before,
                                     "hops": len(hops), "spans": {k: round(v, 3) for k, v in spans.items()}}
            for old in sorted(self.path_of)[:-16]:
                del self.path_of[old]
            return path
        self._refused_versions.add((target.manifest.version, target.sha256))
        logger.warning("policy v%d refused: no path rebuilds weights that match its signed tensor hashes",
                       target.manifest.version)
        return None

    async def _install_hop(self, head: HeadRecord, publisher: ChunkSource, hop: Hop, spans: Counter[str]) -> Path:
        """Fetch one hop's chunks, rebuild and check its weights, then install it (a rename). Adds the
        seconds its parts took to `spans`: chunks (fetched), check (rebuilt or dense-checked), commit."""
        started = time.perf_counter()
        m, envelope, delta = hop.linked.manifest, hop.linked.envelope, hop.delta
        if self.versions.installed(m.version):  # another learner's v (a different manifest): replaced
            self.versions.remove(m.version)
        files = m.path_files(delta)
        refs = m.chunk_refs(files)
        # The plan's chains hold for any path of the head version: peers that hold the version before it
        # take the same one (its delta from there, most of them), and a parent on another path says so
        # (a 404 "off path") and is gone around at once.
        planned = m.version == head.version
        self.inflight.begin(m, envelope, {r.sha256 for r in refs if self.chunks.has(r.sha256)}, refs)
        try:
            assembly = await asyncio.to_thread(self.versions.begin, m, files)
            try:
                await self.fetcher.fetch_chunks(
                    m, lambda i, ref: self.links.route(head, publisher, i, ref, m.version, planned),
                    on_chunk=self.inflight.arrived, sink=assembly, publisher=publisher.name, refs=refs,
                )
                await asyncio.to_thread(assembly.fill, self.chunks)
                fetched = time.perf_counter()
                spans["chunks"] += fetched - started
                orders: dict[str, TensorOrder] | None = None  # the base's visiting orders, if held
                moved: dict[str, list[Moved]] = {}  # what advancing them into this version's takes
                try:
                    if delta is not None:
                        base = self.versions.manifest(delta.base.version)
                        if base is None:
                            raise DeltaRefused("wrong_base", f"v{m.version}: base v{delta.base.version} is no longer held")
                        blob = (assembly.tmp / delta.file.name).read_bytes()
                        (assembly.tmp / delta.file.name).unlink()  # the version directory is a plain model dir
                        # written in place in the version being assembled (checked before the rename installs it)
                        out = assembly.path(m.weights_file or "model.safetensors")
                        orders = self.orders.take(delta.base.version, delta.base.manifest_sha256)
                        spans["sorted_ahead"] += bool(orders)  # hops with at least one tensor's order ahead
                        await asyncio.to_thread(rebuild, m, delta, self.versions.dir(delta.base.version), base, blob,
                                                out, orders, moved)
                    else:
                        await asyncio.to_thread(check_dense, m, assembly.tmp)
                except DeltaRefused:
                    await asyncio.to_thread(self._drop, files)
                    raise
                checked = time.perf_counter()
                spans["check"] += checked - fetched
                path = await asyncio.to_thread(self.versions.commit, assembly, envelope, self.chunks)
                spans["commit"] += time.perf_counter() - checked
                if m.weights_file is not None:  # the next delta's base, most likely: its orders, in the background
                    self.orders.follow(m.version, hop.linked.sha256, m, path / m.weights_file, orders, moved)
                return path
            except BaseException:
                assembly.abort()  # not awaited: it must run even when this task is being cancelled
                raise
        finally:
            self.inflight.end()

    def _drop(self, files: list[FileEntry]) -> None:
        """Remove a refused hop's chunks from the store (unless an installed version uses them): never served onward."""
        keep: set[str] = set()
        for v in self.versions.versions():
            manifest = self.versions.manifest(v)
            if manifest is not None:
                keep.update(r.sha256 for r in manifest.all_chunk_refs())
        for f in files:
            for ref in f.chunks:
                if ref.sha256 not in keep:
                    self.chunks.discard(ref.sha256)
