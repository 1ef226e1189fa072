"""One logging setup for every entry point: levelled, timestamped, `key=value` friendly lines on stderr."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable

_CONFIGURED = False
_NOISY = ("hivemind", "asyncio", "aiohttp.access", "urllib3", "filelock")


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)


class DroppedWaiters(logging.Filter):
    """asyncio's "Task was destroyed but it is pending!" for a bare `Event.wait()` task, as DEBUG.

    hivemind's DHT traversal (`hivemind/dht/traverse.py`, each worker's `await_finished_task`) starts
    an `Event.wait()` task per request and drops it unfinished; every DHT read then logs one such
    ERROR per worker when the task is collected. Harmless (the event is the search's own), and not
    ours: our waiters are cancelled and awaited (`runtime.aio.wait_any`). Any other task destroyed
    pending is still an ERROR."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("Task was destroyed but it is pending!") and "coro=<Event.wait()" in message:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger().isEnabledFor(logging.DEBUG)
        return True


def setup_logging(level: str | int = "INFO", *, quiet_libraries: bool = True) -> None:
    """Configure the root logger once; later calls only change the level."""
    global _CONFIGURED
    root = logging.getLogger()
    root.setLevel(level)
    if not _CONFIGURED:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(
            logging.Formatter("%(asctime)s.%(msecs)03d %(levelname)-5s %(name)s: %(message)s", "%H:%M:%S")
        )
        root.handlers[:] = [handler]
        logging.getLogger("asyncio").addFilter(DroppedWaiters())
        _CONFIGURED = True
    if quiet_libraries:
        for name in _NOISY:
            logging.getLogger(name).setLevel(logging.WARNING)


class Recurring:
    """Warns once per distinct message; while the same one recurs, once per `period_s` with how often it did.

    A retry loop that logged every failure would flood the log; one that logged only the first left an
    operator looking at one warning and then silence while the failure went on for hours.

    >>> warn = Recurring(logger, 60.0)
    >>> warn("lease request failed: timed out")   # logged
    >>> warn("lease request failed: timed out")   # counted; logged with its count a minute after the last line
    """

    def __init__(self, log: logging.Logger, period_s: float, clock: Callable[[], float] = time.monotonic):
        self.log, self.period_s, self.clock = log, period_s, clock
        self.last = ""
        self._repeats, self._since = 0, 0.0

    def __call__(self, message: str) -> None:
        now = self.clock()
        if message != self.last:
            self.log.warning("%s", message)
            self.last, self._repeats, self._since = message, 0, now
            return
        self._repeats += 1
        if now - self._since >= self.period_s:
            self.log.warning("%s (again %d times in the last %.0f s)", message, self._repeats, now - self._since)
            self._repeats, self._since = 0, now
