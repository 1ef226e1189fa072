"""A slow announcer says so once, then once a minute with a count: under load (a busy machine, a slow
DHT) it was a warning every period in every daemon's log."""

from __future__ import annotations

import asyncio
import logging

import pytest

from echo2swarm.overlay.announcer import Announcer

pytestmark = pytest.mark.timeout(30)


def test_a_late_announcer_warns_once_not_every_period(caplog: pytest.LogCaptureFixture):
    async def scenario() -> int:
        stop = asyncio.Event()

        async def slow() -> None:
            await asyncio.sleep(0.03)  # the slow announcement itself: 60 % of the period, every time

        announcer = Announcer(0.05, slow, name="test card", min_gap=0.0)
        task = asyncio.create_task(announcer.run(stop))
        while announcer.announcements < 6:
            await asyncio.sleep(0.01)  # poll interval of a bounded wait (the test's timeout)
        stop.set()
        await task
        return announcer.announcements

    with caplog.at_level(logging.DEBUG, logger="echo2swarm.overlay.announcer"):
        assert asyncio.run(scenario()) >= 6
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warnings] == ["announcing test card is running late (over half of its 0.05 s period)"]
    late = [r for r in caplog.records if r.levelno == logging.DEBUG and "of a 0.05 s period" in r.getMessage()]
    assert len(late) >= 5  # every late round, at DEBUG
