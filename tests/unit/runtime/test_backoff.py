"""The pause a daemon loop takes after failures (a rollout peer's engine, a follower's fetch): short
after one failure (a killed engine process is replaced within seconds), doubling while the
failures go on, and bounded."""

from __future__ import annotations

import pytest

from echo2swarm.runtime.aio import BACKOFF_MAX_S, backoff_s

pytestmark = pytest.mark.timeout(30)


def test_one_failure_pauses_for_the_base_and_each_further_one_doubles_it() -> None:
    assert [backoff_s(n, 1.0) for n in range(1, 6)] == [1.0, 2.0, 4.0, 8.0, 16.0]
    assert backoff_s(3, 0.25) == 1.0


def test_the_pause_is_bounded_however_long_the_engine_keeps_failing() -> None:
    assert backoff_s(7, 1.0) == BACKOFF_MAX_S
    assert backoff_s(10_000, 1.0) == BACKOFF_MAX_S  # no float overflow
    assert backoff_s(1, 500.0) == BACKOFF_MAX_S


def test_zero_failures_is_refused() -> None:
    with pytest.raises(ValueError, match="failures"):
        backoff_s(0, 1.0)
