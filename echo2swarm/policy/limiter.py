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
    def __init__(self, rate: float | None, burst: int = 256 * 1024):
        if rate is not None and rate <= 0:
            raise ValueError("rate must be positive bytes/s, or None for unlimited")
        self.rate = rate
        # A burst no larger than one write block keeps the cap tight over sub-second windows.
        self.burst = float(burst)
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
