"""Human-friendly byte sizes (`8MiB`, `16 MB`, `512k`) for sizes and rates in flags and TOML."""

from __future__ import annotations

import math
import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gib": 1024**3,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str) -> int:
    """Parse a byte count; raises ValueError naming the accepted units."""
    if isinstance(value, bool):
        raise ValueError("a byte size must be a number or a string like '8MiB'")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value < 0:
            raise ValueError("a byte size must be a finite number >= 0")
        return int(value)
    match = _SIZE.fullmatch(str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{value!r} is not a byte size; use e.g. 8388608, '8MiB', '16MB', '512KiB'")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
