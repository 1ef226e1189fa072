"""The uplink meter: only windows busy from start to end count; a high percentile of them is the estimate."""

from __future__ import annotations

import pytest

from echo2swarm.policy.uplink import UplinkMeter


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _upload(meter: UplinkMeter, clock: Clock, seconds: float, rate: float, block_s: float = 0.1) -> None:
    with meter.transfer():
        for _ in range(round(seconds / block_s)):
            clock.t += block_s
            meter.sent(int(rate * block_s))


def test_unmeasured_until_enough_busy_windows() -> None:
    clock = Clock()
    meter = UplinkMeter(window_s=1.0, min_windows=2, clock=clock)
    assert meter.estimate() is None
    _upload(meter, clock, 1.5, 1e6)  # starts at a window's start: one whole busy window
    assert meter.estimate() is None
    _upload(meter, clock, 3.0, 1e6)
    assert meter.estimate() == pytest.approx(1e6, rel=0.15)


def test_a_mostly_idle_window_does_not_count() -> None:
    clock = Clock()
    meter = UplinkMeter(window_s=1.0, min_windows=1, clock=clock)
    for _ in range(10):  # 70 % of every window idle: too little to learn the line's rate from
        _upload(meter, clock, 0.3, 4e6)
        clock.t += 0.7
    assert meter.estimate() is None


def test_short_gaps_between_chunk_requests_still_measure_the_line() -> None:
    clock = Clock()
    meter = UplinkMeter(window_s=2.0, min_windows=2, clock=clock)
    for _ in range(40):  # 0.25 s chunks at 1 MB/s, 20 ms between requests
        _upload(meter, clock, 0.25, 1e6, block_s=0.05)
        clock.t += 0.02
    assert meter.estimate() == pytest.approx(1e6, rel=0.1)


def test_a_long_idle_stretch_is_skipped_not_counted() -> None:
    clock = Clock()
    meter = UplinkMeter(window_s=1.0, min_windows=2, clock=clock)
    _upload(meter, clock, 3.0, 2e6)
    clock.t += 1e6  # idle for days: no loop over the windows in between, nothing appended
    _upload(meter, clock, 3.0, 2e6)
    assert meter.estimate() == pytest.approx(2e6, rel=0.1)
    assert len(meter.rates) <= 6


def test_sustained_rate_not_one_burst() -> None:
    clock = Clock()
    meter = UplinkMeter(window_s=1.0, keep=30, min_windows=2, clock=clock)
    with meter.transfer():
        clock.t += 0.999
        meter.sent(50_000_000)  # one burst into socket buffers in the first window
        for _ in range(200):
            clock.t += 0.1
            meter.sent(200_000)  # then 2 MB/s sustained
    assert meter.estimate() == pytest.approx(2e6, rel=0.15)


def test_concurrent_transfers_add_up() -> None:
    clock = Clock()
    meter = UplinkMeter(window_s=1.0, min_windows=2, clock=clock)
    with meter.transfer(), meter.transfer():
        for _ in range(50):
            clock.t += 0.1
            meter.sent(100_000)
            meter.sent(100_000)
    assert meter.estimate() == pytest.approx(2e6, rel=0.15)


def test_bad_settings_refused() -> None:
    with pytest.raises(ValueError):
        UplinkMeter(window_s=0)
    with pytest.raises(ValueError):
        UplinkMeter(keep=2, min_windows=3)
