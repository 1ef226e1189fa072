"""Hedged requests: when a request is hedged, which copy wins, what is counted and who is banned.

The delay rule and the slowness verdict are pure logic; the races run fake sources whose bodies
come at a scripted pace (asyncio sleeps stand for the network), each within a fraction of a second.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path

import pytest

from echo2swarm.config.models import FetchConfig
from echo2swarm.policy.fetcher import PolicyFetcher
from echo2swarm.policy.hedge import Pace, Race, outpaced_slow
from echo2swarm.policy.manifest import ChunkRef, FileEntry, Manifest
from echo2swarm.policy.sources import Progress, SourceBusy
from echo2swarm.policy.store import ChunkStore

pytestmark = pytest.mark.timeout(60)
FAST = dict(hedge_after=4.0, hedge_min_s=0.05)  # hedged 50 ms in, once a sample is known


# -- when to hedge --------------------------------------------------------------------------------

def test_the_delay_is_a_multiple_of_the_recent_median_scaled_to_the_chunk_with_a_floor():
    pace = Pace(FetchConfig(hedge_after=4.0, hedge_min_s=0.5, min_rate_grace_s=10.0))
    assert pace.delay_s(1 << 20) == 10.0  # nothing measured yet: the grace, as before hedging
    for seconds in (0.2, 0.25, 0.3, 9.0):  # one straggler does not move the median
        pace.record(seconds, 1 << 20)
    assert pace.expected_s(1 << 20) == pytest.approx(0.275)
    assert pace.delay_s(1 << 20) == pytest.approx(1.1)
    assert pace.delay_s(4 << 20) == pytest.approx(4.4)  # a chunk 4x bigger may take 4x longer
    assert pace.delay_s(1 << 10) == pytest.approx(1.1)  # a smaller one is not expected faster (latency)
    assert pace.delay_s(None) == pytest.approx(1.1)
    fast = Pace(FetchConfig(hedge_after=4.0, hedge_min_s=0.5))
    fast.record(0.001, 64 << 10)
    assert fast.delay_s(64 << 10) == 0.5  # never before hedge_min_s
    assert Pace(FetchConfig(hedge_after=0)).delay_s(1 << 20) is None  # off


def test_the_window_keeps_the_newest_chunks_only():
    pace = Pace(FetchConfig(**FAST), window=4)
    for _ in range(4):
        pace.record(5.0, 1000)
    for _ in range(4):
        pace.record(0.1, 1000)
    assert pace.expected_s(1000) == pytest.approx(0.1)


def test_an_outpaced_request_is_slow_only_below_the_minimum_rate_over_its_age():
    progress = Progress()
    assert not outpaced_slow(progress, time.monotonic(), 8192)  # not begun: a held request waiting, not slow
    progress.begin()
    started = progress.begun_at
    assert started is not None
    progress.received = 3
    assert outpaced_slow(progress, started + 1.0, 8192)  # a drip
    progress.received = 9000
    assert not outpaced_slow(progress, started + 1.0, 8192)  # slower than the winner, not below the minimum
    assert not outpaced_slow(Progress(), started + 100, 0)  # no minimum


# -- races ------------------------------------------------------------------------------------------

class Scripted:
    """A source whose answer is scripted: `hold` seconds before its header (a held request), then the
    body in `pieces` pieces, the first at once and each next `every` seconds later; `busy`: 503 at once."""

    def __init__(self, name: str, data: dict[str, bytes], hold: float = 0.0, pieces: int = 1, every: float = 0.0,
                 busy: bool = False):
        self.name, self.peer_id = name, name
        self.data = data
        self.hold, self.pieces, self.every, self.busy = hold, pieces, every, busy
        self.asked: list[tuple[str, float]] = []  # (sha256, wait)
        self.cancelled = 0

    async def _body(self, body: bytes, progress: Progress | None) -> bytes:
        if self.busy:
            raise SourceBusy(f"{self.name}: busy")
        try:
            await asyncio.sleep(self.hold)  # the scripted hold
            if progress is not None:
                progress.begin()
            step = max(1, len(body) // self.pieces)
            for i in range(0, len(body), step):
                if progress is not None:
                    progress.received += len(body[i:i + step])
                await asyncio.sleep(self.every)  # the scripted pace of the body
            return body
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def manifest(self, version: int, max_bytes: int, progress: Progress | None = None) -> bytes:
        raise NotImplementedError

    async def plan(self, version: int, max_bytes: int) -> bytes:
        raise NotImplementedError

    async def chunk(self, ref: ChunkRef, wait: float = 0.0, version: int | None = None,
                    progress: Progress | None = None) -> bytes:
        self.asked.append((ref.sha256, wait))
        return await self._body(self.data[ref.sha256], progress)


def _version(count: int, size: int = 4000) -> tuple[Manifest, dict[str, bytes]]:
    blobs = [(f"chunk {i} ".encode() * size)[:size] for i in range(count)]
    data = {hashlib.sha256(b).hexdigest(): b for b in blobs}
    refs = [ChunkRef(sha256=h, size=len(b)) for h, b in data.items()]
    manifest = Manifest(swarm="s", version=1, created_ms=1, chunk_size=size,
                        files=[FileEntry(name="model.safetensors", size=sum(r.size for r in refs), sha256="0" * 64,
                                         chunks=refs)])
    return manifest, data


def _race(route: list[tuple[Scripted, float]], ref: ChunkRef, delay_s: float | None) -> Race:
    return Race(route, lambda s, wait, p: s.chunk(ref, wait, 1, p), delay_s)  # type: ignore[arg-type, misc]


def test_a_slow_first_source_gets_a_hedge_and_the_first_copy_wins():
    manifest, data = _version(1)
    ref = manifest.chunk_refs()[0]
    slow = Scripted("relay:slow", data, pieces=40, every=0.05)  # 2 s for the chunk
    fast = Scripted("learner:llll", data)

    async def scenario() -> tuple[str, bool, float, list]:
        race = _race([(slow, 0.0), (fast, 0.0)], ref, 0.1)
        started = time.monotonic()
        request = await race.next()
        assert request is not None
        took = time.monotonic() - started
        return request.source.name, request.hedge, took, await race.close()

    name, hedge, took, cancelled = asyncio.run(scenario())
    assert name == fast.name and hedge and took < 1.0
    assert [r.source.name for r in cancelled] == [slow.name] and slow.cancelled == 1
    assert 0 < cancelled[0].progress.received < ref.size


def test_no_hedge_while_the_first_source_keeps_pace_or_when_nothing_is_left_to_ask():
    manifest, data = _version(1)
    ref = manifest.chunk_refs()[0]
    steady = Scripted("relay:steady", data, pieces=4, every=0.01)
    other = Scripted("learner:llll", data)

    async def scenario(route: list[tuple[Scripted, float]], delay: float | None) -> str:
        race = _race(route, ref, delay)
        request = await race.next()
        assert request is not None and await race.close() == []
        assert race.stats["hedges_fired"] == 0
        return request.source.name

    assert asyncio.run(scenario([(steady, 0.0), (other, 0.0)], 1.0)) == steady.name
    assert other.asked == []
    slow = Scripted("relay:slow", data, pieces=4, every=0.05)
    assert asyncio.run(scenario([(slow, 0.0)], 0.01)) == slow.name  # alone: waited for
    assert asyncio.run(scenario([(slow, 0.0), (other, 0.0)], None)) == slow.name  # hedging off
    assert other.asked == []


def test_a_held_request_is_not_hedged_while_its_parent_waits_for_the_chunk_only_once_its_body_lags():
    manifest, data = _version(1)
    ref = manifest.chunk_refs()[0]
    learner = Scripted("learner:llll", data)

    async def scenario(parent: Scripted) -> str:
        race = _race([(parent, 10.0), (learner, 0.0)], ref, 0.1)
        request = await race.next()
        assert request is not None
        await race.close()
        return request.source.name

    # held 0.4 s (4 delays) before its header, then quick: the parent's own fetch, not slowness
    assert asyncio.run(scenario(Scripted("relay:parent", data, hold=0.4))) == "relay:parent"
    assert learner.asked == []
    # quick header, then a drip: hedged once its body lags
    assert asyncio.run(scenario(Scripted("relay:drip", data, pieces=40, every=0.1))) == learner.name
    assert len(learner.asked) == 1


def test_a_busy_hedge_moves_on_to_the_next_source_at_once():
    manifest, data = _version(1)
    ref = manifest.chunk_refs()[0]
    slow = Scripted("relay:slow", data, pieces=40, every=0.05)
    busy = Scripted("relay:busy", data, busy=True)
    learner = Scripted("learner:llll", data)

    async def scenario() -> tuple[list[str], int]:
        race = _race([(slow, 0.0), (busy, 0.0), (learner, 0.0)], ref, 0.1)
        ended = []
        while (request := await race.next()) is not None:
            ended.append(request.source.name)
            if request.task.exception() is None:
                break
        await race.close()
        return ended, race.stats["hedges_fired"]

    ended, fired = asyncio.run(scenario())
    assert ended == [busy.name, learner.name] and fired == 2


# -- in the fetcher ------------------------------------------------------------------------------

def _fetcher(tmp_path: Path, **config: object) -> PolicyFetcher:
    fetcher = PolicyFetcher(FetchConfig(**{**FAST, **config}), ChunkStore(tmp_path))  # type: ignore[arg-type]
    fetcher.pace.record(0.005, 4000)  # a chunk measured before: hedges after hedge_min_s
    return fetcher


def test_a_dripping_source_costs_one_hedge_delay_is_banned_as_slow_and_its_bytes_are_counted(tmp_path: Path):
    fetcher = _fetcher(tmp_path, parallel_chunks=4, min_rate_grace_s=10.0)
    manifest, data = _version(8)
    drip = Scripted("relay:drip", data, pieces=4000, every=2.0)  # a byte every 2 s
    learner = Scripted("learner:llll", data)

    async def scenario() -> float:
        started = time.monotonic()
        await fetcher.fetch_chunks(manifest, lambda i, ref: [(drip, 0.0), (learner, 0.0)], publisher=learner.name)
        return time.monotonic() - started

    took = asyncio.run(scenario())
    assert took < 5.0, f"{took:.1f} s: the fetch waited for the drip's grace (10 s)"
    stats = fetcher.stats
    assert 1 <= len(drip.asked) <= 4  # the first wave only: banned when outpaced, never asked again
    assert stats["bans_slow"] == 1 and fetcher.bans.reason(drip.name) == "slow"
    assert stats["source_slow"] == stats["source_error"] >= 1  # counted as the cut-off it stands in for
    assert stats["hedges_fired"] == len(drip.asked) == stats["hedges_won"]
    assert stats["chunks_fetched"] == 8 and fetcher.bytes_from == {learner.name: 8 * 4000}
    assert stats["hedge_bytes"] == len(drip.asked)  # its first byte each, before it was cancelled


def test_an_honest_source_outpaced_by_its_hedge_is_not_banned_and_a_losing_hedge_costs_its_bytes(tmp_path: Path):
    fetcher = _fetcher(tmp_path, parallel_chunks=1, min_rate_bps=1024)
    manifest, data = _version(1, size=40_000)
    # Slower than the median but far above the minimum rate: 40 KB in 0.3 s.
    slowish = Scripted("relay:slowish", data, pieces=10, every=0.03)
    learner = Scripted("learner:llll", data, pieces=10, every=0.1)  # the hedge is slower still: it loses
    asyncio.run(fetcher.fetch_chunks(manifest, lambda i, ref: [(slowish, 0.0), (learner, 0.0)],
                                     publisher=learner.name))
    stats = fetcher.stats
    assert stats["hedges_fired"] == 1 and stats["hedges_won"] == 0 and stats["bans"] == 0
    assert fetcher.bytes_from == {slowish.name: 40_000} and learner.cancelled == 1
    assert 0 < stats["hedge_bytes"] < 40_000  # what the cancelled hedge had received
    assert fetcher.pace.samples[-1][1] == 40_000  # the winner's time is the next sample


def test_an_honest_broadcast_fires_no_hedge(tmp_path: Path):
    fetcher = _fetcher(tmp_path, parallel_chunks=4, hedge_min_s=2.0)  # a loaded host may pause the loop for a while
    manifest, data = _version(16)
    holders = [Scripted(f"relay:{i}", data, pieces=2, every=0.005) for i in range(3)]
    learner = Scripted("learner:llll", data)

    def route(i: int, ref: ChunkRef) -> list[tuple[Scripted, float]]:
        k = i % len(holders)
        return [(s, 0.0) for s in holders[k:] + holders[:k]] + [(learner, 0.0)]

    asyncio.run(fetcher.fetch_chunks(manifest, route, publisher=learner.name))  # type: ignore[arg-type]
    assert fetcher.stats["hedges_fired"] == 0 and fetcher.stats["hedge_bytes"] == 0 and learner.asked == []
    assert len(fetcher.pace.samples) == 17


def test_a_source_that_delivered_may_lose_some_races_below_the_minimum_a_fresh_one_none(tmp_path: Path):
    # An honest parent whose upload queue held our transfers back looks like a drip at the moment its
    # request loses: it is spared as long as the chunks it delivered cover it. A new identity is not.
    fetcher = _fetcher(tmp_path, parallel_chunks=1, min_rate_grace_s=10.0)
    assert fetcher.credit.cap == 2
    manifest, data = _version(6)
    parent = Scripted("relay:parent", data)
    learner = Scripted("learner:llll", data)
    route = lambda i, ref: [(parent, 0.0), (learner, 0.0)]  # noqa: E731
    asyncio.run(fetcher.fetch_chunks(manifest, route, refs=manifest.chunk_refs()[:3], publisher=learner.name))
    assert fetcher.bytes_from == {parent.name: 3 * 4000} and fetcher.stats["hedges_fired"] == 0
    parent.pieces, parent.every = 4000, 2.0  # now its transfers wait (a byte, then nothing for 2 s)
    asyncio.run(fetcher.fetch_chunks(manifest, route, publisher=learner.name))
    stats = fetcher.stats
    assert stats["hedges_won"] == 3 and stats["bans_slow"] == 1  # two races covered, the third not
    assert len(parent.asked) == 3 + 3 and fetcher.bans.banned(parent.name)
    fresh = Scripted("relay:fresh", data, pieces=4000, every=2.0)
    other = _fetcher(tmp_path / "other", parallel_chunks=1, min_rate_grace_s=10.0)
    asyncio.run(other.fetch_chunks(manifest, lambda i, ref: [(fresh, 0.0), (learner, 0.0)], publisher=learner.name))
    assert len(fresh.asked) == 1 and other.stats["bans_slow"] == 1  # its first lost race


# -- the premise: our servers send a chunk's header with its first bytes ------------------------------

def test_a_chunk_header_goes_out_when_the_limiter_gives_the_first_block_its_turn(tmp_path: Path):
    from echo2swarm.config.models import ChunkServerConfig
    from echo2swarm.policy.limiter import RateLimiter
    from echo2swarm.policy.server import ChunkService
    from echo2swarm.policy.store import VersionStore

    limiter = RateLimiter(1 << 20, burst=64 << 10)  # 1 MiB/s
    service = ChunkService(ChunkServerConfig(), ChunkStore(tmp_path), VersionStore(tmp_path), limiter=limiter)
    body = tmp_path / "chunk"
    body.write_bytes(b"x" * 1000)
    events: list[tuple[str, float]] = []

    async def header() -> None:
        events.append(("header", time.monotonic()))

    async def write(block: bytes) -> None:
        events.append(("bytes", time.monotonic()))

    async def scenario() -> float:
        other = asyncio.create_task(limiter.take(320 << 10))  # another transfer's block, ~0.25 s, ahead of ours
        await asyncio.sleep(0)  # let it take the limiter's queue first
        started = time.monotonic()
        with body.open("rb") as f:
            await service.upload(f, write, header=header)
        await other
        return started

    started = asyncio.run(scenario())
    assert [kind for kind, _ in events] == ["header", "bytes"]
    assert events[0][1] - started >= 0.2  # the queue was waited out before the header, not after it
    assert events[1][1] - events[0][1] < 0.05
