"""A failure that keeps recurring is logged once, then once a minute with its count (runtime/logging.py)."""

from __future__ import annotations

import logging

import pytest

from echo2swarm.runtime.logging import Recurring


def test_a_recurring_warning_is_logged_once_then_a_line_a_period_with_its_count(caplog: pytest.LogCaptureFixture):
    now = [0.0]
    warn = Recurring(logging.getLogger("test.recurring"), 60.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="test.recurring"):
        for t in range(0, 150, 10):  # every 10 s for 150 s
            now[0] = float(t)
            warn("lease request failed: timed out")
        now[0] = 151.0
        warn("lease request failed: refused")  # another problem: at once
        warn("lease request failed: refused")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["lease request failed: timed out",
                     "lease request failed: timed out (again 6 times in the last 60 s)",
                     "lease request failed: timed out (again 6 times in the last 60 s)",
                     "lease request failed: refused"]
