"""HTTP chunk server: hands out signed manifests and verified chunks to other peers.

    GET /v1/info                 -> JSON: peer id, role, swarm, versions held, counters
    GET /v1/head                 -> the signed head this peer announces (learner), else 404
    GET /v1/manifest/{version}   -> the signed manifest envelope, byte for byte as the learner made it
    GET /v1/chunk/{sha256}       -> the chunk's bytes

Only what the store holds is served, and the store only holds verified bytes. Requests carry no
body, header sizes are aiohttp's bounded defaults, and at most `max_connections` responses are
in flight, transfers included (chunk bodies are streamed inside the handler, not handed to
sendfile after it returns); the rest get 503 so a flood cannot starve the daemon.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from echo2swarm import __version__
from echo2swarm.config.models import ChunkServerConfig
from echo2swarm.policy.store import ChunkStore, VersionStore
from echo2swarm.runtime.logging import get_logger

logger = get_logger(__name__)
_HEX64 = re.compile(r"[0-9a-f]{64}")
_VERSION = re.compile(r"[1-9][0-9]{0,12}")  # up to MAX_VERSION = 10**12
WRITE_BLOCK = 256 * 1024


class ChunkServer:
    """Serve a ChunkStore and VersionStore over HTTP.

    >>> server = ChunkServer(config, chunks, versions, info=lambda: {"peer_id": "12D3..."})
    >>> url = await server.start()        # e.g. http://127.0.0.1:40123
    >>> await server.stop()
    """

    def __init__(
        self,
        config: ChunkServerConfig,
        chunks: ChunkStore,
        versions: VersionStore,
        info: Callable[[], dict[str, Any]] = dict,
        head: Callable[[], bytes | None] = lambda: None,
    ):
        self.config = config
        self.chunks = chunks
        self.versions = versions
        self.info = info
        self.head = head
        self.stats: Counter[str] = Counter()
        self._in_flight = 0
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    def _app(self) -> web.Application:
        app = web.Application(client_max_size=1024, middlewares=[self._guard])
        # allow_head=False: a HEAD answered by these handlers would still stream a body.
        app.router.add_get("/v1/info", self._info, allow_head=False)
        app.router.add_get("/v1/head", self._head, allow_head=False)
        app.router.add_get("/v1/manifest/{version}", self._manifest, allow_head=False)
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
        body = {"software": __version__, "versions": self.versions.versions(), **self.info()}
        return web.json_response(body)

    async def _head(self, request: web.Request) -> web.Response:
        data = self.head()
        if data is None:
            raise web.HTTPNotFound(text="this peer announces no head")
        return web.Response(body=data, content_type="application/json")

    async def _manifest(self, request: web.Request) -> web.Response:
        raw = request.match_info["version"]
        if not _VERSION.fullmatch(raw):
            raise web.HTTPBadRequest(text="version must be a positive integer without leading zeros")
        data = self.versions.manifest_bytes(int(raw))
        if data is None:
            raise web.HTTPNotFound(text=f"version {raw} not held")
        self.stats["manifests_served"] += 1
        return web.Response(body=data, content_type="application/json")

    async def _chunk(self, request: web.Request) -> web.StreamResponse:
        sha = request.match_info["sha256"]
        if not _HEX64.fullmatch(sha):
            raise web.HTTPBadRequest(text="chunk id must be 64 lowercase hex chars")
        try:
            f = open(self.chunks.path(sha), "rb")
        except FileNotFoundError:
            raise web.HTTPNotFound(text="chunk not held") from None
        with f:
            size = os.fstat(f.fileno()).st_size
            response = web.StreamResponse(headers={"Content-Type": "application/octet-stream", "Cache-Control": "immutable"})
            response.content_length = size
            await response.prepare(request)
            while block := f.read(WRITE_BLOCK):
                await response.write(block)
            await response.write_eof()
        self.stats["chunks_served"] += 1
        self.stats["bytes_served"] += size
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
