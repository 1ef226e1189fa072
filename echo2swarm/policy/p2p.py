"""Chunks over libp2p streams: the fallback transport for peers reachable only through the overlay.

Same service as the HTTP server (what may be served, budgets, upload limit), another front
end: `serve_p2p` answers `manifest`, `plan` and `chunk` requests on the daemon's p2pd, and
`P2PSource` is the fetcher's side. A peer behind NAT that runs without a chunk server
(`--no-chunk-server`) is still a full member of the broadcast this way.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import OrderedDict

from echo2swarm.config.models import FetchConfig
from echo2swarm.overlay.node import Overlay
from echo2swarm.wire.records import MAX_VERSION
from echo2swarm.overlay.streams import FrameWriter, Handler, StreamError, open_frames, serve_frames, stream_name
from echo2swarm.policy.sources import Progress, SourceBusy, SourceError, SourceMissing, SourceOffPath, SourceUnreachable
from echo2swarm.policy.manifest import ChunkRef
from echo2swarm.policy.budgets import Refused
from echo2swarm.policy.server import ChunkService

_HEX64 = re.compile(r"[0-9a-f]{64}")
CONNECTED_S = 10.0  # a stream to a peer opened this recently: its next one is opened without connecting first


def _version(request: dict[str, object]) -> int:
    version = request.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= MAX_VERSION:
        raise StreamError("version must be an integer in 1..1e12")
    return version


MAX_CLIENTS_TRACKED = 64


class ServedTo:
    """Chunk bytes served over libp2p per client peer (the newest MAX_CLIENTS_TRACKED), for /v1/info."""

    def __init__(self) -> None:
        self.bytes: OrderedDict[str, int] = OrderedDict()

    def add(self, peer: str, size: int) -> None:
        self.bytes[peer] = self.bytes.get(peer, 0) + size
        self.bytes.move_to_end(peer)
        while len(self.bytes) > MAX_CLIENTS_TRACKED:
            self.bytes.popitem(last=False)


def p2p_handler(service: ChunkService, served_to: ServedTo | None = None) -> Handler:
    """The libp2p front end of `service`: one request per stream, answered with a header frame (and body).

    Clients are told apart by the peer id libp2p authenticated (`peer:<id>`). A request holds one
    unit of the `streams` budget while it is answered, a manifest or plan one of `control`, a held
    chunk request one of `waiting`, a chunk body one of `uploads`. A full budget is answered with
    a 429 (the peer's share) or 503 (the whole server's) header whose `error` ends in
    "retry after N s", and counted like HTTP's refusals and in `p2p_refused`.
    """

    async def answer(request: dict[str, object], client: str, out: FrameWriter) -> None:
        op = request.get("op")
        if op in ("manifest", "plan"):
            version = _version(request)
            with service.hold(service.control, client):
                data = service.manifest(version) if op == "manifest" else service.plan(version)
                if data is None:
                    await out.header(404, error=f"no {op} for version {version}")
                    return
                await out.header(200, len(data))
                await service.limiter.take(len(data))
                await out.write(data)
        elif op == "chunk":
            sha = request.get("sha256")
            wait = request.get("wait", 0.0)
            if not isinstance(sha, str) or not _HEX64.fullmatch(sha):
                raise StreamError("sha256 must be 64 lowercase hex chars")
            if not isinstance(wait, (int, float)) or isinstance(wait, bool):
                raise StreamError("wait must be seconds")
            version = _version(request) if request.get("version") is not None else None
            f = await service.open_chunk(sha, float(wait), version, client)
            if f is None:
                if service.off_path(sha, version):
                    await out.header(404, error="chunk not on this peer's path of the version", off_path=True)
                else:
                    await out.header(404, error="chunk not held")
                return
            with f:
                with service.upload_slot(client):
                    size = f.seek(0, 2)
                    f.seek(0)
                    await service.upload(f, out.write, header=lambda: out.header(200, size),
                                         peer=client.removeprefix("peer:"))
                    if served_to is not None:
                        served_to.add(client.removeprefix("peer:"), size)
        else:
            raise StreamError(f"unknown op {str(op)[:20]!r}")

    async def handle(request: dict[str, object], peer: str, out: FrameWriter) -> None:
        client = f"peer:{peer}"
        try:
            with service.hold(service.streams, client):
                await answer(request, client, out)
        except Refused as refusal:  # always before a header: every budget is taken before answering
            service.stats["p2p_refused"] += 1
            await out.header(refusal.status, error=f"{refusal.text}; retry after {service.config.retry_after_s} s")

    return handle


async def serve_p2p(overlay: Overlay, service: ChunkService) -> ServedTo:
    served_to = ServedTo()
    await serve_frames(overlay.p2p, stream_name(overlay.config.swarm, "chunks"), p2p_handler(service, served_to),
                       service.config.request_timeout_s)
    return served_to


class P2PSource:
    """A peer's chunks over a libp2p stream, addressed by peer id (and its card's multiaddrs)."""

    def __init__(self, overlay: Overlay, peer_id: str, maddrs: list[str], config: FetchConfig, name: str | None = None):
        self.overlay = overlay
        self.peer_id = peer_id
        self.maddrs = maddrs
        self.config = config
        self.name = name or f"p2p:{peer_id[-8:]}"
        self._protocol = stream_name(overlay.config.swarm, "chunks")
        self._opened_at = float("-inf")  # when a stream to this peer last opened

    async def _get(self, request: dict[str, object], max_bytes: int, timeout: float, wait: float = 0.0,
                   progress: Progress | None = None) -> bytes:
        # A stream opened less than CONNECTED_S ago: the connection is up, so skip p2pd's connect (a
        # control request and the addresses' parsing, per chunk); if the stream does not open, connect.
        if time.monotonic() - self._opened_at < CONNECTED_S:
            try:
                return await self._request(request, max_bytes, timeout, wait, dial=False, progress=progress)
            except SourceUnreachable:
                self._opened_at = float("-inf")
        return await self._request(request, max_bytes, timeout, wait, dial=True, progress=progress)

    async def _request(self, request: dict[str, object], max_bytes: int, timeout: float, wait: float,
                       dial: bool, progress: Progress | None = None) -> bytes:
        connect_timeout = min(timeout, self.overlay.config.dht_timeout_s + wait)
        try:
            # The newest card's addresses: a peer behind NAT gains its /p2p-circuit address after it joined.
            maddrs = (self.overlay.known_maddrs(self.peer_id) or self.maddrs) if dial else []
            async with open_frames(self.overlay.p2p, self.peer_id, maddrs, self._protocol, request,
                                   connect_timeout) as (head, body):
                self._opened_at = time.monotonic()
                status, size = head["status"], head["size"]
                if status in (429, 503):  # refused for now: this peer's share, or the server, is full
                    raise SourceBusy(f"{self.name}: busy ({status}): {str(head.get('error', ''))[:100]}")
                if status == 404:
                    missing = SourceOffPath if head.get("off_path") is True else SourceMissing
                    raise missing(f"{self.name}: {str(head.get('error', 'not held'))[:100]}")
                if status != 200:
                    raise SourceError(f"{self.name}: status {status}: {str(head.get('error', ''))[:100]}")
                if size > max_bytes:
                    raise SourceError(f"{self.name}: {size} bytes exceeds the {max_bytes} limit")
                if progress is not None:
                    progress.begin()
                buf = bytearray()
                while len(buf) < size:
                    piece = await asyncio.wait_for(body.read(min(1 << 16, size - len(buf))), self.config.stall_timeout_s)
                    if not piece:
                        raise SourceError(f"{self.name}: stream ended after {len(buf)} of {size} bytes")
                    buf += piece
                    if progress is not None:
                        progress.received += len(piece)
                return bytes(buf)
        except StreamError as e:
            raise SourceUnreachable(str(e)) from None
        except asyncio.TimeoutError:
            raise SourceError(f"{self.name}: stalled for {self.config.stall_timeout_s:.0f} s") from None
        except (ConnectionError, OSError) as e:
            raise SourceError(f"{self.name}: {type(e).__name__}: {e}") from None

    async def manifest(self, version: int, max_bytes: int, progress: Progress | None = None) -> bytes:
        return await self._get({"op": "manifest", "version": version}, max_bytes, self.config.manifest_timeout_s,
                               progress=progress)

    async def plan(self, version: int, max_bytes: int) -> bytes:
        return await self._get({"op": "plan", "version": version}, max_bytes, self.config.manifest_timeout_s)

    async def chunk(self, ref: ChunkRef, wait: float = 0.0, version: int | None = None,
                    progress: Progress | None = None) -> bytes:
        request: dict[str, object] = {"op": "chunk", "sha256": ref.sha256}
        if version is not None:  # the version the chunk is of: a holder on another path of it says so
            request.update(wait=float(wait), version=version)
        data = await self._get(request, min(ref.size, self.config.max_chunk_bytes), self.config.chunk_timeout_s, wait,
                               progress)
        if len(data) != ref.size:
            raise SourceError(f"{self.name}: chunk {ref.sha256[:12]} is {len(data)} bytes, expected {ref.size}")
        return data
