"""Hedged requests: a source slower than the recent median gets a second request beside it.

    route ─► Race: ask route[0] ──(ran past the hedge delay)──► ask route[1] as well ──► ... (one more per delay)
                   the first answer that verifies wins ─► the rest are cancelled, their bytes counted as duplicates
    Pace: how long the last PACE_WINDOW verified chunks took ─► the hedge delay of the next requests

A request's clock starts when it is sent or, for one a plan parent may hold until it has the chunk
itself (`wait` > 0), when its body begins: the hold is the chain's pipelining, not slowness. It is
hedged once it has run `fetch.hedge_after` times the recent median chunk time (each sample scaled
up to the chunk's size where it was smaller), at least `fetch.hedge_min_s`; before this follower
has fetched any chunk, after `fetch.min_rate_grace_s`. A slow source therefore costs one delay and a
duplicate request, however fresh its identity, rather than a stall until the minimum-rate rule cuts
it off (BitTorrent's end game, for any request that lags). The median is this follower's own
measurement of the verified chunks it received, so no peer's claim steers it.

A request outpaced by a later one whose body brought less than `fetch.min_rate_bps` over its age is
slow by the rule of `sources.MinRate`, with the race as proof in place of the grace (`outpaced_slow`).
The grace is earned instead (`RaceCredit`): each chunk a source delivered lets it lose one such race
unbanned (an honest peer whose upload queue held one transfer back), up to twice the chunks in
flight; a source with no credit, a fresh identity first of all, is banned as any slow one is.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from echo2swarm.config.models import FetchConfig
from echo2swarm.policy.sources import ChunkSource, Progress

PACE_WINDOW = 64  # verified chunks whose times make the median (this version's and the last ones')
MAX_CREDIT_RECORDS = 1024  # sources whose race credit a follower remembers (past that, the stalest is forgotten)


class Pace:
    """How long recent verified chunks took, and the hedge delay that follows.

    >>> pace = Pace(FetchConfig(hedge_after=4.0, hedge_min_s=0.5))
    >>> pace.record(0.25, 1 << 20)
    >>> pace.delay_s(1 << 20), pace.delay_s(2 << 20), pace.delay_s(1 << 10)
    (1.0, 2.0, 1.0)
    """

    def __init__(self, config: FetchConfig, window: int = PACE_WINDOW):
        self.config = config
        self.samples: deque[tuple[float, int]] = deque(maxlen=window)  # (seconds, bytes)

    def record(self, seconds: float, size: int) -> None:
        self.samples.append((max(0.0, seconds), max(1, size)))

    def expected_s(self, size: int | None) -> float | None:
        """The median of the recent chunk times, each scaled up to `size` bytes where its chunk was smaller
        (`size` None: as they are); None before the first sample."""
        if not self.samples:
            return None
        return statistics.median(s * max(1.0, size / n) if size else s for s, n in self.samples)

    def delay_s(self, size: int | None) -> float | None:
        """Seconds a request for `size` bytes runs before it is hedged; None: never (`fetch.hedge_after` 0)."""
        config = self.config
        if config.hedge_after <= 0:
            return None
        expected = self.expected_s(size)
        if expected is None:
            return max(config.hedge_min_s, config.min_rate_grace_s)
        return max(config.hedge_min_s, config.hedge_after * expected)


class RaceCredit:
    """Races a source may lose below the minimum rate without a ban: one per verified chunk it delivered,
    at most `cap`; none for a source that never delivered (a new key starts with nothing to spend).

    >>> credit = RaceCredit(cap=2)
    >>> credit.spend("relay:new")                       # no credit: ban it
    False
    >>> for _ in range(5): credit.delivered("relay:old")
    >>> credit.spend("relay:old"), credit.spend("relay:old"), credit.spend("relay:old")
    (True, True, False)
    """

    def __init__(self, cap: int, max_records: int = MAX_CREDIT_RECORDS):
        self.cap = cap
        self.max_records = max_records
        self._credit: OrderedDict[str, int] = OrderedDict()

    def delivered(self, name: str) -> None:
        self._credit[name] = min(self.cap, self._credit.get(name, 0) + 1)
        self._credit.move_to_end(name)
        while len(self._credit) > self.max_records:
            self._credit.popitem(last=False)

    def spend(self, name: str) -> bool:
        """`name` lost a race below the minimum rate: True if its credit covers it (one is spent)."""
        left = self._credit.get(name, 0)
        if left <= 0:
            self._credit.pop(name, None)
            return False
        self._credit[name] = left - 1
        return True


def outpaced_slow(progress: Progress, now: float, rate_bps: int) -> bool:
    """A request that a later one outpaced: did its body bring less than `rate_bps` over its age? One that
    has not begun (a held request still waiting for its chunk) is not slow; `rate_bps` 0: no minimum."""
    if rate_bps <= 0 or progress.begun_at is None:
        return False
    return progress.received < rate_bps * (now - progress.begun_at)


@dataclass(eq=False)
class Request:
    """One request of a race: its place in the route, whether it was a hedge (sent while an earlier
    one was still in flight), what its source reported, and its task (whose result is the body)."""

    index: int
    source: ChunkSource
    wait: float
    hedge: bool
    progress: Progress
    task: asyncio.Task[bytes]
    asked: float  # monotonic seconds
    ended: float = 0.0


Ask = Callable[[ChunkSource, float, Progress], Awaitable[bytes]]


class Race:
    """The requests for one chunk or manifest over its route. The next source is asked when nothing is
    in flight (the last one failed), or when the newest request has run past `delay_s` (a hedge,
    counted in `stats["hedges_fired"]`). `skip(index, source)` passes over a source at its turn.

        race = Race(route, lambda source, wait, progress: source.chunk(ref, wait, v, progress), delay_s)
        try:
            while (request := await race.next()) is not None:
                data = request.task.result()  # raises what the source raised: handle it, `continue`
                ...                           # the first copy that verifies: `break`
        finally:
            cancelled = await race.close()    # what is still in flight, as far as it came
    """

    def __init__(self, route: list[tuple[ChunkSource, float]], ask: Ask, delay_s: float | None,
                 skip: Callable[[int, ChunkSource], bool] = lambda index, source: False,
                 stats: Counter[str] | None = None):
        self.route = route
        self.ask = ask
        self.delay_s = delay_s
        self.skip = skip
        self.stats: Counter[str] = stats if stats is not None else Counter()
        self.in_flight: list[Request] = []
        self._next = 0  # the next place in the route to ask
        self._begun = asyncio.Event()  # a body began: the newest request's clock may have started

    def _launch(self) -> bool:
        while self._next < len(self.route):
            index, (source, wait) = self._next, self.route[self._next]
            self._next += 1
            if self.skip(index, source):
                continue
            progress = Progress(self._begun.set)
            if wait <= 0:
                progress.begin()  # not held: its clock runs from now
            hedge = bool(self.in_flight)
            task = asyncio.create_task(self.ask(source, wait, progress))
            self.in_flight.append(Request(index, source, wait, hedge, progress, task, time.monotonic()))
            if hedge:
                self.stats["hedges_fired"] += 1
            return True
        return False

    def _due(self, request: Request) -> float | None:
        """When `request` is to be hedged (monotonic); None: not while its body has not begun, or never."""
        if self.delay_s is None or request.progress.begun_at is None:
            return None
        return request.progress.begun_at + self.delay_s

    async def next(self) -> Request | None:
        """The next request to end (its task done), asking further sources meanwhile as the rules say;
        None once every source of the route was asked and none is in flight."""
        while True:
            for request in self.in_flight:
                if request.task.done():
                    self.in_flight.remove(request)
                    request.ended = time.monotonic()
                    return request
            newest = self.in_flight[-1] if self.in_flight else None
            due = None if newest is None else self._due(newest)
            now = time.monotonic()
            more = self._next < len(self.route)
            if more and (newest is None or (due is not None and due <= now)) and self._launch():
                continue
            if newest is None:
                return None
            waits: set[asyncio.Future[object]] = {r.task for r in self.in_flight}
            begun: asyncio.Future[object] | None = None
            if more and self.delay_s is not None and due is None:  # held: its clock starts when its body begins
                self._begun.clear()
                begun = asyncio.ensure_future(self._begun.wait())
                waits.add(begun)
            try:
                await asyncio.wait(waits, timeout=None if due is None or not more else max(0.0, due - now),
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                if begun is not None:
                    begun.cancel()

    async def close(self) -> list[Request]:
        """Cancel the requests still in flight and return them (their `progress` as far as they came)."""
        cancelled, self.in_flight = self.in_flight, []
        for request in cancelled:
            request.task.cancel()
        await asyncio.gather(*(r.task for r in cancelled), return_exceptions=True)
        return cancelled
