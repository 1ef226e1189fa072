"""Chunk serving: signed manifests, broadcast plans and verified chunks, over HTTP or libp2p.

    GET /v1/info                       -> JSON: peer id, role, swarm, versions held, counters
    GET /v1/head[?after=V&wait=S]      -> the signed head this peer announces (learner), else 404; with
                                          `after` and `wait`, held until it is newer than V (long-poll)
    GET /v1/manifest/{version}         -> the signed manifest envelope, byte for byte as the learner made it
    GET /v1/plan/{version}             -> the learner's signed broadcast plan for that version, else 404
    GET /v1/chunk/{sha256}[?wait=S&v=V] -> the chunk's bytes
    GET <extra routes>                 -> what the daemon adds (`routes=`): /metrics, the live page

With `chunks=False` (a bootstrap daemon, or `--no-chunk-server`) only /v1/info and the extra
routes are served: the daemon's own HTTP server for its operator, which serves the swarm nothing.

`ChunkService` is the part both transports share: what may be served, the budgets, the upload
limit. `ChunkServer` is its HTTP front end; `policy/p2p.py` is the libp2p one.

A follower long-polls the learner's head (`HeadWatch`): the request is held (at most
`chunk_server.wait_s`, in the `waiting` budget) until a head newer than `after` is published and its
broadcast plan served (the version store wakes the watch on install), else answered at the end of
the wait with the current head; the follower verifies it like a head read from the DHT.

Only what the store holds is served, and the store only holds verified bytes. A chunk of the
version this peer is still fetching is served as soon as it is verified: with `wait`, the request
is held (at most `chunk_server.wait_s`) until it arrives, which is what pipelines the broadcast.
Only the version whose signed manifest this peer verified is waited for; a wait for any other
version is answered at once.

A flood must not starve the daemon, so capacity is split into budgets (`Budget`), each capped for
all clients together and per client (IP address over HTTP, peer id over libp2p):

    connections  open HTTP connections; libp2p: requests being answered ("streams")
    control      manifests, plans, /v1/head, /v1/info: a reserve chunk traffic cannot take
    waiting      chunk requests held for a chunk of the version in flight, and head long-polls
    uploads      chunk bodies being streamed (after any wait: a held request holds no upload slot)

Past a per-client cap the answer is 429, past a global cap 503, both with `Retry-After`, counted
in `stats` by reason. Chunk bodies are streamed inside the handler, within their budget and
`request_timeout_s`, every byte through the upload limiter; the header goes out with the first block
(followers time a body from its header: policy/hedge.py). Limits and timeouts: docs/protocol.md §6.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

from aiohttp import web

from echo2swarm import __version__
from echo2swarm.config.models import ChunkServerConfig
from echo2swarm.policy.budgets import Budget, Refused
from echo2swarm.policy.limiter import RateLimiter
from echo2swarm.policy.pipeline import InFlight
from echo2swarm.policy.store import ChunkStore, VersionStore
from echo2swarm.policy.uplink import UplinkMeter
from echo2swarm.runtime.logging import get_logger

logger = get_logger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_HEX64 = re.compile(r"[0-9a-f]{64}")
_VERSION = re.compile(r"[1-9][0-9]{0,12}")  # up to MAX_VERSION = 10**12
WRITE_BLOCK = 256 * 1024
HEAD_RECHECK_S = 0.02  # after a version is installed: seconds between reads of the head until the new one is out
HEAD_SETTLE_S = 2.0  # ... for at most this long; then waiters get whatever head there is (no plan, say)


class HeadWatch:
    """Long-polls of the head: `wait_newer(after, timeout)` returns once a head newer than `after` is
    out and `ready` (its broadcast plan is served, so followers find their parents at once).

    `wake(version)` (from any thread: the version store calls it when it installs a version) marks
    that version as coming; while anyone waits, one task reads the head every HEAD_RECHECK_S until a
    ready head of that version (or newer) is out, for at most HEAD_SETTLE_S after the wake (then it
    takes whatever newer head there is, plan or not), releasing the waiters as each newer head comes
    out. Otherwise the head is read once when a request comes and once when it is answered.

    >>> watch = HeadWatch(head=lambda: signed_head_json, ready=lambda v: plan(v) is not None)
    >>> data = await watch.wait_newer(after=6, timeout=10.0)   # v7's head, or the current one at timeout
    """

    def __init__(self, head: Callable[[], bytes | None], ready: Callable[[int], bool] = lambda version: True):
        self.head = head
        self.ready = ready
        self.version = 0  # the newest ready head's version seen
        self.waiters = 0
        self._coming = 0  # the newest version installed (woken for), whose head may not be out yet
        self._woken_at = float("-inf")
        self._changed: asyncio.Condition | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._settling: asyncio.Task[None] | None = None

    def _current(self) -> tuple[int, bytes | None]:
        data = self.head()
        if data is None:
            return 0, None
        try:
            version = json.loads(data)["version"]
        except (ValueError, KeyError, TypeError):
            return 0, data
        return (version if isinstance(version, int) else 0), data

    def bind(self) -> None:
        """Attach to the running loop (the server's): `wake` is then safe from any thread."""
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Condition()

    def wake(self, version: int) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._woke, version)
        except RuntimeError:  # the loop closed meanwhile
            pass

    def _woke(self, version: int) -> None:
        self._coming = max(self._coming, version)
        self._woken_at = time.monotonic()
        self._settle()

    def _settle(self) -> None:
        """Watch the head while anyone waits and an installed version's head is not out yet."""
        pending = self.version < self._coming and time.monotonic() < self._woken_at + HEAD_SETTLE_S
        if self.waiters and pending and (self._settling is None or self._settling.done()):
            self._settling = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while self.waiters and self.version < self._coming:
            version, _ = self._current()
            settled = time.monotonic() >= self._woken_at + HEAD_SETTLE_S
            if version > self.version and (settled or self.ready(version)):
                await self._publish(version)
            elif settled:
                return
            await asyncio.sleep(HEAD_RECHECK_S)

    async def _publish(self, version: int) -> None:
        self.version = max(self.version, version)
        assert self._changed is not None
        async with self._changed:
            self._changed.notify_all()

    async def wait_newer(self, after: int, timeout: float) -> bytes | None:
        """The head once its version is above `after` (at once if it is already), else the current
        head after `timeout` s (None: this peer announces none)."""
        version, data = self._current()
        if version > after or self._changed is None or timeout <= 0:
            return data
        if version > self.version and self.ready(version):
            self.version = version  # out and ready already (nobody waited when it came)
        changed = self._changed
        self.waiters += 1
        try:
            self._settle()  # a version installed just now whose head is not out yet
            async with changed:
                await asyncio.wait_for(changed.wait_for(lambda: self.version > after), timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            self.waiters -= 1
        return self._current()[1]

    async def close(self) -> None:
        if self._settling is not None:
            self._settling.cancel()
            await asyncio.gather(self._settling, return_exceptions=True)


class ChunkService:
    """What this peer can serve, its budgets, and the pacing of what it uploads. Shared by HTTP and libp2p."""

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
        c, stats = config, self.stats
        self.connections = Budget("connections", c.max_connections, c.max_connections_per_client, stats)
        self.streams = Budget("streams", c.max_connections, c.max_connections_per_client, stats)
        self.control = Budget("control", c.control_slots, c.control_slots_per_client, stats)
        self.waiting = Budget("waiting", c.max_waiting, c.max_waiting_per_client, stats)
        self.uploads = Budget("uploads", c.upload_slots, c.upload_slots_per_client, stats)
        self.uplink = UplinkMeter()  # what our uploads sustain: goes into the card and the plans

    def count(self, refusal: Refused) -> None:
        """Count a refusal answered: by reason, and in `refused_busy` (503) or `refused_per_client` (429)."""
        self.stats[f"refused_{refusal.reason}"] += 1
        self.stats["refused_per_client" if refusal.status == 429 else "refused_busy"] += 1

    @contextlib.contextmanager
    def hold(self, budget: Budget, client: str | None) -> Iterator[None]:
        """One unit of `budget` for `client` for the block; raises the counted refusal if it is full."""
        refusal = budget.acquire(client)
        if refusal is not None:
            self.count(refusal)
            raise refusal
        try:
            yield
        finally:
            budget.release(client)

    def manifest(self, version: int) -> bytes | None:
        data = self.versions.manifest_bytes(version)
        if data is None and self.inflight is not None and self.inflight.version == version:
            data = self.inflight.manifest_bytes  # verified before the fetch began
        if data is not None:
            self.stats["manifests_served"] += 1
        return data

    def _may_wait(self, sha256: str, version: int | None) -> bool:
        """Whether a request may be held for `sha256`: only for the signed version in flight."""
        inflight = self.inflight
        assert inflight is not None
        if version is not None and not inflight.signed(version) and not self.versions.installed(version):
            # Named by the requester only: this peer has not seen it signed. Answer now, and if the
            # requester has seen a newer head than ours, have our follower look (rate-limited).
            self.stats["wait_unseen"] += 1
            if version > max(inflight.version or 0, self.versions.latest() or 0):
                inflight.nudge()
            return False
        return inflight.expects(sha256)

    async def open_chunk(
        self, sha256: str, wait: float = 0.0, version: int | None = None, client: str | None = None
    ) -> BinaryIO | None:
        """The stored chunk, opened; None: not held.

        With `wait` > 0, a chunk of the version this peer is fetching (and whose manifest it
        verified) is waited for up to `wait` s, holding one `waiting` unit of `client`: raises the
        refusal (TooMany, Busy) when that budget is full.
        """
        wait = min(max(0.0, wait), self.config.wait_s)
        if not self.chunks.has(sha256) and wait > 0 and self.inflight is not None and self._may_wait(sha256, version):
            with self.hold(self.waiting, client):
                self.stats["waited"] += 1
                await self.inflight.wait(sha256, wait)
        try:
            return open(self.chunks.path(sha256), "rb")
        except FileNotFoundError:
            return None

    def upload_slot(self, client: str | None = None) -> contextlib.AbstractContextManager[None]:
        """Hold one of the `upload_slots` (and of the client's share) for a transfer: Busy or TooMany when full."""
        return self.hold(self.uploads, client)

    async def upload(
        self, f: BinaryIO, write: Callable[[bytes], Awaitable[Any]],
        sendfile: Callable[[BinaryIO, int, int], Awaitable[Any]] | None = None,
        header: Callable[[], Awaitable[Any]] | None = None,
    ) -> int:
        """Send an opened chunk at the upload limit (call inside `upload_slot`), after `header` (the
        response's header), which goes out once the first block has its turn at the limiter.

        With `sendfile` (HTTP), the kernel copies file to socket block by block: no bytes pass
        through Python, which is most of a relay's CPU when it forwards at full rate.
        """
        sent = 0
        size = os.fstat(f.fileno()).st_size
        try:
            with self.uplink.transfer():
                while sent < size:
                    n = min(WRITE_BLOCK, size - sent)
                    await self.limiter.take(n)
                    if header is not None:
                        await header()
                        header = None
                    if sendfile is not None:
                        await sendfile(f, sent, n)
                    else:
                        block = f.read(n)
                        if not block:
                            break
                        await write(block)
                    sent += n
                    self.uplink.sent(n)
            if header is not None:  # an empty chunk
                await header()
        finally:
            self.stats["bytes_served"] += sent
        self.stats["chunks_served"] += 1
        return sent


@dataclass
class _Connection:
    client: str
    refusal: Refused | None  # past a connection cap: answered once, then closed
    dropped: bool = False  # past twice a cap: closed at accept, never answered


class ChunkServer:
    """Serve a ChunkService over HTTP.

    >>> server = ChunkServer(service, info=lambda: {"peer_id": "12D3..."})
    >>> port = await server.start()        # e.g. 40123
    >>> await server.stop()

    Clients are told apart by IP address (`ip:<address>`). Every open connection is tracked from
    accept to close (`open_connections` in the stats): within the `connections` budget it serves
    any number of requests; past a cap it is answered once (chunk requests with the refusal, other
    requests from the control budget) and closed; past twice a cap it is closed at accept
    (`dropped_connections`).
    """

    def __init__(
        self,
        service: ChunkService,
        info: Callable[[], dict[str, Any]] = dict,
        head: Callable[[], bytes | None] = lambda: None,
        routes: Sequence[tuple[str, Handler]] = (),
        chunks: bool = True,
    ):
        self.service = service
        self.routes = tuple(routes)  # extra GET routes (path, handler), answered from the control budget
        self.chunks = chunks  # False: /v1/info and the extra routes only (bootstrap, --no-chunk-server)
        self.config = service.config
        self.info = info
        self.head = head
        # long-polls of the head: woken when the store installs a version (the learner's publishes)
        self.head_watch = HeadWatch(head, ready=lambda version: service.plan(version) is not None)
        self.stats = service.stats
        self._connections: dict[object, _Connection] = {}  # aiohttp's RequestHandler -> its client and standing
        self._per_client: Counter[str] = Counter()  # open connections by client, budget or not
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    def _app(self) -> web.Application:
        app = web.Application(client_max_size=1024, middlewares=[self._guard])
        # allow_head=False: a HEAD answered by these handlers would still stream a body.
        app.router.add_get("/v1/info", self._info, allow_head=False)
        if self.chunks:
            app.router.add_get("/v1/head", self._head, allow_head=False, name="head")
            app.router.add_get("/v1/manifest/{version}", self._manifest, allow_head=False)
            app.router.add_get("/v1/plan/{version}", self._plan, allow_head=False)
            app.router.add_get("/v1/chunk/{sha256}", self._chunk, allow_head=False, name="chunk")
        for path, handler in self.routes:
            app.router.add_get(path, handler, allow_head=False)
        return app

    # -- connections ---------------------------------------------------------------------------
    def _connection_made(self, handler: object, transport: asyncio.Transport) -> None:
        peer = transport.get_extra_info("peername")
        client = f"ip:{peer[0]}" if isinstance(peer, tuple) and peer else "ip:?"
        self._per_client[client] += 1
        budget = self.service.connections
        if len(self._connections) >= 2 * budget.total or self._per_client[client] > 2 * budget.per_client:
            self._connections[handler] = _Connection(client, None, dropped=True)
            self.stats["dropped_connections"] += 1
            transport.abort()  # aiohttp still reports the loss, which forgets it
        else:
            self._connections[handler] = _Connection(client, budget.acquire(client))
        self.stats["open_connections"] = len(self._connections)

    def _connection_lost(self, handler: object) -> None:
        conn = self._connections.pop(handler, None)
        if conn is None:
            return
        self._per_client[conn.client] -= 1
        if self._per_client[conn.client] <= 0:
            del self._per_client[conn.client]
        if conn.refusal is None and not conn.dropped:
            self.service.connections.release(conn.client)
        self.stats["open_connections"] = len(self._connections)

    # -- requests ------------------------------------------------------------------------------
    def _client(self, request: web.Request) -> str:
        conn = self._connections.get(request.protocol)
        return conn.client if conn is not None else "ip:?"

    def _refusal(self, refusal: Refused, close: bool) -> web.Response:
        response = web.Response(status=refusal.status, text=refusal.text,
                                headers={"Retry-After": str(self.config.retry_after_s)})
        if close:
            response.force_close()
        return response

    @web.middleware
    async def _guard(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if request.content_length:
            self.stats["refused_body"] += 1
            raise web.HTTPRequestEntityTooLarge(max_size=0, actual_size=request.content_length)
        conn = self._connections.get(request.protocol)
        client = self._client(request)
        past_cap = conn.refusal if conn is not None else None
        # a head long-poll is held like a chunk request, outside the control reserve (HeadWatch)
        chunk = request.match_info.route.name == "chunk" or (request.match_info.route.name == "head"
                                                             and "wait" in request.query)
        try:
            if chunk and past_cap is not None:
                self.service.count(past_cap)
                return self._refusal(past_cap, close=True)
            if chunk:
                return await asyncio.wait_for(handler(request), self.config.request_timeout_s)
            with self.service.hold(self.service.control, client):
                return await asyncio.wait_for(self._answer(request, handler, past_cap is not None),
                                              self.config.request_timeout_s)
        except Refused as refusal:
            return self._refusal(refusal, close=past_cap is not None)
        except web.HTTPException as e:
            if e.status >= 400:
                self.stats[f"refused_{e.status}"] += 1
            if past_cap is not None:
                e.force_close()
            raise

    @staticmethod
    async def _answer(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
                      close: bool) -> web.StreamResponse:
        """A control answer, written whole inside its budget and timeout (a slow reader holds the slot, not more)."""
        response = await handler(request)
        if close:
            response.force_close()
        await response.prepare(request)
        await response.write_eof()
        return response

    async def _info(self, request: web.Request) -> web.Response:
        body = {"software": __version__, "versions": self.service.versions.versions(), **self.info()}
        return web.json_response(body)

    async def _head(self, request: web.Request) -> web.Response:
        if "wait" in request.query:
            try:
                wait = float(request.query["wait"])
                raw_after = request.query.get("after", "0")
                after = 0 if raw_after == "0" else self._version(raw_after)
            except ValueError:
                raise web.HTTPBadRequest(text="wait must be seconds, after a version (0: none)") from None
            if not math.isfinite(wait):
                raise web.HTTPBadRequest(text="wait must be a finite number of seconds")
            wait = min(max(0.0, wait), self.config.wait_s)
            with self.service.hold(self.service.waiting, self._client(request)):  # Refused: answered by _guard
                self.stats["head_waited"] += 1
                data = await self.head_watch.wait_newer(after, wait)
        else:
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
        client = self._client(request)
        f = await self.service.open_chunk(sha, wait, version, client)  # Refused: answered by _guard
        if f is None:
            raise web.HTTPNotFound(text="chunk not held")
        with f:
            size = os.fstat(f.fileno()).st_size
            with self.service.upload_slot(client):
                response = web.StreamResponse(
                    headers={"Content-Type": "application/octet-stream", "Cache-Control": "immutable"}
                )
                response.content_length = size
                await self.service.upload(f, response.write, sendfile=_sendfile_to(request),
                                          header=lambda: response.prepare(request))
                await response.write_eof()
        return response

    async def start(self) -> int:
        self._runner = web.AppRunner(self._app(), access_log=None, handler_cancellation=True,
                                     keepalive_timeout=self.config.idle_timeout_s)
        await self._runner.setup()
        self.head_watch.bind()
        self.service.versions.listeners.append(self.head_watch.wake)
        server = self._runner.server
        assert server is not None
        # aiohttp's Server hears of every connection its handlers accept and lose; so do we.
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler: Any, transport: asyncio.Transport) -> None:
            made(handler, transport)
            self._connection_made(handler, transport)

        def connection_lost(handler: Any, exc: BaseException | None = None) -> None:
            lost(handler, exc)
            self._connection_lost(handler)

        server.connection_made = connection_made  # type: ignore[method-assign]
        server.connection_lost = connection_lost  # type: ignore[method-assign]
        site = web.TCPSite(self._runner, self.config.host, self.config.port, backlog=128)
        await site.start()
        listener = site._server
        assert listener is not None and listener.sockets  # type: ignore[union-attr]
        self.port = listener.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        logger.info("chunk server listening on %s:%d", self.config.host, self.port)
        return self.port

    async def stop(self) -> None:
        with contextlib.suppress(ValueError):
            self.service.versions.listeners.remove(self.head_watch.wake)
        await self.head_watch.close()
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
