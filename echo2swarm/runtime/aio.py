"""Small asyncio helpers shared by the daemon's loops."""

from __future__ import annotations

import asyncio


async def wait_any(*events: asyncio.Event, timeout: float) -> bool:
    """Wait until any event is set or `timeout` passes; returns whether one was set.

    The waiter tasks are cancelled and awaited before returning: leaving cancelled tasks behind
    unawaited makes asyncio log "Task was destroyed but it is pending" when they are collected.
    """
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        done, _ = await asyncio.wait(waiters, timeout=max(0.0, timeout), return_when=asyncio.FIRST_COMPLETED)
        return bool(done)
    finally:
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
