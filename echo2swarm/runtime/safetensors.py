"""Where each tensor of a safetensors file lies, from its header, checked as hostile input.

The followers' delta catch-up (policy/catchup.py) and the verifier's streamed forwards
(train/streamed.py) read tensors straight from a file's bytes; both take the layout from here, so
a header whose ranges leave the file, disagree with their dtype and shape, or overlap is refused
in one place (ValueError naming the file).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ITEMSIZE", "MAX_HEADER", "TensorSlot", "safetensors_layout"]

MAX_HEADER = 100 * 1024 * 1024
"""Bytes: the largest JSON header accepted (safetensors' own limit)."""

ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
"""Bytes per element of the dtypes a layout may name."""


@dataclass(frozen=True)
class TensorSlot:
    """One tensor of a safetensors file: dtype (as the file names it), shape, its bytes' place in the file."""

    dtype: str
    shape: list[int]
    start: int
    end: int


def safetensors_layout(path: Path, size: int) -> dict[str, TensorSlot]:
    """The tensors of the file at `path` (`size` bytes long) by name. ValueError("<file>: ...") when it
    is not safetensors, or a tensor's range is outside the file, does not match its dtype and shape,
    or overlaps another."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        header_len = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if not 0 < header_len <= min(size - 8, MAX_HEADER):
            raise ValueError(f"{path.name}: not a safetensors file")
        header = f.read(header_len)
    try:
        entries = json.loads(header)
        data_start = 8 + header_len
        slots = {}
        for name, v in entries.items():
            if name == "__metadata__":
                continue
            start, end = (data_start + int(o) for o in v["data_offsets"])
            shape = [int(d) for d in v["shape"]]
            numel = 1
            for d in shape:
                numel *= d
            if v["dtype"] not in ITEMSIZE or min(shape, default=0) < 0 or not data_start <= start <= end <= size \
                    or end - start != numel * ITEMSIZE[v["dtype"]]:
                raise ValueError(f"tensor {name[:80]!r}: bad dtype or range")
            slots[name] = TensorSlot(v["dtype"], shape, start, end)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"{path.name}: unreadable safetensors header ({e})") from None
    ranges = sorted((s.start, s.end) for s in slots.values())
    if any(a_end > b_start for (_, a_end), (b_start, _) in zip(ranges, ranges[1:])):
        raise ValueError(f"{path.name}: tensors overlap")
    return slots
