"""Small asyncio helpers shared by the daemon's loops, and the back-off they retry with."""

from __future__ import annotations

import asyncio

BACKOFF_MAX_S = 60.0  # the longest pause a loop takes after consecutive failures


def backoff_s(failures: int, base_s: float, max_s: float = BACKOFF_MAX_S) -> float:
    """Seconds to pause after `failures` consecutive failures (≥ 1): `base_s` after the first,
    doubling with each one after it, at most `max_s`."""
    if failures < 1:
        raise ValueError(f"failures must be >= 1, got {failures}")
    return min(max_s, base_s * 2.0 ** min(failures - 1, 32))


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
