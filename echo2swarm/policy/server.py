"""Chunk serving: signed manifests, broadcast plans and verified chunks, over HTTP or libp2p.

    GET /v1/info                       -> JSON: peer id, role, swarm, versions held, counters
    GET /v1/head                       -> the signed head this peer announces (learner), else 404
    GET /v1/manifest/{version}         -> the signed manifest envelope, byte for byte as the learner made it
    GET /v1/plan/{version}             -> the learner's signed broadcast plan for that version, else 404
    GET /v1/chunk/{sha256}[?wait=S&v=V] -> the chunk's bytes

`ChunkService` is the part both transports share: what may be served, the upload slots and the
upload limit. `ChunkServer` is its HTTP front end; `policy/p2p.py` is the libp2p one.

Only what the store holds is served, and the store only holds verified bytes. A chunk of the
version this peer is still fetching is served as soon as it is verified: with `wait`, the request
is held (at most `chunk_server.wait_s`) until it arrives, which is what pipelines the broadcast.
Requests carry no body, header sizes are aiohttp's bounded defaults, at most `max_connections`
requests are in flight and at most `upload_slots` chunk bodies are streamed at once (chunk bodies
are streamed inside the handler, not handed to sendfile after it returns); the rest get 503 so a
flood cannot starve the daemon. Every chunk byte (and, over libp2p, every manifest and plan
byte) passes the daemon's upload limiter; small JSON answers over HTTP do not.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, BinaryIO

from aiohttp import web

from echo2swarm import __version__
from echo2swarm.config.models import ChunkServerConfig
from echo2swarm.policy.limiter import RateLimiter
from echo2swarm.policy.pipeline import InFlight
from echo2swarm.policy.store import ChunkStore, VersionStore
from echo2swarm.runtime.logging import get_logger

logger = get_logger(__name__)
_HEX64 = re.compile(r"[0-9a-f]{64}")
_VERSION = re.compile(r"[1-9][0-9]{0,12}")  # up to MAX_VERSION = 10**12
WRITE_BLOCK = 256 * 1024


class Busy(Exception):
    """Every upload slot is taken: the requester should try another holder."""


class ChunkService:
    """What this peer can serve, and the pacing of what it uploads. Shared by HTTP and libp2p."""

    def __init__(
        self,
        config: ChunkServerConfig,
        chunks: ChunkStore,
        versions: VersionStore,
        limiter: RateLimiter | None = None,
        inflight: InFlight | None = None,
        plan: Callable[[int], bytes | None] = lambda version: None,
    ):
        self.config = config
        self.chunks = chunks
        self.versions = versions
        self.limiter = limiter or RateLimiter(None)
        self.inflight = inflight
        self.plan = plan
        self.stats: Counter[str] = Counter()
        self._uploads = 0

    def manifest(self, version: int) -> bytes | None:
        data = self.versions.manifest_bytes(version)
        if data is None and self.inflight is not None and self.inflight.version == version:
            data = self.inflight.manifest_bytes  # verified before the fetch began
        if data is not None:
            self.stats["manifests_served"] += 1
        return data

    async def open_chunk(self, sha256: str, wait: float = 0.0, version: int | None = None) -> BinaryIO | None:
        """The stored chunk, opened; waits up to `wait` s if it is being fetched. None: not held."""
        wait = min(max(0.0, wait), self.config.wait_s)
        if not self.chunks.has(sha256) and wait > 0 and self.inflight is not None:
            self.stats["waited"] += 1
            await self.inflight.wait(sha256, wait, newer_than=self.versions.latest(), version=version)
        try:
            return open(self.chunks.path(sha256), "rb")
        except FileNotFoundError:
            return None

    @contextlib.contextmanager
    def upload_slot(self) -> Iterator[None]:
        """Hold one of the `upload_slots` for a transfer; Busy when all are taken."""
        if self._uploads >= self.config.upload_slots:
            self.stats["refused_busy"] += 1
            raise Busy()
        self._uploads += 1
        try:
            yield
        finally:
            self._uploads -= 1

    async def upload(
        self, f: BinaryIO, write: Callable[[bytes], Awaitable[Any]],
        sendfile: Callable[[BinaryIO, int, int], Awaitable[Any]] | None = None,
    ) -> int:
        """Send an opened chunk at the upload limit (call inside `upload_slot`).

        With `sendfile` (HTTP), the kernel copies file to socket block by block: no bytes pass
        through Python, which is most of a relay's CPU when it forwards at full rate.
        """
        sent = 0
        size = os.fstat(f.fileno()).st_size
        try:
            while sent < size:
                n = min(WRITE_BLOCK, size - sent)
                await self.limiter.take(n)
                if sendfile is not None:
                    await sendfile(f, sent, n)
                else:
                    block = f.read(n)
                    if not block:
                        break
                    await write(block)
                sent += n
        finally:
            self.stats["bytes_served"] += sent
        self.stats["chunks_served"] += 1
        return sent


class ChunkServer:
    """Serve a ChunkService over HTTP.

    >>> server = ChunkServer(service, info=lambda: {"peer_id": "12D3..."})
    >>> port = await server.start()        # e.g. 40123
    >>> await server.stop()
    """

    def __init__(
        self,
        service: ChunkService,
        info: Callable[[], dict[str, Any]] = dict,
        head: Callable[[], bytes | None] = lambda: None,
    ):
        self.service = service
        self.config = service.config
        self.info = info
        self.head = head
        self.stats = service.stats
        self._in_flight = 0
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    def _app(self) -> web.Application:
        app = web.Application(client_max_size=1024, middlewares=[self._guard])
        # allow_head=False: a HEAD answered by these handlers would still stream a body.
        app.router.add_get("/v1/info", self._info, allow_head=False)
        app.router.add_get("/v1/head", self._head, allow_head=False)
        app.router.add_get("/v1/manifest/{version}", self._manifest, allow_head=False)
        app.router.add_get("/v1/plan/{version}", self._plan, allow_head=False)
        app.router.add_get("/v1/chunk/{sha256}", self._chunk, allow_head=False)
        return app

    @web.middleware
    async def _guard(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if request.content_length:
            self.stats["refused_body"] += 1
            raise web.HTTPRequestEntityTooLarge(max_size=0, actual_size=request.content_length)
        if self._in_flight >= self.config.max_connections:
            self.stats["refused_busy"] += 1
            raise web.HTTPServiceUnavailable(text="busy")
        self._in_flight += 1
        try:
            return await asyncio.wait_for(handler(request), self.config.request_timeout_s)
        except web.HTTPException as e:
            if e.status >= 400:
                self.stats[f"refused_{e.status}"] += 1
            raise
        finally:
            self._in_flight -= 1

    async def _info(self, request: web.Request) -> web.Response:
        body = {"software": __version__, "versions": self.service.versions.versions(), **self.info()}
        return web.json_response(body)

    async def _head(self, request: web.Request) -> web.Response:
        data = self.head()
        if data is None:
            raise web.HTTPNotFound(text="this peer announces no head")
        return web.Response(body=data, content_type="application/json")

    @staticmethod
    def _version(raw: str) -> int:
        if not _VERSION.fullmatch(raw):
            raise web.HTTPBadRequest(text="version must be a positive integer without leading zeros")
        return int(raw)

    def _signed_json(self, request: web.Request, lookup: Callable[[int], bytes | None], missing: str) -> web.Response:
        """A signed document of one version (manifest or plan), byte for byte as stored, or 404."""
        version = self._version(request.match_info["version"])
        data = lookup(version)
        if data is None:
            raise web.HTTPNotFound(text=missing.format(version=version))
        return web.Response(body=data, content_type="application/json")

    async def _manifest(self, request: web.Request) -> web.Response:
        return self._signed_json(request, self.service.manifest, "version {version} not held")

    async def _plan(self, request: web.Request) -> web.Response:
        return self._signed_json(request, self.service.plan, "no broadcast plan for version {version}")

    async def _chunk(self, request: web.Request) -> web.StreamResponse:
        sha = request.match_info["sha256"]
        if not _HEX64.fullmatch(sha):
            raise web.HTTPBadRequest(text="chunk id must be 64 lowercase hex chars")
        wait, version = 0.0, None
        try:
            if "wait" in request.query:
                wait = float(request.query["wait"])
            if "v" in request.query:
                version = self._version(request.query["v"])
        except ValueError:
            raise web.HTTPBadRequest(text="wait must be seconds, v a version") from None
        f = await self.service.open_chunk(sha, wait, version)
        if f is None:
            raise web.HTTPNotFound(text="chunk not held")
        with f:
            size = os.fstat(f.fileno()).st_size
            try:
                with self.service.upload_slot():
                    response = web.StreamResponse(
                        headers={"Content-Type": "application/octet-stream", "Cache-Control": "immutable"}
                    )
                    response.content_length = size
                    await response.prepare(request)
                    await self.service.upload(f, response.write, sendfile=_sendfile_to(request))
                    await response.write_eof()
            except Busy:
                raise web.HTTPServiceUnavailable(text="upload slots full") from None
        return response

    async def start(self) -> int:
        self._runner = web.AppRunner(self._app(), access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port, backlog=128)
        await site.start()
        server = site._server
        assert server is not None and server.sockets  # type: ignore[union-attr]
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        logger.info("chunk server listening on %s:%d", self.config.host, self.port)
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


def _sendfile_to(request: web.Request) -> Callable[[BinaryIO, int, int], Awaitable[Any]] | None:
    """Zero-copy sends on the request's socket, or None where the loop cannot (then bytes are written)."""
    transport, loop = request.transport, asyncio.get_running_loop()
    if transport is None or not hasattr(os, "sendfile"):
        return None

    async def send(f: BinaryIO, offset: int, count: int) -> None:
        if request.transport is None:
            raise ConnectionResetError("connection lost")
        await loop.sendfile(transport, f, offset, count, fallback=True)

    return send
