"""One logging setup for every entry point: levelled, timestamped, `key=value` friendly lines on stderr."""

from __future__ import annotations

import logging
import sys

_CONFIGURED = False
_NOISY = ("hivemind", "asyncio", "aiohttp.access", "urllib3", "filelock")


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)


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
        _CONFIGURED = True
    if quiet_libraries:
        for name in _NOISY:
            logging.getLogger(name).setLevel(logging.WARNING)
