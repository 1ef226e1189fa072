"""Sparse deltas between two policy versions: which bit patterns changed, and their new values.

    blob = encode_delta(base, new)              # base, new: {name: CPU tensor}, same names/dtypes/shapes
    rebuilt = apply_delta(base, blob)           # bit-identical to `new`; DeltaError on anything malformed
    tensor_sha256(rebuilt[name])                # what a manifest carries per resulting tensor

A delta is exact: it compares bit patterns, not values (so -0.0 vs 0.0 and NaN payloads are
changes like any other), and rebuilding gives the same bytes as the learner's dense tensor.

Format "e2s-delta/1" (a zstandard frame around):

    u32 magic "E2SD" | u16 format 1 | u32 n_tensors
    per tensor, in name order:
      u16 name_len | name (utf-8) | u8 itemsize (1, 2, 4 or 8) | u64 numel | u64 n_changed
      n_changed index gaps as LEB128 varints (first gap from -1: index = previous + gap)
      n_changed XOR words (itemsize bytes each, little-endian): new = base XOR word

Pure: no network, no disk. Every length is bounded by what the base tensors say, so a hostile
blob costs at most one decompression bounded by `max_bytes` and raises DeltaError.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping

import numpy as np
import torch
import zstandard

DELTA_FORMAT = "e2s-delta/1"
_MAGIC = b"E2SD"
_VERSION = 1
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
ZSTD_LEVEL = 3


class DeltaError(ValueError):
    """A delta that must not be applied. `reason` is a short counter label."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def tensor_bits(t: torch.Tensor) -> np.ndarray:
    """The tensor's bit patterns as a flat unsigned-integer array of its item size (a view when possible)."""
    t = t.detach().contiguous().cpu()
    raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)
    return raw.view(_UINT[t.element_size()])


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of the tensor's raw bytes (contiguous, little-endian, as safetensors stores them)."""
    return hashlib.sha256(tensor_bits(t).tobytes()).hexdigest()


def _varints(values: np.ndarray) -> bytes:
    out = bytearray()
    for v in values.tolist():
        while v >= 0x80:
            out.append((v & 0x7F) | 0x80)
            v >>= 7
        out.append(v)
    return bytes(out)


def _read_varints(buf: memoryview, pos: int, count: int) -> tuple[np.ndarray, int]:
    out = np.empty(count, dtype=np.uint64)
    for i in range(count):
        value = shift = 0
        while True:
            if pos >= len(buf) or shift > 63:
                raise DeltaError("malformed", "index varint runs past the end of the delta")
            byte = buf[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                break
            shift += 7
        out[i] = value
    return out, pos


def encode_delta(base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> bytes:
    """The delta that turns `base` into `new` (same tensor names, dtypes and shapes)."""
    if set(base) != set(new):
        raise ValueError(f"tensor names differ: {sorted(set(base) ^ set(new))[:5]}")
    parts = [_MAGIC, struct.pack("<HI", _VERSION, len(new))]
    for name in sorted(new):
        b, n = base[name], new[name]
        if b.dtype != n.dtype or tuple(b.shape) != tuple(n.shape):
            raise ValueError(f"{name}: base {b.dtype}{tuple(b.shape)} vs new {n.dtype}{tuple(n.shape)}")
        xor = np.bitwise_xor(tensor_bits(b), tensor_bits(n))
        changed = np.flatnonzero(xor)
        gaps = np.diff(changed, prepend=-1).astype(np.uint64) if changed.size else np.zeros(0, np.uint64)
        encoded = name.encode()
        parts += [struct.pack("<H", len(encoded)), encoded,
                  struct.pack("<BQQ", n.element_size(), n.numel(), changed.size),
                  _varints(gaps), xor[changed].astype(xor.dtype.newbyteorder("<")).tobytes()]
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(b"".join(parts))


def max_delta_bytes(base: Mapping[str, torch.Tensor]) -> int:
    """An upper bound on a valid delta's decompressed size against `base` (header + worst-case payload)."""
    bound = 10
    for name, t in base.items():
        bound += 2 + len(name.encode()) + 17 + t.numel() * (10 + t.element_size())
    return bound


def apply_delta(base: Mapping[str, torch.Tensor], blob: bytes) -> dict[str, torch.Tensor]:
    """`base` with the delta applied: new tensors (base is not modified). DeltaError if malformed."""
    try:
        raw = zstandard.ZstdDecompressor().decompress(blob, max_output_size=max_delta_bytes(base))
    except zstandard.ZstdError as e:
        raise DeltaError("malformed", f"delta is not a valid zstandard frame within its size bound: {e}") from None
    buf = memoryview(raw)
    if bytes(buf[:4]) != _MAGIC or len(buf) < 10:
        raise DeltaError("malformed", "not an e2s-delta blob")
    version, count = struct.unpack_from("<HI", buf, 4)
    if version != _VERSION:
        raise DeltaError("format", f"delta format {version}, we read {_VERSION}")
    if count != len(base):
        raise DeltaError("wrong_base", f"delta has {count} tensors, the base has {len(base)}")
    pos, out = 10, {}
    try:
        for _ in range(count):
            (name_len,) = struct.unpack_from("<H", buf, pos)
            name = bytes(buf[pos + 2:pos + 2 + name_len]).decode()
            pos += 2 + name_len
            if name not in base or name in out:
                raise DeltaError("wrong_base", f"delta names tensor {name[:80]!r}, which the base lacks or repeats")
            itemsize, numel, n_changed = struct.unpack_from("<BQQ", buf, pos)
            pos += 17
            t = base[name]
            if itemsize != t.element_size() or numel != t.numel() or n_changed > numel:
                raise DeltaError("wrong_base", f"{name}: delta for {numel} items of {itemsize} bytes, "
                                 f"base has {t.numel()} of {t.element_size()}")
            gaps, pos = _read_varints(buf, pos, n_changed)
            index = np.cumsum(gaps, dtype=np.uint64) - np.uint64(1) if n_changed else gaps
            if n_changed and (gaps[1:] == 0).any() or (n_changed and (gaps[0] == 0 or index[-1] >= numel)):
                raise DeltaError("malformed", f"{name}: change positions out of order or out of range")
            words = np.frombuffer(buf, dtype=np.dtype(_UINT[itemsize]).newbyteorder("<"), count=n_changed, offset=pos)
            pos += n_changed * itemsize
            bits = tensor_bits(t).copy()
            bits[index.astype(np.int64)] ^= words.astype(bits.dtype)
            out[name] = torch.from_numpy(bits.view(np.uint8)).view(t.dtype).reshape(t.shape)
    except (struct.error, UnicodeDecodeError, ValueError) as e:
        if isinstance(e, DeltaError):
            raise
        raise DeltaError("malformed", f"delta is truncated or malformed: {e}") from None
    if pos != len(buf):
        raise DeltaError("malformed", f"{len(buf) - pos} trailing bytes after the last tensor")
    return out
