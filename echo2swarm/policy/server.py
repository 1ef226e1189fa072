"""Chunk serving: signed manifests, broadcast plans and verified chunks, over HTTP or libp2p.

    GET /v1/info                       -> JSON: peer id, role, swarm, versions held, counters
    GET /v1/head[?after=V&wait=S]      -> the signed head this peer announces (learner), else 404; with
                                          `after` and `wait`, held until it is newer than V (long-poll)
    GET /v1/manifest/{version}         -> the signed manifest envelope, byte for byte as the learner made it
    GET /v1/plan/{version}             -> the learner's signed broadcast plan for that version, else 404
    GET /v1/chunk/{sha256}[?wait=S&v=V] -> the chunk's bytes
    GET <extra routes>                 -> what the daemon adds (`routes=`): /metrics, the live page

With `chunks=False` (bootstrap, `--no-chunk-server`) only /v1/info and the extra routes are served.
`ChunkService` is what both transports share (what may be served, budgets, upload limit);
`ChunkServer` is its HTTP front end, `policy/p2p.py` the libp2p one.

A follower long-polls the learner's head (policy/head_watch.py).

Only what the store holds is served, and it holds only verified bytes. A chunk of the version this
peer is still fetching is served as soon as it is verified: with `wait`, the request is held (at
most `chunk_server.wait_s`) until it arrives, which pipelines the broadcast. Only the version whose
signed manifest this peer verified is waited for; a wait for any other is answered at once.

A flood must not starve the daemon, so capacity is split into budgets (`Budget`), each capped for
all clients together and per client (IP address over HTTP, peer id over libp2p):

    connections  open HTTP connections; libp2p: requests being answered ("streams")
    control      manifests, plans, /v1/head, /v1/info: a reserve chunk traffic cannot take
    waiting      chunk requests held for a chunk of the version in flight, and head long-polls
    uploads      chunk bodies being streamed (after any wait: a held request holds no upload slot)

`waiting`, `connections` and `streams` keep a reserve only peers seen working (policy/working.py)
may take; everyone else together, however many addresses or identities, gets the rest. A working
peer is known by its requests' credential over HTTP (policy/peer_auth.py), its peer id over libp2p.

Past a per-client cap the answer is 429, past a global cap 503, both with `Retry-After`, counted
in `stats` by reason. Chunk bodies are streamed inside the handler, within their budget and
`request_timeout_s`, every byte through the upload limiter; the header goes out with the first block
(followers time a body from its header: policy/hedge.py). Limits and timeouts: docs/protocol.md §6.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

from aiohttp import web

from echo2swarm import __version__
from echo2swarm.config.models import ChunkServerConfig
from echo2swarm.policy.budgets import Budget, Refused
from echo2swarm.policy.head_watch import HeadWatch
from echo2swarm.policy.limiter import RateLimiter
from echo2swarm.policy.peer_auth import HEADER, CredentialCheck, CredentialRefused
from echo2swarm.policy.pipeline import InFlight
from echo2swarm.policy.sources import OFF_PATH_HEADER
from echo2swarm.policy.store import ChunkStore, VersionStore
from echo2swarm.policy.uplink import UplinkMeter
from echo2swarm.policy.working import WorkingPeers
from echo2swarm.runtime.logging import get_logger

logger = get_logger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_HEX64 = re.compile(r"[0-9a-f]{64}")
_VERSION = re.compile(r"[1-9][0-9]{0,12}")  # up to MAX_VERSION = 10**12
WRITE_BLOCK = 256 * 1024
WHOLE_RECHECK_S = 2.0  # how stale the size of "a whole version" (the newest held) may be
MAX_PACED_CLIENTS = 4096  # clients whose last refusal time is remembered (for pacing repeated refusals)
CLIENT = web.RequestKey("e2s_client", str)  # a request's client, where its credential named a working peer
SIGNED_BY = web.RequestKey("e2s_peer", str)  # the peer id whose checked credential a request carries


class ChunkService:
    """What this peer can serve, its budgets, and the pacing of what it uploads. Shared by HTTP and libp2p.

    Clients named `peer:<id>` are authenticated (libp2p, or an HTTP request whose credential checked
    out, policy/peer_auth.py); those in `working` (policy/working.py: seen in `work`, counts of
    checked work per peer id, or fetching whole versions here) may take the reserves of the
    `waiting`, `connections` and `streams` budgets. `peer_id` is ours: without it (tests) no HTTP
    credential is checked.
    """

    def __init__(
        self,
        config: ChunkServerConfig,
        chunks: ChunkStore,
        versions: VersionStore,
        limiter: RateLimiter | None = None,
        inflight: InFlight | None = None,
        plan: Callable[[int], bytes | None] = lambda version: None,
        peer_id: str | None = None,
        work: Sequence[Callable[[], Mapping[str, int]]] = (),
    ):
        self.config = config
        self.chunks = chunks
        self.versions = versions
        self.limiter = limiter or RateLimiter(None)
        self.inflight = inflight
        self.plan = plan
        self.stats: Counter[str] = Counter()
        c, stats = config, self.stats
        self.working = WorkingPeers(c.working_ttl_s, stats)
        for counts in work:  # checked work per peer id (the learner's accepted groups)
            self.working.watch(counts)
        self.credentials = CredentialCheck(peer_id, c.auth_window_s, stats) if peer_id else None
        self.connections = Budget("connections", c.max_connections, c.max_connections_per_client, stats,
                                  reserve=c.connection_reserve)
        self.streams = Budget("streams", c.max_connections, c.max_connections_per_client, stats,
                              reserve=c.connection_reserve)
        self.control = Budget("control", c.control_slots, c.control_slots_per_client, stats)
        self.waiting = Budget("waiting", c.max_waiting, c.max_waiting_per_client, stats, reserve=c.held_reserve)
        self.uploads = Budget("uploads", c.upload_slots, c.upload_slots_per_client, stats)
        self.uplink = UplinkMeter()  # what our uploads sustain: goes into the card and the plans
        self._whole: tuple[float, int | None, int] = (float("-inf"), None, 0)  # (looked at, newest version, bytes)

    def is_working(self, client: str | None) -> bool:
        """Whether `client` is an authenticated peer seen working (may take the reserves)."""
        return client is not None and client.startswith("peer:") and client[5:] in self.working

    def whole_version_bytes(self) -> int:
        """The chunk bytes of the newest version held, its default path (what 'fetched a whole version'
        means); 0: none held. The store is looked at every WHOLE_RECHECK_S at most."""
        looked, version, size = self._whole
        if time.monotonic() - looked >= WHOLE_RECHECK_S:
            latest = self.versions.latest()
            if latest != version:
                manifest = self.versions.manifest(latest) if latest is not None else None
                size = sum(ref.size for ref in manifest.chunk_refs()) if manifest is not None else 0
            self._whole = (time.monotonic(), latest, size)
        return size

    def count(self, refusal: Refused) -> None:
        """Count a refusal answered: by reason, and in `refused_busy` (503) or `refused_per_client` (429)."""
        self.stats[f"refused_{refusal.reason}"] += 1
        self.stats["refused_per_client" if refusal.status == 429 else "refused_busy"] += 1

    @contextlib.contextmanager
    def hold(self, budget: Budget, client: str | None) -> Iterator[None]:
        """One unit of `budget` for `client` for the block (from the reserve too if `client` is working);
        raises the counted refusal if it is full."""
        working = self.is_working(client)
        refusal = budget.acquire(client, working)
        if refusal is not None:
            self.count(refusal)
            raise refusal
        try:
            yield
        finally:
            budget.release(client, working)

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
        # A chunk of a path this peer did not fetch, whose bytes its installed files hold (the dense weights
        # it rebuilt from a delta): copied from them, checked against its hash, and served like any other.
        if not self.chunks.has(sha256) and self.versions.chunk_places(sha256) \
                and await asyncio.to_thread(self.versions.copy_chunk, sha256, self.chunks):
            self.stats["chunks_from_files"] += 1
        try:
            return open(self.chunks.path(sha256), "rb")
        except FileNotFoundError:
            return None

    def off_path(self, sha256: str, version: int | None) -> bool:
        """Whether this peer, not holding `sha256`, holds or is fetching `version` by a path without it (a
        delta where the request is for the dense files, or the reverse): it will not hold that chunk, and
        says so (a 404 "off path"), so a child goes to another source at once instead of asking again."""
        if version is None or self.chunks.has(sha256):
            return False
        inflight = self.inflight
        if inflight is not None and inflight.expects(sha256):
            return False
        if inflight is not None and inflight.signed(version):
            return True
        return self.versions.installed(version)

    def upload_slot(self, client: str | None = None) -> contextlib.AbstractContextManager[None]:
        """Hold one of the `upload_slots` (and of the client's share) for a transfer: Busy or TooMany when full."""
        return self.hold(self.uploads, client)

    async def upload(
        self, f: BinaryIO, write: Callable[[bytes], Awaitable[Any]],
        sendfile: Callable[[BinaryIO, int, int], Awaitable[Any]] | None = None, peer: str | None = None,
        header: Callable[[], Awaitable[Any]] | None = None,
    ) -> int:
        """Send an opened chunk at the upload limit (call inside `upload_slot`), after `header` (the
        response's header), which goes out once the first block has its turn at the limiter.

        With `sendfile` (HTTP), the kernel copies file to socket block by block: no bytes pass
        through Python, which is most of a relay's CPU when it forwards at full rate. `peer`: the
        authenticated peer id it goes to (its bytes count towards being seen working).
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
            if peer is not None and sent:
                self.working.fetched(peer, sent, self.whole_version_bytes())
        self.stats["chunks_served"] += 1
        return sent


@dataclass
class _Connection:
    client: str  # ip:<address>
    refusal: Refused | None  # past a connection cap: answered once, then closed (unless a working peer's)
    dropped: bool = False  # past twice a cap: never read or answered
    unit: str | None = None  # the client its connection unit is held for: `client`, or peer:<id> once promoted
    working: bool = False  # that unit is a working peer's (it may be from the reserve)


class ChunkServer:
    """Serve a ChunkService over HTTP.

    >>> server = ChunkServer(service, info=lambda: {"peer_id": "12D3..."})
    >>> port = await server.start()        # e.g. 40123
    >>> await server.stop()

    Clients are told apart by IP address (`ip:<address>`), except a request whose credential
    (`X-E2S-Peer`, policy/peer_auth.py) proves it comes from a peer seen working (`peer:<id>`): that
    client's held requests may take the `waiting` reserve. Credentials are checked only where they
    matter: on held requests and on the first request of a connection past its cap when the peer
    named is working, and on chunk requests (the bytes count towards a whole version fetched). A
    forged or replayed one is answered 401.

    Every open connection is tracked from accept to close (`open_connections` in the stats): within
    the `connections` budget (less its reserve, for anyone not seen working) it serves any number
    of requests. Past a cap, its first request is answered once (chunk and held requests with the
    refusal, other requests from the control budget) and it is closed, unless that request carries
    a working peer's credential and the reserve has room: then the connection is the peer's
    (`promoted_connections`). Past twice a cap it is dropped (`dropped_connections`): never read,
    and closed after `retry_after_s` (at once past another `max_connections` of those).

    A client refused again (a held request, a chunk request past a connection cap, a credential)
    within `retry_after_s` of its last such refusal gets the answer only when that time is up
    (`paced_refusals`): the wait it was told to keep, kept for it, so ignoring Retry-After does not
    turn refusals into a busy loop.
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
        self._per_client: Counter[str] = Counter()  # open connections by client, budget or not (not dropped ones)
        self._refused_at: OrderedDict[str, float] = OrderedDict()  # client -> its last unpaced refusal (monotonic)
        self._dropped = 0  # dropped connections not closed yet (held unread, or aborted and not yet reported lost)
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
        budget = self.service.connections
        live = len(self._connections) - self._dropped
        if live >= 2 * budget.total or self._per_client[client] >= 2 * budget.per_client:
            # Dropped: counted against nobody, never read, closed after retry_after_s (one closed at once is
            # back at once, in a loop that costs us an accept each time); past max_connections of them, at once.
            self._connections[handler] = _Connection(client, None, dropped=True)
            self.stats["dropped_connections"] += 1
            self._dropped += 1
            if self._dropped <= budget.total:
                transport.pause_reading()
                asyncio.get_running_loop().call_later(self.config.retry_after_s, transport.abort)
            else:
                transport.abort()  # aiohttp still reports the loss, which forgets it
        else:
            self._per_client[client] += 1
            self._connections[handler] = _Connection(client, budget.acquire(client), unit=client)
        self.stats["open_connections"] = len(self._connections)

    def _connection_lost(self, handler: object) -> None:
        conn = self._connections.pop(handler, None)
        if conn is None:
            return
        if conn.dropped:
            self._dropped -= 1
        else:
            self._per_client[conn.client] -= 1
            if self._per_client[conn.client] <= 0:
                del self._per_client[conn.client]
            if conn.refusal is None:
                self.service.connections.release(conn.unit or conn.client, conn.working)
        self.stats["open_connections"] = len(self._connections)

    def _promote(self, conn: _Connection, peer: str) -> None:
        """A connection past its cap whose first request proved a working peer: take a unit (from the
        reserve if need be) for that peer; if even that is full, it stays past its cap."""
        unit = f"peer:{peer}"
        if self.service.connections.acquire(unit, working=True) is None:
            conn.refusal, conn.unit, conn.working = None, unit, True
            self.stats["promoted_connections"] += 1

    # -- requests ------------------------------------------------------------------------------
    def _client(self, request: web.Request) -> str:
        """Who the budgets count this request against: peer:<id> for a working peer's signed request, else its IP."""
        client = request.get(CLIENT)
        if client is not None:
            return client
        conn = self._connections.get(request.protocol)
        return conn.client if conn is not None else "ip:?"

    def _signed_by(self, request: web.Request, any_peer: bool) -> str | None:
        """The peer id whose credential this request carries, checked (None: none, stale or malformed; or,
        unless `any_peer`, a peer not seen working, whose credential is then not worth checking).
        Raises CredentialRefused (forged, replayed)."""
        check = self.service.credentials
        header = request.headers.get(HEADER)
        if check is None or not header:
            return None
        if not any_peer and check.claimed(header) not in self.service.working:
            return None
        return check.verify(header, request.path)

    def _identify(self, request: web.Request, conn: _Connection | None, chunk: bool) -> None:
        """Where a credential matters (chunk and held requests, a connection past its cap), check it: a
        working peer's request then counts against its peer id, and a connection past its cap becomes
        that peer's if there is room. Raises CredentialRefused."""
        past_cap = conn is not None and conn.refusal is not None
        if not (chunk or past_cap):
            return
        peer = self._signed_by(request, any_peer=request.match_info.route.name == "chunk")
        if peer is None:
            return
        request[SIGNED_BY] = peer
        if peer in self.service.working:
            if past_cap:
                assert conn is not None
                self._promote(conn, peer)
            request[CLIENT] = f"peer:{peer}"

    def _refusal(self, refusal: Refused, close: bool) -> web.Response:
        response = web.Response(status=refusal.status, text=refusal.text,
                                headers={"Retry-After": str(self.config.retry_after_s)})
        if close:
            response.force_close()
        return response

    async def _paced(self, client: str) -> None:
        """Return once `client` may be refused again: at once if its last refusal was `retry_after_s` ago or
        more, else when that time is up (counted in `paced_refusals`)."""
        now, last = time.monotonic(), self._refused_at.get(client)
        if last is not None and now - last < self.config.retry_after_s:
            self.stats["paced_refusals"] += 1
            await asyncio.sleep(last + self.config.retry_after_s - now)
            return
        self._refused_at[client] = now
        self._refused_at.move_to_end(client)
        while len(self._refused_at) > MAX_PACED_CLIENTS:
            self._refused_at.popitem(last=False)

    @web.middleware
    async def _guard(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if request.content_length:
            self.stats["refused_body"] += 1
            raise web.HTTPRequestEntityTooLarge(max_size=0, actual_size=request.content_length)
        conn = self._connections.get(request.protocol)
        route = request.match_info.route.name
        # a head long-poll is held like a chunk request, outside the control reserve (HeadWatch)
        chunk = route == "chunk" or (route == "head" and "wait" in request.query)
        try:
            self._identify(request, conn, chunk)
        except CredentialRefused as e:
            self.stats[f"refused_auth_{e.reason}"] += 1
            await self._paced(self._client(request))  # no honest client sends one: a loop would cost us checks
            response = web.Response(status=401, text=f"credential refused: {e}")
            if conn is not None and conn.refusal is not None:
                response.force_close()
            return response
        client = self._client(request)
        past_cap = conn.refusal if conn is not None else None
        try:
            if chunk and past_cap is not None:
                self.service.count(past_cap)
                await self._paced(client)
                return self._refusal(past_cap, close=True)
            if chunk:
                return await asyncio.wait_for(handler(request), self.config.request_timeout_s)
            with self.service.hold(self.service.control, client):
                return await asyncio.wait_for(self._answer(request, handler, past_cap is not None),
                                              self.config.request_timeout_s)
        except Refused as refusal:
            if refusal.budget.startswith("waiting"):  # a held request refused (not a full upload slot)
                await self._paced(client)
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
            if self.service.off_path(sha, version):
                raise web.HTTPNotFound(text="chunk not on this peer's path of the version", headers={OFF_PATH_HEADER: "1"})
            raise web.HTTPNotFound(text="chunk not held")
        with f:
            size = os.fstat(f.fileno()).st_size
            with self.service.upload_slot(client):
                response = web.StreamResponse(
                    headers={"Content-Type": "application/octet-stream", "Cache-Control": "immutable"}
                )
                response.content_length = size
                await self.service.upload(f, response.write, sendfile=_sendfile_to(request),
                                          header=lambda: response.prepare(request), peer=request.get(SIGNED_BY))
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
