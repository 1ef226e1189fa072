"""Fetching a version: the manifest, then every missing chunk, each verified before it is stored.

    route(i) ──► [plan parent (may hold the request until it has chunk i), holders, learner last] ──► PolicyFetcher
        manifest: first source whose bytes match the head's sha256 and the pinned signature
        chunks:   `parallel_chunks` in flight, in manifest order (so chains pipeline); each chunk
                  tries its route in order and moves on when a source is busy, missing the chunk,
                  unreachable, stalled, too slow or wrong
        both:     a request slower than the recent median is hedged (`policy/hedge.py`): the next
                  source is asked beside it, the first verified copy wins, the other is cancelled

A chunk whose bytes do not hash to its name is never written, so it can never be served onward.

Sources that misbehave are banned (`SourceBans`): a source that stalls, falls below
`fetch.min_rate_bps` once a body has had `fetch.min_rate_grace_s`, is unreachable, or sends a
truncated, oversized or wrong body is not asked again for `fetch.ban_s`, doubling with each repeat
up to `fetch.ban_max_s`. The bans outlive the version fetch (the follower keeps one `SourceBans`
for its lifetime), so a dripping peer costs one hedge delay, not one per chunk of every version.
The learner (the publisher, the source of last resort) is never banned: when it misbehaves it is
paused for `fetch.retry_backoff_s`, doubling, and asked again. A request that a hedge outpaced while
it brought less than `fetch.min_rate_bps` is slow too (`hedge.outpaced_slow`): banned the same way,
with no grace, unless chunks its source delivered earned it credit (`hedge.RaceCredit`). Counted
with the rest: `hedges_fired`, `hedges_won` (the hedge brought the chunk) and `hedge_bytes` (bytes
of requests cancelled because another copy won).

The sources themselves (HTTP, libp2p, and how each can fail) are in `policy/sources.py`.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from echo2swarm.config.models import FetchConfig
from echo2swarm.policy.hedge import Pace, Race, RaceCredit, Request, outpaced_slow
from echo2swarm.policy.manifest import BaseRef, ChunkRef, Manifest, ManifestError, verify_linked_manifest, verify_manifest
from echo2swarm.policy.sources import (
    ChunkSource,
    Route,
    SourceBusy,
    SourceError,
    SourceFault,
    SourceMissing,
    SourceOffPath,
    SourceUnreachable,
)
from echo2swarm.policy.store import Assembly, ChunkHashError, ChunkStore
from echo2swarm.runtime.aio import BACKOFF_MAX_S, backoff_s
from echo2swarm.runtime.logging import get_logger
from echo2swarm.wire.records import HeadRecord
from echo2swarm.wire.signing import PublicKey

logger = get_logger(__name__)
MAX_BAN_RECORDS = 1024  # sources whose bans (and strike counts) a follower remembers at most
MAX_ANSWERS_SAID = 6  # a failed chunk's error names what its sources answered, the most frequent first
PARENT_RETRY_S = 0.2  # a plan parent that has not begun the version is asked again after 0.1-0.2 s


class FetchError(Exception):
    """A version could not be fetched from any source."""


def busy_pause_s(rounds: int) -> float:
    """Pause before asking busy sources again: random (herds spread out), growing with the rounds, < 2 s."""
    return random.uniform(0.02, 0.25) * min(rounds, 8)


@dataclass
class _Ban:
    strikes: int  # bans in a row: the next one lasts twice as long
    until: float  # monotonic seconds
    reason: str


class SourceBans:
    """Which sources not to ask, until when, and why: kept by the follower across versions.

    A strike bans a peer for `fetch.ban_s`, doubled for each ban in a row (`backoff_s`), at most
    `fetch.ban_max_s`; the learner (`last_resort`) is only paused, for `fetch.retry_backoff_s`
    doubling up to BACKOFF_MAX_S. A strike while the source is still banned adds nothing (requests
    already in flight when it was banned come back bad too). A source whose ban ended more than
    `ban_max_s` ago starts afresh. At most MAX_BAN_RECORDS sources are remembered: past that the
    one whose ban ends first is forgotten. Bans go by source name (`<role>:<last 8 of the peer
    id>`), so they hold across a `PeerSource` rebuilt for a new chunk URL.

    Counted in `stats` (the fetcher's, `stats.fetch` in /v1/info): `bans` and `bans_<reason>` for
    peers, `learner_backoffs` and `learner_backoffs_<reason>` for the learner.
    """

    def __init__(self, config: FetchConfig, stats: Counter[str] | None = None,
                 clock: Callable[[], float] = time.monotonic, max_records: int = MAX_BAN_RECORDS):
        self.config = config
        self.stats: Counter[str] = stats if stats is not None else Counter()
        self.clock = clock
        self.max_records = max_records
        self._bans: OrderedDict[str, _Ban] = OrderedDict()

    def _get(self, name: str, now: float) -> _Ban | None:
        ban = self._bans.get(name)
        if ban is not None and now - ban.until > self.config.ban_max_s:
            del self._bans[name]  # behaved (or was not asked) for a whole longest ban: forgotten
            return None
        return ban

    def remaining(self, name: str) -> float:
        """Seconds until `name` may be asked again (0: now)."""
        now = self.clock()
        ban = self._get(name, now)
        return 0.0 if ban is None else max(0.0, ban.until - now)

    def banned(self, name: str) -> bool:
        return self.remaining(name) > 0

    def reason(self, name: str) -> str | None:
        ban = self._bans.get(name)
        return None if ban is None else ban.reason

    def active(self) -> dict[str, float]:
        """Sources banned now: name -> seconds left."""
        now = self.clock()
        return {name: round(ban.until - now, 3) for name, ban in self._bans.items() if ban.until > now}

    def strike(self, name: str, reason: str, *, last_resort: bool = False, detail: str = "") -> float | None:
        """`name` misbehaved (`reason`): ban it (pause it, as `last_resort`). Returns the seconds, or
        None when it was banned already."""
        now = self.clock()
        ban = self._get(name, now)
        if ban is not None and ban.until > now:
            return None
        strikes = 1 if ban is None else ban.strikes + 1
        if last_resort:
            seconds = backoff_s(strikes, self.config.retry_backoff_s, BACKOFF_MAX_S)
            kind = "learner_backoffs"
        else:
            seconds = backoff_s(strikes, self.config.ban_s, self.config.ban_max_s)
            kind = "bans"
        self._bans[name] = _Ban(strikes, now + seconds, reason)
        self._bans.move_to_end(name)
        self.stats[kind] += 1
        self.stats[f"{kind}_{reason}"] += 1
        if last_resort:
            logger.warning("the learner's source %s %s: asked again in %.1f s (pause %d in a row)%s",
                           name, reason, seconds, strikes, f": {detail}" if detail else "")
        else:
            logger.warning("source %s banned for %.0f s (%s, ban %d in a row)%s",
                           name, seconds, reason, strikes, f": {detail}" if detail else "")
        while len(self._bans) > self.max_records:
            first = min(self._bans, key=lambda n: self._bans[n].until)
            del self._bans[first]
        return seconds


class ParentPatience:
    """How long a fetcher keeps asking a plan parent that has not begun the version yet (one version fetch).

    A plan parent holds a request for a chunk of the version it is fetching until the chunk arrives
    (`fetch.source_wait_s` at most). One that has not verified this version's manifest yet (it saw the
    head a moment after its child, or its CPU is busy) answers "not held" at once instead. Moving on
    would take the chunk from the learner, one more upload of it on the swarm's scarcest uplink, when
    the parent is about to have it; so the chunk is asked of the parent again every ~PARENT_RETRY_S,
    for `patience_s` (`fetch.source_wait_s`) from the first such answer of that parent. A parent that
    has not begun by then is passed over for the rest of the version fetch (one that never will, a
    stale plan's, costs one patience, not one per chunk). An answer that came only after the request was
    held for most of its wait is a parent that is fetching but has not got the chunk in time: the
    fetcher moves on at once, as before.

    A source that answers "off path" (`SourceOffPath`: it fetches or holds this version by another path,
    e.g. a plan parent following by a delta while this fetch takes the dense files) will not have the
    chunk: it is neither waited for nor asked again in this fetch (`off_path`).

    Counted in `stats`: `parent_not_begun` (answers asked again), `parent_passed_over` (parents given up on).
    """

    def __init__(self, patience_s: float, stats: Counter[str]):
        self.patience_s = patience_s
        self.stats = stats
        self._first: dict[str, float] = {}  # parent -> when it first answered "not held" at once
        self._begun: set[str] = set()
        self._passed: set[str] = set()
        self._off: set[str] = set()  # sources on another path of this version (`off_path`)

    def ask_again(self, name: str, held_s: float, wait: float) -> bool:
        """`name`, asked to hold the request up to `wait` s, answered "not held" after `held_s`: ask it again?"""
        if name in self._begun or name in self._passed or name in self._off or held_s >= wait / 2:
            return False
        now = time.monotonic()
        first = self._first.setdefault(name, now)
        if now - first >= self.patience_s:
            self._passed.add(name)
            self.stats["parent_passed_over"] += 1
            logger.info("plan parent %s has not begun the version within %.0f s: fetching around it", name,
                        self.patience_s)
            return False
        self.stats["parent_not_begun"] += 1
        return True

    def begun(self, name: str) -> None:
        """`name` served a chunk it was asked to hold for: it is fetching this version."""
        self._begun.add(name)
        self._first.pop(name, None)

    def off_path(self, name: str) -> None:
        """`name` answered that it fetches or holds this version by another path (a plan parent that follows
        by a delta while this fetch takes the dense files): never waited for, nor asked again, in this fetch."""
        self._off.add(name)

    def off(self, name: str) -> bool:
        return name in self._off


class PolicyFetcher:
    """Fetch and verify one version at a time into a ChunkStore. `stats` counts every outcome.

    `bans` (made here unless given) outlives every version fetch: keep one fetcher per follower.
    `served(peer_id)` is told of every peer a verified chunk came from (the overlay's evidence of work).
    """

    def __init__(self, config: FetchConfig, chunks: ChunkStore, bans: SourceBans | None = None,
                 served: Callable[[str], None] = lambda peer_id: None):
        self.config = config
        self.chunks = chunks
        self.served = served
        self.stats: Counter[str] = Counter()
        self.bans = bans if bans is not None else SourceBans(config)
        self.bans.stats = self.stats  # its counters are reported with the fetch's (`stats.fetch`)
        self.bytes_from: Counter[str] = Counter()  # by source name, for the current version
        self.pace = Pace(config)  # recent chunk times, across versions: when to hedge
        self.credit = RaceCredit(2 * config.parallel_chunks)  # races a source that delivered may lose unbanned

    def _fault(self, source: ChunkSource, reason: str, detail: str, publisher: str | None) -> None:
        self.bans.strike(source.name, reason, last_resort=source.name == publisher, detail=detail)

    def _cancelled(self, requests: list[Request]) -> None:
        """Requests cancelled because another copy won (or the race ended): their bytes were duplicates."""
        self.stats["hedge_bytes"] += sum(r.progress.received for r in requests)

    async def _won(self, race: Race, winner: Request, what: str, publisher: str | None, size: int | None = None) -> None:
        """`winner` brought bytes that verified: cancel the rest of its race, ban what it outpaced while
        below the minimum rate (unless its credit covers it), and (a chunk of `size` bytes) learn its time."""
        losers = await race.close()
        now = time.monotonic()
        self._cancelled(losers)
        if winner.hedge:
            self.stats["hedges_won"] += 1
        rate = self.config.min_rate_bps
        for loser in losers:
            if loser.asked < winner.asked and outpaced_slow(loser.progress, now, rate) \
                    and not self.credit.spend(loser.source.name):
                self.stats["source_error"] += 1  # counted as the minimum-rate cut-off it stands in for
                self.stats["source_slow"] += 1
                age = now - (loser.progress.begun_at or now)
                self._fault(loser.source, "slow", f"{what}: outpaced by {winner.source.name}, {loser.progress.received} "
                            f"bytes in {age:.1f} s, below {rate} bytes/s", publisher)
        if size is not None and winner.progress.begun_at is not None:
            self.pace.record(winner.ended - winner.progress.begun_at, size)

    async def fetch_manifest(
        self, head: HeadRecord, sources: list[ChunkSource], *, trusted: PublicKey, swarm: str,
        publisher: str | None = None,
    ) -> tuple[Manifest, bytes]:
        """The first manifest among `sources` that verifies. Banned sources are skipped, except
        `publisher` (the name of the learner's source), which is always asked."""
        limit = min(head.manifest_size, self.config.max_manifest_bytes)
        return await self._first_manifest(
            head.version, limit, sources, publisher, head.manifest_size,
            lambda data: verify_manifest(data, head, trusted=trusted, swarm=swarm, max_chunk_bytes=self.config.max_chunk_bytes),
        )

    async def fetch_linked_manifest(
        self, ref: BaseRef, sources: list[ChunkSource], *, trusted: PublicKey, swarm: str, publisher: str | None = None,
    ) -> tuple[Manifest, bytes]:
        """An older version's manifest named by a hash link (a delta's base, a keyframe), verified like
        `fetch_manifest` but against the link's sha256."""
        return await self._first_manifest(
            ref.version, self.config.max_manifest_bytes, sources, publisher, None,
            lambda data: verify_linked_manifest(data, ref, trusted=trusted, swarm=swarm,
                                                max_chunk_bytes=self.config.max_chunk_bytes),
        )

    async def _first_manifest(
        self, version: int, limit: int, sources: list[ChunkSource], publisher: str | None, size: int | None,
        verify: Callable[[bytes], Manifest],
    ) -> tuple[Manifest, bytes]:
        # Sources that answer busy (429, 503: a herd of followers that saw the same head at once) are
        # asked again after a short random pause, until fetch.manifest_timeout_s: not a failed fetch.
        deadline = time.monotonic() + self.config.manifest_timeout_s
        rounds = 0
        while True:
            last: Exception | None = None
            only_busy = True
            race = Race([(s, 0.0) for s in sources], lambda s, wait, p: s.manifest(version, limit, progress=p),
                        self.pace.delay_s(size), skip=lambda n, s: s.name != publisher and self.bans.banned(s.name),
                        stats=self.stats)
            try:
                while (request := await race.next()) is not None:
                    source = request.source
                    try:
                        data = request.task.result()
                        manifest = verify(data)
                    except SourceError as e:
                        busy = isinstance(e, SourceBusy)
                        self.stats["source_busy" if busy else "source_error"] += 1
                        only_busy = only_busy and busy
                        if isinstance(e, SourceFault):
                            self.stats[f"source_{e.reason}"] += 1
                            self._fault(source, e.reason, str(e), publisher)
                        elif isinstance(e, SourceUnreachable) and source.name != publisher:
                            self._fault(source, "unreachable", str(e), publisher)
                        last = e
                        continue
                    except ManifestError as e:
                        # A signed head but a bad manifest means the source lies: try the next one.
                        only_busy = False
                        self.stats[f"manifest_{e.reason}"] += 1
                        logger.warning("manifest v%d from %s refused: %s", version, source.name, e)
                        if e.reason == "hash_mismatch":  # not the bytes the head signs: this source's doing
                            self._fault(source, "bad_manifest", str(e), publisher)
                        last = e
                        continue
                    await self._won(race, request, f"manifest v{version}", publisher)
                    return manifest, data
            finally:
                self._cancelled(await race.close())
            if only_busy and last is not None and time.monotonic() < deadline:
                rounds += 1
                await asyncio.sleep(busy_pause_s(rounds))
                continue
            if isinstance(last, ManifestError):
                raise last
            raise FetchError(f"no source delivered manifest v{version}: {last}")

    def _keep(self, sha256: str, data: bytes, sink: Assembly | None) -> None:
        self.chunks.put(sha256, data)  # raises ChunkHashError before anything is kept
        if sink is not None:
            sink.write(sha256, data)

    async def _usable(
        self, route: list[tuple[ChunkSource, float]], publisher: str | None, deadline: float, version: int
    ) -> list[tuple[ChunkSource, float]]:
        """The route without banned sources. When only the learner is left and it is paused, wait out
        its pause (within the chunk's deadline) and ask it anyway: it is the last resort."""
        usable = [(s, w) for s, w in route if not self.bans.banned(s.name)]
        if usable:
            return usable
        last = next(((s, w) for s, w in route if s.name == publisher), None)
        if last is None:
            raise FetchError(f"v{version}: every source is banned or gone")
        pause = self.bans.remaining(last[0].name)
        if time.monotonic() + pause > deadline:
            raise FetchError(f"v{version}: every peer is banned and the learner is paused past the chunk's deadline")
        await asyncio.sleep(pause)
        return [last]

    async def _chunk_round(
        self, ref: ChunkRef, version: int, candidates: list[tuple[ChunkSource, float]], patience: ParentPatience,
        sink: Assembly | None, publisher: str | None, answers: Counter[str],
    ) -> str:
        """One round over a chunk's route, hedged (`Race`). Returns "done" (stored), "again" (ask the plan
        parent again shortly: it has not begun the version), "busy" (a source that may hold the chunk was
        full: asked again, not a failure) or "failed". Counts in `answers` what each source that did not
        deliver answered ("<name> <answer>")."""
        what = f"chunk {ref.sha256[:12]} of v{version}"
        busy = False
        # Banned meanwhile (by another chunk's request): skipped at its turn, unless it is all there is.
        race = Race(candidates, lambda s, wait, p: s.chunk(ref, wait=wait, version=version, progress=p),
                    self.pace.delay_s(ref.size), skip=lambda n, s: n > 0 and self.bans.banned(s.name), stats=self.stats)
        try:
            while (request := await race.next()) is not None:
                source, wait = request.source, request.wait
                try:
                    data = request.task.result()
                except SourceBusy:
                    self.stats["source_busy"] += 1
                    answers[f"{source.name} busy"] += 1
                    busy = True
                    continue
                except SourceUnreachable as e:
                    self.stats["source_unreachable"] += 1
                    answers[f"{source.name} unreachable"] += 1
                    self._fault(source, "unreachable", str(e), publisher)
                    continue
                except SourceMissing as e:
                    self.stats["source_missing"] += 1
                    if isinstance(e, SourceOffPath):  # it fetches or holds the version by another path
                        self.stats["source_off_path"] += 1
                        patience.off_path(source.name)
                    elif request.index == 0 and wait > 0 and patience.ask_again(source.name,
                                                                                 request.ended - request.asked, wait):
                        return "again"
                    answers[f"{source.name} {'off path' if isinstance(e, SourceOffPath) else 'not held'}"] += 1
                    continue
                except SourceError as e:
                    self.stats["source_error"] += 1
                    answers[f"{source.name} {getattr(e, 'reason', 'error')}"] += 1
                    if isinstance(e, SourceFault):
                        self.stats[f"source_{e.reason}"] += 1
                        self._fault(source, e.reason, f"{what}: {e}", publisher)
                    else:
                        logger.info("chunk %s: %s", ref.sha256[:12], e)
                    continue
                try:
                    await asyncio.to_thread(self._keep, ref.sha256, data, sink)
                except ChunkHashError:
                    self.stats["bad_chunk"] += 1
                    answers[f"{source.name} bad_chunk"] += 1
                    logger.warning("chunk %s of v%d from %s does not match its hash: refused, source banned",
                                   ref.sha256[:12], version, source.name)
                    self._fault(source, "bad_chunk", what, publisher)
                    continue
                await self._won(race, request, what, publisher, ref.size)
                self.stats["chunks_fetched"] += 1
                self.stats["bytes_fetched"] += ref.size
                self.bytes_from[source.name] += ref.size
                self.credit.delivered(source.name)
                if getattr(source, "peer_id", None):
                    self.served(source.peer_id)
                if wait > 0:
                    patience.begun(source.name)
                return "done"
        finally:
            self._cancelled(await race.close())
        return "busy" if busy else "failed"

    async def fetch_chunks(
        self, manifest: Manifest, route: Route, on_chunk: Callable[[str], None] = lambda sha: None,
        sink: Assembly | None = None, publisher: str | None = None, refs: list[ChunkRef] | None = None,
    ) -> int:
        """Fetch every chunk not yet stored, in manifest order (of `refs`: a delta path's chunks, else
        the manifest's default path). Returns the number fetched.

        Each chunk is hashed in memory, stored, and (with `sink`) written straight into the
        version's files being assembled. `publisher` names the learner's source: never banned,
        only paused (`SourceBans`).
        """
        refs = manifest.chunk_refs() if refs is None else refs
        missing = [(i, ref) for i, ref in enumerate(refs) if not self.chunks.has(ref.sha256)]
        self.bytes_from = Counter()
        slots = asyncio.Semaphore(self.config.parallel_chunks)
        patience = ParentPatience(self.config.source_wait_s, self.stats)

        async def fetch_one(index: int, ref: ChunkRef) -> None:
            rounds, busy_rounds, answers = 0, 0, Counter[str]()
            async with slots:
                deadline = time.monotonic() + self.config.chunk_timeout_s * self.config.attempts_per_chunk
                while True:
                    # sources that said they fetch or hold this version by another path: not asked again
                    candidates = [(s, w) for s, w in route(index, ref) if s.name == publisher or not patience.off(s.name)]
                    candidates = await self._usable(candidates, publisher, deadline, manifest.version)
                    outcome = await self._chunk_round(ref, manifest.version, candidates, patience, sink, publisher,
                                                      answers)
                    if outcome == "done":
                        on_chunk(ref.sha256)
                        return
                    if outcome == "again":
                        await asyncio.sleep(random.uniform(0.5, 1.0) * PARENT_RETRY_S)
                        continue
                    # A busy source is not failing, only full: asked again until the deadline (the others may
                    # have said "not held": a follower behind the swarm may find its chunks at the learner only).
                    busy_rounds += outcome == "busy"
                    rounds += outcome == "failed"
                    if rounds >= self.config.attempts_per_chunk or time.monotonic() > deadline:
                        said = ", ".join(f"{what} x{n}" for what, n in answers.most_common(MAX_ANSWERS_SAID))
                        raise FetchError(f"chunk {ref.sha256[:12]} of v{manifest.version} failed {rounds} rounds "
                                         f"({busy_rounds} busy) over its sources ({said or 'none asked'})")
                    if outcome == "busy":
                        await asyncio.sleep(busy_pause_s(busy_rounds))
                    else:
                        await asyncio.sleep(random.uniform(0.05, 0.25) * (1 + rounds))

        # gather, not a TaskGroup: callers get the FetchError itself rather than an ExceptionGroup.
        tasks = [asyncio.create_task(fetch_one(i, ref)) for i, ref in missing]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return len(missing)
