"""Measured quantities the control loop plans with: EWMAs of T_train, T_bcast, L_gen and per-peer µ."""

from __future__ import annotations

import math


class Ewma:
    """Exponentially weighted moving average; `value` is None until the first sample.

    >>> e = Ewma(alpha=0.5); _ = e.add(2.0); _ = e.add(4.0); e.value
    3.0
    """

    def __init__(self, alpha: float = 0.3):
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.value: float | None = None
        self.samples = 0

    def add(self, sample: float) -> float:
        if not math.isfinite(sample):
            return self.value if self.value is not None else math.nan
        self.value = sample if self.value is None else (1 - self.alpha) * self.value + self.alpha * sample
        self.samples += 1
        return self.value
