"""Measured uplink: the bytes/s this peer's uploads sustain while it is uploading.

A configured cap (`--upload-limit`) says what a contributor allows, not what its line carries: a
home on a 20 Mbit/s uplink with no cap would otherwise count as the fastest peer in every plan.
The meter cuts time into windows of `window_s` and keeps, per window, the bytes whose writes
returned in it and the time some upload was in progress. A window busy for at least
`MIN_BUSY_FRACTION` of it (chunks are sent one request after another, so there are short gaps) is a
*busy* window, and bytes / busy time is what the line carried while our own demand filled it. The
estimate is the median of the last `keep` busy windows (a first window that filled the socket
buffers at memory speed counts for no more than one window); None until `min_windows` of them.

It is a lower bound where the receivers, or the data arriving to be forwarded, were the bottleneck,
and a peer that never uploads is never measured: the broadcast plan then counts on its cap (fastest
when uncapped), so a newcomer is tried early in a chain and measured there.

    meter = UplinkMeter()
    with meter.transfer():          # around each chunk upload
        meter.sent(len(block))      # after each block
    card.uplink_bps = meter.estimate()
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator

WINDOW_S = 2.0
KEEP = 30
MIN_WINDOWS = 2
MIN_BUSY_FRACTION = 0.5


class UplinkMeter:
    def __init__(self, window_s: float = WINDOW_S, keep: int = KEEP, min_windows: int = MIN_WINDOWS,
                 clock: Callable[[], float] = time.monotonic):
        if window_s <= 0 or keep < 1 or not 1 <= min_windows <= keep:
            raise ValueError("window_s > 0 and 1 <= min_windows <= keep")
        self.window_s = window_s
        self.min_windows = min_windows
        self.clock = clock
        self.rates: deque[float] = deque(maxlen=keep)
        self.active = 0
        now = clock()
        self._end = (math.floor(now / window_s) + 1) * window_s  # end of the current window
        self._last = now    # time accounted up to
        self._bytes = 0     # bytes whose write returned in the current window
        self._busy = 0.0    # seconds of the current window with some upload in progress

    def _advance(self) -> None:
        """Account time up to now, closing every window that ended."""
        now = self.clock()
        while now >= self._end:
            if self.active:
                self._busy += self._end - self._last
            if self._bytes and self._busy >= MIN_BUSY_FRACTION * self.window_s:
                self.rates.append(self._bytes / self._busy)
            self._last, self._bytes, self._busy = self._end, 0, 0.0
            # Whole windows with no block finished in them teach nothing: skip them at once.
            skipped = math.floor((now - self._end) / self.window_s)
            self._end += (skipped + 1) * self.window_s
            if skipped:
                self._last = self._end - self.window_s
        if self.active:
            self._busy += now - self._last
        self._last = now

    @contextlib.contextmanager
    def transfer(self) -> Iterator[None]:
        """Hold around one upload: the time it is in progress counts as busy."""
        self._advance()
        self.active += 1
        try:
            yield
        finally:
            self._advance()
            self.active -= 1

    def sent(self, n: int) -> None:
        self._advance()
        self._bytes += n

    def estimate(self) -> int | None:
        """Sustained upload bytes/s (the median busy window), None until measured."""
        self._advance()
        if len(self.rates) < self.min_windows:
            return None
        return int(statistics.median(self.rates))
