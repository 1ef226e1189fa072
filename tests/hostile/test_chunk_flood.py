"""A flood of held chunk requests and connections from one client must not starve a chunk server.

Real sockets on 127.0.0.1: first against a `ChunkServer` with a real store whose follower is
mid-fetch (so requests may legitimately be held), then against a real learner process, the
case seen on a local swarm: held requests for a version nobody published took every request
slot and manifests and /v1/info answered 503 to everyone.

Every client here is 127.0.0.1, so the flood and the honest client are the same client to the
server. The honest client therefore opens its keep-alive connection before the flood, within its
connection share, and asks for what the flood leaves alone: control requests (their own budget)
and a stored chunk (the upload budget; the flood is held requests).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from helpers.swarm import LocalSwarm

from echo2swarm.config.models import ChunkServerConfig
from echo2swarm.learner.versions import VersionWriter
from echo2swarm.policy.manifest import ChunkRef, FileEntry, Manifest
from echo2swarm.policy.pipeline import InFlight
from echo2swarm.policy.server import ChunkServer, ChunkService
from echo2swarm.policy.store import ChunkStore, VersionStore
from echo2swarm.wire.signing import PolicyKey

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]
HOST = "127.0.0.1"
PEER_ID = "12D3KooWDNSVj168KNjs6cqwmWsqdg9DGvdYcN1E7seBqHR5mAL2"
IO_TIMEOUT_S = 5.0


# -- raw HTTP/1.1, so the flood controls its connections exactly ---------------------------------

class Raw:
    """One TCP connection that sends GETs and reads the answers.

    Status None: the server closed or reset the connection; 0: no answer within the timeout (held).
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> "Raw":
        reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port), IO_TIMEOUT_S)
        return cls(reader, writer)

    async def get(self, path: str, timeout: float = IO_TIMEOUT_S) -> tuple[int | None, dict[str, str], bytes]:
        try:
            self.writer.write(f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode())
            await self.writer.drain()
            head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), timeout)
            lines = head.decode("latin-1").split("\r\n")
            headers = {k.strip().lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:] if ":" in x)}
            body = await asyncio.wait_for(self.reader.readexactly(int(headers.get("content-length", "0"))), timeout)
            return int(lines[0].split()[1]), headers, body
        except (asyncio.IncompleteReadError, ConnectionError):
            return None, {}, b""
        except asyncio.TimeoutError:
            return 0, {}, b""

    async def closed_by_server(self, timeout: float) -> bool:
        try:
            return await asyncio.wait_for(self.reader.read(1), timeout) == b""
        except ConnectionError:
            return True

    def close(self) -> None:
        self.writer.close()


