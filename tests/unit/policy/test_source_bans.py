"""Sources that stall are dropped: the minimum transfer rate, and bans with back-off across versions.

The rate rule and the ban bookkeeping are pure logic (fake clocks, fake sources); the HTTP checks
run against a small aiohttp server on 127.0.0.1 in this process, each within a second or two.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import Counter
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from pydantic import ValidationError

from echo2swarm.config.models import FetchConfig
from echo2swarm.policy.fetcher import FetchError, PolicyFetcher, SourceBans
from echo2swarm.policy.sources import (
    HttpSource,
    MinRate,
    SourceError,
    SourceOversized,
    SourceSlow,
    SourceStalled,
    SourceTruncated,
    read_body,
)
from echo2swarm.policy.manifest import ChunkRef, FileEntry, Manifest
from echo2swarm.policy.store import ChunkStore
from helpers.sources import FakeSource


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- the minimum rate ---------------------------------------------------------------------------

def test_config_takes_rates_as_byte_sizes_and_refuses_a_ban_cap_below_the_ban():
    assert FetchConfig().min_rate_bps == 8 * 1024 and FetchConfig().min_rate_grace_s == 10.0
    assert FetchConfig(min_rate_bps="16KiB/s").min_rate_bps == 16 * 1024
    assert FetchConfig(min_rate_bps=0).min_rate_bps == 0  # no minimum
    # Honest peers capped well below the slowest limit the swarm tests use (256 KiB/s) pass with
    # all 16 upload slots busy.
    assert 16 * FetchConfig().min_rate_bps <= 256 * 1024 // 2
    with pytest.raises(ValidationError, match="ban_max_s"):
        FetchConfig(ban_s=100, ban_max_s=50)


def test_the_next_bytes_are_due_by_the_grace_plus_what_the_rate_allows_for_what_came():
    rule = MinRate(rate_bps=1000, grace_s=5.0, started=100.0)
    assert rule.deadline(0) == 105.0  # nothing at all: cut when the grace ends
    assert rule.deadline(2000) == 107.0  # 2000 bytes buy 2 s more
    assert MinRate(rate_bps=0, grace_s=5.0, started=100.0).deadline(0) is None  # no minimum


def _pieces(schedule: list[tuple[float, bytes]]):
    """A readany() that returns each piece after its delay, then b"" (the end)."""
    items = list(schedule)

    async def readany() -> bytes:
        if not items:
            return b""
        delay, piece = items.pop(0)
        await asyncio.sleep(delay)  # the scripted pace of the body under test, not a wait for a condition
        return piece

    return readany


def test_a_dripping_body_is_cut_at_the_grace_and_a_bursty_one_at_the_rate_passes():
    async def scenario() -> tuple[float, str, bytes]:
        drip = _pieces([(0.05, b"x")] + [(0.3, b"x")] * 50)
        started = time.monotonic()
        with pytest.raises(SourceSlow) as cut:
            await read_body(drip, 10**6, MinRate(10_000, 0.4, started), "drip")
        elapsed = time.monotonic() - started
        # 64 KiB at a time, 0.15 s apart: ~400 KiB/s on average, far above 100 KiB/s, in bursts.
        burst = _pieces([(0.15, b"y" * 65536)] * 4)
        body = await read_body(burst, 10**6, MinRate(100_000, 0.4, time.monotonic()), "burst")
        return elapsed, str(cut.value), body

    elapsed, message, body = asyncio.run(scenario())
    assert 0.35 < elapsed < 1.5 and "below 10000 bytes/s" in message and message.startswith("drip:")
    assert body == b"y" * 4 * 65536


def test_a_body_past_the_limit_is_oversized():
    async def scenario() -> None:
        await read_body(_pieces([(0, b"z" * 600), (0, b"z" * 600)]), 1000, MinRate(0, 0, 0), "big")

    with pytest.raises(SourceOversized):
        asyncio.run(scenario())


# -- HTTP: how each fault is named ----------------------------------------------------------------

BODY = b"chunk bytes " * 100
REF = ChunkRef(sha256=hashlib.sha256(BODY).hexdigest(), size=len(BODY))


async def _drip(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Length": str(len(BODY))})
    await resp.prepare(request)
    for byte in BODY:
        await resp.write(bytes([byte]))
        await asyncio.sleep(0.2)  # the attack itself: a byte every 0.2 s
    return resp


async def _silent(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Length": str(len(BODY))})
    await resp.prepare(request)
    await resp.write(BODY[:10])
    await asyncio.sleep(30)  # the attack itself: a body that stops; the fetcher's stall timeout cuts it
    return resp


async def _short(request: web.Request) -> web.Response:
    return web.Response(body=BODY[: len(BODY) // 2])


async def _cut(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Length": str(len(BODY))})
    await resp.prepare(request)
    await resp.write(BODY[:100])
    assert request.transport is not None
    request.transport.close()  # the connection ends before Content-Length
    return resp


async def _huge(request: web.Request) -> web.Response:
    return web.Response(body=BODY + b"extra")


async def _chunked_huge(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse()
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    for _ in range(4):
        await resp.write(BODY)
    return resp


@pytest.mark.parametrize(
    "handler, rate, error",
    [(_drip, 2000, SourceSlow), (_silent, 2000, SourceSlow), (_silent, 0, SourceStalled),
     (_short, 2000, SourceTruncated), (_cut, 2000, SourceTruncated), (_huge, 2000, SourceOversized),
     (_chunked_huge, 2000, SourceOversized)],
)
def test_http_names_each_fault_of_a_body(handler, rate: int, error):
    # A body that stops is too slow once the grace is over; without a minimum rate it stalls.
    config = FetchConfig(min_rate_bps=rate, min_rate_grace_s=0.5, stall_timeout_s=1.0, chunk_timeout_s=10)

    async def scenario() -> tuple[type, float]:
        app = web.Application()
        app.router.add_get("/v1/chunk/{sha}", handler)
        runner = web.AppRunner(app, shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        started = time.monotonic()
        try:
            async with aiohttp.ClientSession() as session:
                source = HttpSource(session, f"http://127.0.0.1:{port}", config, name="relay:rogue")
                try:
                    await source.chunk(REF)
                except SourceError as e:
                    return type(e), time.monotonic() - started
                return type(None), time.monotonic() - started
        finally:
            await runner.cleanup()

    kind, elapsed = asyncio.run(scenario())
    assert kind is error
    assert elapsed < 3.0  # never the request's 10 s


# -- bans and back-off ------------------------------------------------------------------------------

def test_a_ban_doubles_with_each_repeat_up_to_its_cap_and_is_forgotten_after_good_behaviour():
    clock = Clock()
    stats: Counter[str] = Counter()
    bans = SourceBans(FetchConfig(ban_s=10, ban_max_s=35), stats, clock=clock)
    assert bans.strike("relay:aaaa", "slow") == 10
    assert bans.banned("relay:aaaa") and bans.remaining("relay:aaaa") == 10
    assert bans.strike("relay:aaaa", "truncated") is None  # already banned: in-flight requests add nothing
    clock.now += 10.5
    assert not bans.banned("relay:aaaa")
    assert bans.strike("relay:aaaa", "stalled") == 20  # a repeat: twice as long
    clock.now += 21
    assert bans.strike("relay:aaaa", "slow") == 35  # capped at ban_max_s
    assert bans.reason("relay:aaaa") == "slow" and list(bans.active()) == ["relay:aaaa"]
    clock.now += 35 + 36  # ended more than ban_max_s ago: a clean slate
    assert bans.strike("relay:aaaa", "bad_chunk") == 10
    assert stats["bans"] == 4 and stats["bans_slow"] == 2 and stats["bans_stalled"] == 1
    assert stats["bans_bad_chunk"] == 1 and "bans_truncated" not in stats


def test_the_learner_is_only_paused_on_the_follower_loop_s_back_off():
    clock = Clock()
    stats: Counter[str] = Counter()
    bans = SourceBans(FetchConfig(ban_s=60, retry_backoff_s=1.0), stats, clock=clock)
    assert bans.strike("learner:llll", "slow", last_resort=True) == 1.0
    clock.now += 1.1
    assert bans.strike("learner:llll", "slow", last_resort=True) == 2.0
    assert stats["learner_backoffs"] == 2 and stats["learner_backoffs_slow"] == 2 and stats["bans"] == 0


def test_the_ban_list_is_bounded():
    clock = Clock()
    bans = SourceBans(FetchConfig(ban_s=10, ban_max_s=100), clock=clock, max_records=3)
    for i in range(5):
        clock.now += 1
        bans.strike(f"relay:{i}", "slow")
    assert len(bans._bans) == 3 and set(bans.active()) == {"relay:2", "relay:3", "relay:4"}


# -- the fetcher: bans outlive a version fetch ------------------------------------------------------

def _version(version: int, count: int) -> tuple[Manifest, dict[str, bytes]]:
    blobs = [f"v{version} chunk {i} ".encode() * 50 for i in range(count)]
    data = {hashlib.sha256(b).hexdigest(): b for b in blobs}
    refs = [ChunkRef(sha256=h, size=len(b)) for h, b in data.items()]
    manifest = Manifest(swarm="s", version=version, created_ms=1, chunk_size=4096,
                        files=[FileEntry(name="model.safetensors", size=sum(r.size for r in refs), sha256="0" * 64,
                                         chunks=refs)])
    return manifest, data


def test_a_slow_peer_is_banned_once_and_not_asked_for_the_next_versions(tmp_path: Path):
    fetcher = PolicyFetcher(FetchConfig(parallel_chunks=1), ChunkStore(tmp_path))
    v1, data1 = _version(1, 4)
    v2, data2 = _version(2, 4)
    rogue = FakeSource("relay:rogue", {}, fault=SourceSlow)
    learner = FakeSource("learner:llll", {**data1, **data2})

    def route(i: int, ref: ChunkRef):
        return [(rogue, 10.0), (learner, 0.0)]

    asyncio.run(fetcher.fetch_chunks(v1, route, publisher=learner.name))
    assert len(rogue.asked) == 1  # banned at its first fault, for this version and the next
    asyncio.run(fetcher.fetch_chunks(v2, route, publisher=learner.name))
    assert len(rogue.asked) == 1 and len(learner.asked) == 8
    stats = fetcher.stats
    assert stats["source_slow"] == 1 and stats["bans"] == 1 and stats["bans_slow"] == 1
    assert stats["chunks_fetched"] == 8 and fetcher.bytes_from == Counter({learner.name: sum(map(len, data2.values()))})


def test_a_peer_that_serves_wrong_bytes_is_banned_across_versions(tmp_path: Path):
    fetcher = PolicyFetcher(FetchConfig(parallel_chunks=1), ChunkStore(tmp_path))
    v1, data1 = _version(1, 2)
    v2, data2 = _version(2, 2)
    liar = FakeSource("relay:liar", {h: b"x" + b[1:] for h, b in {**data1, **data2}.items()})
    learner = FakeSource("learner:llll", {**data1, **data2})
    route = lambda i, ref: [(liar, 0.0), (learner, 0.0)]  # noqa: E731
    asyncio.run(fetcher.fetch_chunks(v1, route, publisher=learner.name))
    asyncio.run(fetcher.fetch_chunks(v2, route, publisher=learner.name))
    assert len(liar.asked) == 1 and fetcher.stats["bad_chunk"] == 1 and fetcher.stats["bans_bad_chunk"] == 1


def test_a_misbehaving_learner_is_paused_and_asked_again_not_banned(tmp_path: Path):
    config = FetchConfig(parallel_chunks=1, retry_backoff_s=0.2, attempts_per_chunk=4)
    fetcher = PolicyFetcher(config, ChunkStore(tmp_path))
    v1, data1 = _version(1, 1)
    learner = FakeSource("learner:llll", data1, fault=SourceTruncated)
    peer = FakeSource("relay:gone", {}, fault=SourceStalled)
    route = lambda i, ref: [(peer, 0.0), (learner, 0.0)]  # noqa: E731

    async def scenario() -> float:
        started = time.monotonic()
        task = asyncio.create_task(fetcher.fetch_chunks(v1, route, publisher=learner.name))
        while len(learner.asked) < 2 and not task.done():  # bounded by the fetch's own rounds
            await asyncio.sleep(0.01)  # poll interval of a bounded wait
        learner.fault = None  # it recovers: asked again after its pause
        await asyncio.wait_for(task, 10)
        return time.monotonic() - started

    elapsed = asyncio.run(scenario())
    assert len(peer.asked) == 1  # the peer is banned; the learner is only paused
    assert len(learner.asked) == 3 and fetcher.stats["learner_backoffs_truncated"] == 2
    assert fetcher.stats["bans_stalled"] == 1 and fetcher.stats["chunks_fetched"] == 1
    assert elapsed >= 0.2 + 0.4 - 0.05  # waited out both pauses (0.2 s, then 0.4 s)
    assert fetcher.bans.banned("relay:gone") and not fetcher.bans.banned("learner:llll")


def test_a_route_of_banned_peers_only_fails_at_once(tmp_path: Path):
    fetcher = PolicyFetcher(FetchConfig(), ChunkStore(tmp_path))
    v1, _ = _version(1, 1)
    fetcher.bans.strike("relay:x", "slow")
    with pytest.raises(FetchError, match="banned or gone"):
        asyncio.run(fetcher.fetch_chunks(v1, lambda i, ref: [(FakeSource("relay:x", {}), 0.0)]))


def test_peers_whose_chunks_verified_are_reported_as_having_served_and_liars_are_not(tmp_path: Path):
    served: list[str] = []
    fetcher = PolicyFetcher(FetchConfig(parallel_chunks=1), ChunkStore(tmp_path), served=served.append)
    v1, data1 = _version(1, 3)
    liar = FakeSource("relay:liar", {h: b"x" + b[1:] for h, b in data1.items()})
    honest = FakeSource("relay:honest", data1)
    asyncio.run(fetcher.fetch_chunks(v1, lambda i, ref: [(liar, 0.0), (honest, 0.0)], publisher="learner:llll"))
    assert served == ["relay:honest"] * 3
