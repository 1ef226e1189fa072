"""Periodic re-announcement of a peer's records, so they outlive no daemon by more than one TTL."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from echo2swarm.runtime.aio import wait_any
from echo2swarm.runtime.logging import Recurring, get_logger

logger = get_logger(__name__)
LATE_REPORT_S = 60.0  # a slow announcer warns once, then once a minute with how often it was slow


class Announcer:
    """Calls `announce()` every `period` seconds, and soon after `trigger()` is called.

    Triggers are coalesced: an announcement starts at most once per `min_gap` seconds, so a
    peer whose state changes many times a second (a fast learner publishing every step) stores
    one card per gap, not one per change.

    >>> announcer = Announcer(10.0, publish_my_card)
    >>> task = asyncio.create_task(announcer.run(stop_event))
    >>> announcer.trigger()          # e.g. right after a new version is installed
    """

    def __init__(self, period: float, announce: Callable[[], Awaitable[None]], name: str = "records",
                 min_gap: float = 0.5):
        self.period = period
        self.min_gap = min(min_gap, period)
        self.announce = announce
        self.name = name
        self._wake = asyncio.Event()
        self.announcements = 0
        self._overran = Recurring(logger, LATE_REPORT_S)
        self._late = Recurring(logger, LATE_REPORT_S)

    def trigger(self) -> None:
        self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            started = time.monotonic()
            self._wake.clear()  # before announcing: a trigger during the announcement is not lost
            try:
                await asyncio.wait_for(self.announce(), self.period)
                self.announcements += 1
            except asyncio.TimeoutError:
                self._overran(f"announcing {self.name} took longer than the {self.period:g} s period")
            except Exception as e:
                logger.warning("announcing %s failed: %s: %s", self.name, type(e).__name__, e)
            took = time.monotonic() - started
            if took > 0.5 * self.period:  # a loaded machine or a slow DHT: said once, then counted a minute
                logger.debug("announcing %s took %.2f s of a %g s period", self.name, took, self.period)
                self._late(f"announcing {self.name} is running late (over half of its {self.period:g} s period)")
            await wait_any(stop, self._wake, timeout=self.period - took)
            gap = self.min_gap - (time.monotonic() - started)
            if gap > 0 and not stop.is_set():  # woken early by a trigger: let more changes pile up
                await wait_any(stop, timeout=gap)