async def until(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll an in-process condition (a short yield between looks, bounded by `timeout`)."""
    deadline = time.monotonic() + timeout
    while not (result := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(0.02)  # poll interval of a wait with a deadline
    return result


def _refusals_are_polite(answers: list[tuple[int | None, dict[str, str], bytes]], retry_after: int) -> None:
    for status, headers, _ in answers:
        if status in (429, 503):
            assert headers.get("retry-after") == str(retry_after), headers


# -- a ChunkServer mid-fetch, in this process ----------------------------------------------------

@pytest.fixture
def mid_fetch(tmp_path: Path, tiny_model_dir: Path) -> tuple[ChunkStore, VersionStore, InFlight, bytes]:
    """A store holding v1, and v2 being fetched: its manifest verified, one chunk still missing."""
    root = tmp_path / "peer"
    chunks, versions = ChunkStore(root), VersionStore(root)
    writer = VersionWriter("t", PolicyKey.generate(), chunks, versions, 64 * 1024, PEER_ID)
    writer.write_dir(tiny_model_dir, 1)
    missing = b"the chunk of v2 still on its way" * 64
    sha = hashlib.sha256(missing).hexdigest()
    inflight = InFlight()
    inflight.begin(
        Manifest(swarm="t", version=2, created_ms=1, chunk_size=len(missing),
                 files=[FileEntry(name="model.safetensors", size=len(missing), sha256=sha,
                                  chunks=[ChunkRef(sha256=sha, size=len(missing))])]),
        b'{"manifest": "v2"}', held=set(),
    )
    return chunks, versions, inflight, missing


def test_a_flood_of_held_requests_and_connections_from_one_client(mid_fetch):
    chunks, versions, inflight, missing = mid_fetch
    sha = hashlib.sha256(missing).hexdigest()
    config = ChunkServerConfig(host=HOST, max_connections=64, max_connections_per_client=16, max_waiting=8,
                               max_waiting_per_client=4, upload_slots=16, upload_slots_per_client=4)
    service = ChunkService(config, chunks, versions, inflight=inflight)
    server = ChunkServer(service, info=lambda: {"stats": {"server": dict(service.stats)}})
    stats = service.stats

    async def scenario() -> dict[str, Any]:
        port = await server.start()
        url = f"http://{HOST}:{port}"
        flood: list[Raw] = []
        held: list[asyncio.Task] = []
        connector = aiohttp.TCPConnector(limit=1, keepalive_timeout=60)
        timeout = aiohttp.ClientTimeout(total=IO_TIMEOUT_S)
        try:
            async with aiohttp.ClientSession(connector=connector, timeout=timeout) as honest:
                async def ask(path: str) -> tuple[int, bytes]:
                    async with honest.get(url + path) as resp:
                        return resp.status, await resp.read()

                assert (await ask("/v1/info"))[0] == 200  # its keep-alive connection, opened first

                # 1. Held requests for the chunk in flight, each on its own connection: the client's
                #    share (4) is held, the rest refused at once.
                for _ in range(12):
                    flood.append(await Raw.open(port))
                    held.append(asyncio.create_task(flood[-1].get(f"/v1/chunk/{sha}?wait=15&v=2", timeout=30)))
                await until(lambda: sum(t.done() for t in held) == 8 and stats["open_waiting"] == 4, 10,
                            "4 requests held and 8 refused")
                refused_held = [t.result() for t in held if t.done()]
                held = [t for t in held if not t.done()]

                # 2. Held requests for a version nobody published: answered at once, never held.
                started = time.monotonic()
                unseen = []
                for _ in range(30):
                    raw = await Raw.open(port)
                    unseen.append(await raw.get(f"/v1/chunk/{'e' * 64}?wait=15&v=999"))
                    raw.close()
                unseen_s = time.monotonic() - started

                # 3. Many connections at once: past the client's share (16) each is answered once and
                #    closed; past twice it, closed at accept.
                extra = [await Raw.open(port) for _ in range(40)]
                flood += extra
                await until(lambda: stats["open_connections"] + stats["dropped_connections"] >= 1 + 12 + 40, 10,
                            "the server to accept every connection")
                crowd = await asyncio.gather(*(raw.get(f"/v1/chunk/{sha}?wait=15&v=2") for raw in extra))

                # 4. Meanwhile the honest client gets manifests, /v1/info and a stored chunk.
                during = {path: await ask(path) for path in ("/v1/info", "/v1/manifest/1", "/v1/manifest/2")}
                ref = Manifest.model_validate(json.loads(during["/v1/manifest/1"][1])["manifest"]).chunk_refs()[0]
                status, body = await ask(f"/v1/chunk/{ref.sha256}")
                during["chunk"] = (status, hashlib.sha256(body).hexdigest() == ref.sha256)
                info = json.loads(during["/v1/info"][1])["stats"]["server"]

                # 5. The chunk arrives: the requests held within the client's share get it.
                chunks.put(sha, missing)
                inflight.arrived(sha)
                served = await asyncio.wait_for(asyncio.gather(*held), 10)

                # 6. The flood goes away: the server is back to the honest client's one connection.
                for raw in flood:
                    raw.close()
                await until(lambda: stats["open_connections"] == 1, 10, "flood connections to close")
                after = json.loads((await ask("/v1/info"))[1])["stats"]["server"]
        finally:
            for raw in flood:
                raw.close()
            for task in held:
                task.cancel()
            await server.stop()
        return {"refused_held": refused_held, "unseen": unseen, "unseen_s": unseen_s, "crowd": crowd,
                "during": during, "info": info, "served": served, "after": after}

    seen = asyncio.run(scenario())
    assert [a[0] for a in seen["refused_held"]] == [429] * 8
    assert {a[0] for a in seen["unseen"]} == {404} and seen["unseen_s"] < 10
    crowd_status = [a[0] for a in seen["crowd"]]
    assert set(crowd_status) <= {429, None} and crowd_status.count(429) >= 10 and None in crowd_status
    _refusals_are_polite(seen["refused_held"] + seen["crowd"], config.retry_after_s)
    assert any(a[1].get("connection", "").lower() == "close" for a in seen["crowd"] if a[0] == 429)

    assert seen["during"]["/v1/info"][0] == seen["during"]["/v1/manifest/1"][0] == 200
    assert seen["during"]["/v1/manifest/2"] == (200, b'{"manifest": "v2"}')  # the version in flight
    assert seen["during"]["chunk"] == (200, True)
    assert [(a[0], a[2] == missing) for a in seen["served"]] == [(200, True)] * 4

    info = seen["info"]
    # Connections past the client's share were answered and closed: it keeps at most its 16.
    assert info["open_waiting"] == 4 and 1 + 4 <= info["open_connections"] <= 16
    assert info["refused_waiting_per_client"] >= 8 and info["wait_unseen"] == 30
    assert info["refused_connections_per_client"] >= 1 and info["dropped_connections"] >= 1
    assert info["refused_per_client"] == sum(v for k, v in info.items() if k.endswith("_per_client") and k != "refused_per_client")
    assert info.get("refused_busy", 0) == 0  # one client never fills a server-wide budget
    after = seen["after"]
    assert (after["open_connections"], after["open_waiting"], after["open_uploads"]) == (1, 0, 0)
    assert after["waited"] == 4 and after["chunks_served"] == 5


def test_connections_that_never_finish_a_request_are_closed(mid_fetch):
    chunks, versions, inflight, _ = mid_fetch
    service = ChunkService(ChunkServerConfig(host=HOST, idle_timeout_s=0.5), chunks, versions, inflight=inflight)
    server = ChunkServer(service)

    async def scenario() -> tuple[list[bool], int]:
        port = await server.start()
        slow = [await Raw.open(port) for _ in range(10)]
        try:
            for i, raw in enumerate(slow):
                if i % 2:  # half send part of a request head, half nothing at all
                    raw.writer.write(b"GET /v1/info HTTP/1.1\r\nHost: 127.")
            closed = await asyncio.gather(*(raw.closed_by_server(10) for raw in slow))
            await until(lambda: service.stats["open_connections"] == 0, 10, "slow connections to be forgotten")
            return list(closed), service.stats["open_connections"]
        finally:
            for raw in slow:
                raw.close()
            await server.stop()

    closed, still_open = asyncio.run(scenario())
    assert closed == [True] * 10 and still_open == 0


# -- the case seen on a local swarm: a real learner process --------------------------------------

def test_the_learner_keeps_serving_manifests_through_a_flood_of_held_requests(
    local_swarm: LocalSwarm, tiny_model_dir: Path, policy_key: Path
):
    local_swarm.bootstrap()
    learner = local_swarm.learner(tiny_model_dir, policy_key)
    url = local_swarm.ready(learner)["chunk_url"]
    port = int(url.rsplit(":", 1)[1])
    retry_after = ChunkServerConfig().retry_after_s

    async def scenario() -> dict[str, Any]:
        flood: list[Raw] = []
        connector = aiohttp.TCPConnector(limit=1, keepalive_timeout=60)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=10)) as honest:
            async def ask(path: str) -> tuple[int, bytes]:
                async with honest.get(url + path) as resp:
                    return resp.status, await resp.read()

            async def server_stats() -> dict[str, int]:
                return json.loads((await ask("/v1/info"))[1])["stats"]["server"]

            assert (await ask("/v1/info"))[0] == 200
            try:
                # 70 connections open at once, then each asks to be held for a version nobody published.
                for _ in range(70):
                    flood.append(await Raw.open(port))
                started = time.monotonic()
                answers = await asyncio.gather(*(raw.get(f"/v1/chunk/{'e' * 64}?wait=15&v=999", timeout=10)
                                                 for raw in flood))
                flood_s = time.monotonic() - started
                during = {path: await ask(path) for path in ("/v1/info", "/v1/manifest/1", "/v1/head")}
                ref = Manifest.model_validate(json.loads(during["/v1/manifest/1"][1])["manifest"]).chunk_refs()[0]
                status, body = await ask(f"/v1/chunk/{ref.sha256}")
                during["chunk"] = (status, hashlib.sha256(body).hexdigest() == ref.sha256)
                info = await server_stats()
            finally:
                for raw in flood:
                    raw.close()
            deadline = time.monotonic() + 20
            while (after := await server_stats())["open_connections"] > 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)  # the learner is another process: poll its counters, bounded
        return {"answers": answers, "flood_s": flood_s, "during": during, "info": info, "after": after}

    seen = asyncio.run(scenario())
    statuses = [a[0] for a in seen["answers"]]
    # Never held: each flood request is answered (404, or 429 past the connection share) or dropped
    # at accept, all well before the 15 s it asked to wait.
    assert set(statuses) <= {404, 429, None} and statuses.count(404) >= 1 and statuses.count(429) >= 1
    assert seen["flood_s"] < 10
    _refusals_are_polite(seen["answers"], retry_after)
    assert {path: r[0] for path, r in seen["during"].items() if path != "chunk"} == \
        {"/v1/info": 200, "/v1/manifest/1": 200, "/v1/head": 200}
    assert seen["during"]["chunk"] == (200, True)
    info = seen["info"]
    assert info["wait_unseen"] >= statuses.count(404) and info.get("waited", 0) == 0
    assert info["refused_connections_per_client"] >= statuses.count(429)
    assert seen["after"]["open_connections"] == 1, seen["after"]
    assert learner.running()
