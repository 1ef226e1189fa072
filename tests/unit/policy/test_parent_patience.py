"""A fetcher waits for its plan parent that has not begun the version yet instead of taking the chunk
from the learner (`ParentPatience`), within `fetch.source_wait_s`; a parent that held the request and
still lacks the chunk, or never begins, is gone around as before.

Fake sources stand in for the peers (pure fetcher logic, as in test_source_bans.py); a parent's
"begins" is a flag the test flips once the fetcher has asked it, never a sleep.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path

import pytest

from echo2swarm.config.models import FetchConfig
from echo2swarm.policy.fetcher import FetchError, PolicyFetcher
from echo2swarm.policy.manifest import ChunkRef, FileEntry, Manifest
from echo2swarm.policy.sources import Progress, SourceBusy, SourceMissing, SourceOffPath
from echo2swarm.policy.store import ChunkStore
from helpers.sources import FakeSource

pytestmark = pytest.mark.timeout(60)


class Parent(FakeSource):
    """A plan parent: answers "not held" at once until `begun`, then serves (or, `holds`, holds every
    request for its whole wait and answers "not held": fetching, but the chunk does not come in time)."""

    def __init__(self, name: str, data: dict[str, bytes], begun: bool = False, holds: bool = False):
        super().__init__(name, data)
        self.begun, self.holds = begun, holds

    async def chunk(self, ref: ChunkRef, wait: float = 0.0, version: int | None = None,
                    progress: Progress | None = None) -> bytes:
        self.asked.append(ref.sha256)
        if self.holds:
            await asyncio.sleep(wait)  # the parent's hold, scripted: the whole wait, then "not held"
            raise SourceMissing(f"{self.name}: not held")
        if not self.begun:
            raise SourceMissing(f"{self.name}: not held")
        return self.data[ref.sha256]


def _version(count: int) -> tuple[Manifest, dict[str, bytes]]:
    blobs = [f"chunk {i} ".encode() * 40 for i in range(count)]
    data = {hashlib.sha256(b).hexdigest(): b for b in blobs}
    refs = [ChunkRef(sha256=h, size=len(b)) for h, b in data.items()]
    manifest = Manifest(swarm="s", version=1, created_ms=1, chunk_size=4096,
                        files=[FileEntry(name="model.safetensors", size=sum(r.size for r in refs), sha256="0" * 64,
                                         chunks=refs)])
    return manifest, data


def test_a_parent_that_has_not_begun_is_asked_again_and_the_learner_not_at_all(tmp_path: Path):
    config = FetchConfig(parallel_chunks=4, source_wait_s=10.0)
    fetcher = PolicyFetcher(config, ChunkStore(tmp_path))
    manifest, data = _version(8)
    parent = Parent("relay:parent", data)
    learner = Parent("learner:llll", data, begun=True)

    async def scenario() -> None:
        task = asyncio.create_task(fetcher.fetch_chunks(
            manifest, lambda i, ref: [(parent, config.source_wait_s), (learner, 0.0)], publisher=learner.name))
        while len(parent.asked) < 8 and not task.done():  # bounded by the patience (10 s)
            await asyncio.sleep(0.01)  # poll interval of a bounded wait
        parent.begun = True  # its fetch begins: the chunks asked again now come from it
        await asyncio.wait_for(task, 20)

    asyncio.run(scenario())
    assert learner.asked == []
    assert fetcher.bytes_from == {parent.name: sum(map(len, data.values()))}
    assert fetcher.stats["parent_not_begun"] >= 4 and fetcher.stats["parent_passed_over"] == 0


def test_a_parent_that_never_begins_costs_one_patience_not_one_per_chunk(tmp_path: Path):
    config = FetchConfig(parallel_chunks=2, source_wait_s=0.5)
    fetcher = PolicyFetcher(config, ChunkStore(tmp_path))
    manifest, data = _version(12)
    parent = Parent("relay:stale", data)
    learner = Parent("learner:llll", data, begun=True)
    started = time.monotonic()
    asyncio.run(fetcher.fetch_chunks(manifest, lambda i, ref: [(parent, config.source_wait_s), (learner, 0.0)],
                                     publisher=learner.name))
    elapsed = time.monotonic() - started
    assert len(learner.asked) == 12 and fetcher.stats["parent_passed_over"] == 1
    # asked again for about one patience (0.5 s, every 0.1-0.2 s, 2 in flight), then once per chunk left
    assert len(parent.asked) <= 12 + 2 * 0.5 / 0.1 + 2
    assert elapsed < 0.5 + 3.0


def test_a_parent_that_held_the_request_and_lacks_the_chunk_is_gone_around_at_once(tmp_path: Path):
    config = FetchConfig(parallel_chunks=1, source_wait_s=0.2)
    fetcher = PolicyFetcher(config, ChunkStore(tmp_path))
    manifest, data = _version(2)
    parent = Parent("relay:behind", data, holds=True)
    learner = Parent("learner:llll", data, begun=True)
    asyncio.run(fetcher.fetch_chunks(manifest, lambda i, ref: [(parent, config.source_wait_s), (learner, 0.0)],
                                     publisher=learner.name))
    assert len(parent.asked) == 2 and len(learner.asked) == 2  # one held ask per chunk, no second
    assert fetcher.stats["parent_not_begun"] == 0


def test_a_holder_without_a_wait_is_never_asked_again(tmp_path: Path):
    fetcher = PolicyFetcher(FetchConfig(parallel_chunks=1), ChunkStore(tmp_path))
    manifest, data = _version(3)
    holder = Parent("relay:other", data)  # lists the version, answers "not held": next source at once
    learner = Parent("learner:llll", data, begun=True)
    asyncio.run(fetcher.fetch_chunks(manifest, lambda i, ref: [(holder, 0.0), (learner, 0.0)], publisher=learner.name))
    assert len(holder.asked) == 3 and len(learner.asked) == 3 and fetcher.stats["parent_not_begun"] == 0


def test_a_plan_parent_far_behind_is_not_waited_for() -> None:
    """PolicyFollower._route waits fetch.source_wait_s for a plan parent unless its card shows it more than
    PARENT_MAX_LAG versions behind and not fetching the version (it is catching up itself)."""
    from collections import Counter
    from types import SimpleNamespace

    from echo2swarm.policy.follower import PARENT_MAX_LAG, PolicyFollower

    stats: Counter[str] = Counter()
    me = SimpleNamespace(_cards=[SimpleNamespace(peer_id="near", version=13, fetching=None),
                                 SimpleNamespace(peer_id="far", version=3, fetching=9),
                                 SimpleNamespace(peer_id="new", version=None, fetching=None),
                                 SimpleNamespace(peer_id="on_it", version=2, fetching=14)],
                         _parent_noted=None, fetcher=SimpleNamespace(stats=stats))
    me._note_parent = lambda *args: PolicyFollower._note_parent(me, *args)  # type: ignore[arg-type]

    def behind(peer: str, version: int = 14) -> bool:
        return PolicyFollower._parent_behind(me, peer, version)  # type: ignore[arg-type]

    assert not behind("near") and not behind("near", 13 + PARENT_MAX_LAG)  # the cards lag: within the margin
    assert behind("near", 14 + PARENT_MAX_LAG)
    assert behind("far") and behind("far") and behind("new")
    assert not behind("on_it")  # fetching this very version: worth waiting for
    assert not behind("unknown")  # no card: the caller routes around it (parent_unknown)
    assert stats["parent_behind"] == 3  # once per (parent, version) in a row, not once per chunk


def test_a_plan_parent_past_the_version_is_not_waited_for() -> None:
    """A follower that fell behind (the learner restarted, its versions came fast) fetches a version its plan
    parent has already left: a parent whose card shows a newer version, neither holding nor fetching this
    one, will never begin it, so it is asked first but not waited for (CI: a follower waited 10 s on such a
    parent at every version until the learner had finished)."""
    from collections import Counter
    from types import SimpleNamespace

    from echo2swarm.policy.follower import PolicyFollower

    stats: Counter[str] = Counter()
    me = SimpleNamespace(_cards=[SimpleNamespace(peer_id="ahead", version=20, held=[19, 20], fetching=None),
                                 SimpleNamespace(peer_id="refetching", version=20, held=[20], fetching=14),
                                 SimpleNamespace(peer_id="new", version=None, held=[], fetching=None)],
                         _parent_noted=None, fetcher=SimpleNamespace(stats=stats))
    me._note_parent = lambda *args: PolicyFollower._note_parent(me, *args)  # type: ignore[arg-type]

    def past(peer: str, version: int = 14) -> bool:
        return PolicyFollower._parent_past(me, peer, version)  # type: ignore[arg-type]

    assert past("ahead") and past("ahead") and past("ahead", 18)
    assert not past("ahead", 19) and not past("ahead", 20)  # it holds them: served at once, as a holder
    assert not past("ahead", 21)  # its next version: the parent is about to begin it, worth waiting for
    assert not past("refetching")  # fetching this very version
    assert not past("new") and not past("unknown")  # nothing known: waited for, or routed around (parent_unknown)
    assert stats["parent_past"] == 2  # once per (parent, version) in a row, not once per chunk


class OffPath(FakeSource):
    """A plan parent on another path of the version (it follows by a delta, the fetch takes the dense files)."""

    async def chunk(self, ref: ChunkRef, wait: float = 0.0, version: int | None = None,
                    progress: Progress | None = None) -> bytes:
        self.asked.append(ref.sha256)
        raise SourceOffPath(f"{self.name}: not on its path of the version")


class Busy(FakeSource):
    """The learner with its upload slots full for its first `busy` answers, then serving."""

    def __init__(self, name: str, data: dict[str, bytes], busy: int):
        super().__init__(name, data)
        self.busy = busy

    async def chunk(self, ref: ChunkRef, wait: float = 0.0, version: int | None = None,
                    progress: Progress | None = None) -> bytes:
        self.asked.append(ref.sha256)
        if len(self.asked) <= self.busy:
            raise SourceBusy(f"{self.name}: busy (503)")
        return self.data[ref.sha256]


def test_a_parent_on_another_path_is_gone_around_at_once_and_not_asked_again(tmp_path: Path):
    config = FetchConfig(parallel_chunks=1, source_wait_s=10.0)
    fetcher = PolicyFetcher(config, ChunkStore(tmp_path))
    manifest, data = _version(5)
    parent = OffPath("relay:delta", data)
    learner = Parent("learner:llll", data, begun=True)
    started = time.monotonic()
    asyncio.run(fetcher.fetch_chunks(manifest, lambda i, ref: [(parent, config.source_wait_s), (learner, 0.0)],
                                     publisher=learner.name))
    assert len(parent.asked) == 1 and len(learner.asked) == 5  # no patience spent on it, no second ask
    assert fetcher.stats["source_off_path"] == 1 and fetcher.stats["parent_not_begun"] == 0
    assert time.monotonic() - started < config.source_wait_s / 2


def test_a_busy_learner_behind_holders_without_the_chunk_is_asked_again_not_failed(tmp_path: Path):
    """A follower behind the swarm may find its chunks at the learner only: holders answer "not held" and
    the learner, full for a while, answers busy. Those rounds are busy, not failed: asked again until it
    serves, past `attempts_per_chunk`."""
    config = FetchConfig(parallel_chunks=1, attempts_per_chunk=2)
    fetcher = PolicyFetcher(config, ChunkStore(tmp_path))
    manifest, data = _version(2)
    holder = FakeSource("relay:other", data, fault=SourceMissing)
    learner = Busy("learner:llll", data, busy=3)
    assert asyncio.run(fetcher.fetch_chunks(manifest, lambda i, ref: [(holder, 0.0), (learner, 0.0)],
                                            publisher=learner.name)) == 2
    assert fetcher.stats["source_busy"] == 3 and len(holder.asked) == 5


def test_a_chunk_that_fails_says_what_its_sources_answered(tmp_path: Path):
    config = FetchConfig(parallel_chunks=1, attempts_per_chunk=2)
    fetcher = PolicyFetcher(config, ChunkStore(tmp_path))
    manifest, data = _version(1)
    holder = FakeSource("relay:other", data, fault=SourceMissing)
    learner = FakeSource("learner:llll", data, fault=SourceMissing)
    with pytest.raises(FetchError, match=r"failed 2 rounds \(0 busy\) over its sources "
                                         r"\(relay:other not held x2, learner:llll not held x2\)"):
        asyncio.run(fetcher.fetch_chunks(manifest, lambda i, ref: [(holder, 0.0), (learner, 0.0)],
                                         publisher=learner.name))
