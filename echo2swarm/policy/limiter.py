"""Upload pacing: one token bucket per daemon caps the bytes/s it uploads, over all transfers.

Contributors cap their uplink with `--upload-limit`; the broadcast benchmark uses the same cap
to emulate WAN links on loopback. Writers queue on a FIFO lock, so concurrent transfers share
the rate fairly instead of one stream starving the rest.

    limiter = RateLimiter(16 * 2**20)        # 16 MiB/s
    await limiter.take(len(block))           # before each write; returns at once when unlimited
"""

from __future__ import annotations

import asyncio
import time


class RateLimiter:
    def __init__(self, rate: float | None, burst: int | None = None):
        if rate is not None and rate <= 0:
            raise ValueError("rate must be positive bytes/s, or None for unlimited")
        self.rate = rate
        # One write block (256 KiB), or 50 ms of the rate where that is more: a writer that a busy
        # host wakes up late is credited for the lateness instead of losing uplink it was owed, and
        # the cap still holds to within one burst over any window.
        self.burst = float(burst if burst is not None else max(256 * 1024, (rate or 0) * 0.05))
        self._tokens = self.burst
        self._stamp = time.monotonic()
        self._lock = asyncio.Lock()
        self.bytes_total = 0

    async def take(self, n: int) -> None:
        self.bytes_total += n
        if self.rate is None:
            return
        async with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            self._tokens -= n
            if self._tokens < 0:
                # Sleep off the debt while holding the lock: later writers queue behind us in order.
                await asyncio.sleep(-self._tokens / self.rate)
