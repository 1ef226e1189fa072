"""hivemind's DHT traversal drops `Event.wait()` tasks unfinished: asyncio's "Task was destroyed but it is
pending!" for such a task is DEBUG, not an ERROR an operator chases; any other task's stays an ERROR."""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest

from echo2swarm.runtime.logging import DroppedWaiters

pytestmark = pytest.mark.timeout(30)


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def _never() -> None:
    await asyncio.Event().wait()


def _destroyed(make: str) -> list[logging.LogRecord]:
    """Start a task as hivemind's traversal does (`Event.wait()`), or a coroutine of our own, drop it
    pending, and return what the asyncio logger said when it was collected."""
    asyncio_log, root = logging.getLogger("asyncio"), logging.getLogger()
    handler, waiters, level = Records(), DroppedWaiters(), root.level
    asyncio_log.addHandler(handler)
    asyncio_log.addFilter(waiters)
    root.setLevel(logging.INFO)
    try:
        loop = asyncio.new_event_loop()
        coro = asyncio.Event().wait() if make == "event" else _never()
        loop.create_task(coro)
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()  # the task is still pending: collected below, asyncio logs it
        del coro
        gc.collect()
        return handler.records
    finally:
        root.setLevel(level)
        asyncio_log.removeFilter(waiters)
        asyncio_log.removeHandler(handler)


def test_a_dropped_event_waiter_is_not_logged_above_debug():
    assert _destroyed("event") == []  # dropped at INFO: the filter makes it DEBUG


def test_any_other_task_destroyed_pending_is_still_an_error():
    records = _destroyed("ours")
    assert [r.levelno for r in records] == [logging.ERROR]
    assert "Task was destroyed but it is pending!" in records[0].getMessage()
