"""Sparse deltas between two policy versions: which bit patterns changed, and their new values.

    blob = encode_delta(base, new)              # base, new: {name: CPU tensor}, same names/dtypes/shapes
    rebuilt = apply_delta(base, blob)           # bit-identical to `new`; DeltaError on anything malformed
    tensor_sha256(rebuilt[name])                # what a manifest carries per resulting tensor

A delta is exact: it compares bit patterns, not values (so -0.0 vs 0.0 and NaN payloads are
changes like any other), and rebuilding gives the same bytes as the learner's dense tensor.

Format "e2s-delta/2", specified byte for byte in docs/protocol.md §5.6.1 (with a worked example and the
measurements behind it): one zstandard frame (level `ZSTD_LEVEL`, content size declared) holding a
header, the tensor table, and per *class* of the base (item size, the 8 bits below the sign bit:
bf16's and fp32's exponent) how many of its items changed, coded as a packed bitmap (changed fraction in
`BITMAP_BAND`) or as gaps between changed or between unchanged ranks, and each change's value
z = zigzag(new - base) - 1 packed at the class's own width, with escapes and an overflow section. A
class's items are visited tensor by tensor (table order), by ascending index within a tensor; the
decoder knows the base, so it knows every class and its items: only which changed, and how, is sent.

Why classes by exponent: under AdamW a step is about lr whatever the weight's size, so a bf16 value
changes with a probability of roughly step / ulp, and the ulp doubles with each exponent; given its
class, a change costs within ~2 % of the conditional entropy floor (scripts/bench_delta.py; at lr 1e-5
about 21x below dense bf16, at lr 1e-6 about 86-91x, both with beta1 0.9; docs/benchmarks.md).

Pure: no network, no disk, no per-item Python loops (numpy throughout; loops run per class and per run of
`RUN_ITEMS` items). Every length is bounded by what the base tensors say: the frame must declare its
content size, at most `max_delta_bytes(base)`, before anything is decompressed; every section's size
follows from the class table (whose counts are at most the classes' items) except the gaps', which may
take at most their count + items // 127 bytes a class (what gaps summing to at most items need). A hostile
blob costs at most those allocations and raises DeltaError (`reason`: "malformed", "format",
"wrong_base" or "too_large"). Older formats are not read (e2s-delta/1 is refused as "format").
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping

from typing import TYPE_CHECKING

import numpy as np
import zstandard

from echo2swarm.policy.orders import RUN_ITEMS, Moved, TensorOrder, key_counts, run_keys

if TYPE_CHECKING:  # torch is imported where tensors are made: rebuilding in place needs numpy only
    import torch

__all__ = ["DELTA_FORMAT", "DeltaError", "apply_delta", "apply_delta_bits", "encode_delta", "max_delta_bytes",
           "tensor_bits", "tensor_sha256"]

DELTA_FORMAT = "e2s-delta/2"
ZSTD_LEVEL = 1
BITMAP_BAND = (0.15, 0.85)  # the encoder codes a class's positions as a bitmap when its changed fraction is inside
BITMAP, GAPS_CHANGED, GAPS_UNCHANGED = 0, 1, 2  # position modes of a class
WIDTHS = (1, 2, 4, 8, 16, 32, 64)  # value field widths in bits
_MAX_ESCAPED = 0.25  # the encoder tries widths with escapes only where at most this fraction escapes
_BITS_AT_ONCE = 1 << 24  # bitmap bits a decoder unpacks at once
_MAGIC = b"E2SD"
_VERSION = 2
_HEADER = struct.Struct("<4sHI")
_ENTRY = struct.Struct("<BQ")
_CLASS = struct.Struct("<BBQBBBQ")  # itemsize, key, items, mode, width, escapes, n_changed
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_INT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
_MAX_VARINT = 9  # 63 bits: any gap within a class of fewer than 2^63 items
_VARINT_LIMITS = np.array([1 << (7 * k) for k in range(1, 10)], dtype=np.uint64)  # len(v) = 1 + #limits <= v


class DeltaError(ValueError):
    """A delta that must not be applied. `reason` is a short counter label."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def tensor_bits(t: torch.Tensor) -> np.ndarray:
    """The tensor's bit patterns as a flat unsigned-integer array of its item size (a view when possible)."""
    t = t.detach().contiguous().cpu()
    import torch

    raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)
    return raw.view(_UINT[t.element_size()])


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of the tensor's raw bytes (contiguous, little-endian, as safetensors stores them)."""
    return hashlib.sha256(tensor_bits(t).tobytes()).hexdigest()


def _varint_len(value: int) -> int:
    return max(1, -(-value.bit_length() // 7))


def encode_varints(values: np.ndarray) -> np.ndarray:
    """Unsigned LEB128 (shortest form) of each value, concatenated, as uint8 (vectorised)."""
    values = np.asarray(values, dtype=np.uint64)
    if not values.size:
        return np.zeros(0, np.uint8)
    if values.max() < 0x80:  # every gap one byte: the common case at any density above 1 %
        return values.astype(np.uint8)
    lengths = np.searchsorted(_VARINT_LIMITS, values, side="right").astype(np.int64) + 1
    ends = np.cumsum(lengths)
    starts = ends - lengths
    out = np.empty(int(ends[-1]), np.uint8)
    for k in range(int(lengths.max())):
        live = np.flatnonzero(lengths > k) if k else slice(None)
        byte = (values[live] >> np.uint64(7 * k)) & np.uint64(0x7F)
        more = (lengths[live] > k + 1).astype(np.uint64) << np.uint64(7)
        out[starts[live] + k] = (byte | more).astype(np.uint8)
    return out


def decode_varints(buf: np.ndarray, count: int, max_bytes: int | None = None) -> tuple[np.ndarray, int]:
    """The first `count` shortest-form LEB128 varints of `buf` (uint8) and the bytes they took.

    DeltaError when they take more than `max_bytes` (default 9 a varint), `buf` ends first, a varint is
    longer than 9 bytes or not in its shortest form."""
    if count == 0:
        return np.zeros(0, np.uint64), 0
    limit = count * _MAX_VARINT if max_bytes is None else min(max_bytes, count * _MAX_VARINT)
    window = buf[:limit]
    ends = np.flatnonzero(window < 0x80)
    if ends.size < count:
        raise DeltaError("malformed", f"the positions stream ends after {ends.size} of {count} varints "
                         f"within the {len(window)} bytes they may take")
    ends = ends[:count]
    used = int(ends[-1]) + 1
    stream = window[:used]
    if used == count:  # every gap below 128: the common case at any density above 1 %
        return stream.astype(np.uint64), used
    starts = np.empty(count, np.int64)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    if int(lengths.max()) > _MAX_VARINT:
        raise DeltaError("malformed", f"a position varint is longer than {_MAX_VARINT} bytes")
    if (stream[ends[lengths > 1]] == 0).any():
        raise DeltaError("malformed", "a position varint is not in its shortest form")
    owner = np.repeat(np.arange(count), lengths)
    shift = (np.arange(used) - starts[owner]).astype(np.uint64) * np.uint64(7)
    contrib = (stream & 0x7F).astype(np.uint64) << shift
    return np.add.reduceat(contrib, starts), used


def _zigzag(d: np.ndarray, itemsize: int) -> np.ndarray:
    signed = d.view(_INT[itemsize])
    return ((signed << 1) ^ (signed >> (8 * itemsize - 1))).view(_UINT[itemsize])


def _unzigzag(z: np.ndarray) -> np.ndarray:
    return (z >> z.dtype.type(1)) ^ (z.dtype.type(0) - (z & z.dtype.type(1)))


def _check_pair(name: str, b: torch.Tensor, n: torch.Tensor) -> None:
    if b.dtype != n.dtype or tuple(b.shape) != tuple(n.shape):
        raise ValueError(f"{name}: base {b.dtype}{tuple(b.shape)} vs new {n.dtype}{tuple(n.shape)}")


def _pack_fields(fields: np.ndarray, width: int) -> bytes:
    """Fields of `width` bits: below 8, packed low bits first into bytes (the last byte zero-padded); from 8
    on, width/8 byte planes (byte j of every field, little-endian, then byte j+1)."""
    if width >= 8:
        planes = width // 8
        return fields.astype(f"<u{planes}").view(np.uint8).reshape(-1, planes).T.tobytes()
    per = 8 // width
    padded = np.zeros(-(-fields.size // per) * per, np.uint8)
    padded[:fields.size] = fields
    grid = padded.reshape(-1, per)
    out = np.zeros(grid.shape[0], np.uint8)
    for i in range(per):
        out |= grid[:, i] << np.uint8(width * i)
    return out.tobytes()


def _field_bytes(count: int, width: int) -> int:
    return -(-count * width // 8)


def _values(z: np.ndarray, size: int, width: int, escapes: bool) -> tuple[bytes, bytes]:
    """(fields, overflow) of a class's values z at this width."""
    if not escapes:
        return _pack_fields(z, width), b""
    escape = z.dtype.type((1 << width) - 1)
    hit = z >= escape
    over = (z[hit] - escape).astype(f"<u{size}")
    return _pack_fields(np.minimum(z, escape), width), over.view(np.uint8).reshape(-1, size).T.tobytes()


def _choose_width(z: np.ndarray, size: int, level: int) -> tuple[int, bool, bytes, bytes]:
    """The value width (and escapes) whose fields and overflow compress smallest, among the widths that
    hold every value and the narrower ones with escapes where at most `_MAX_ESCAPED` of the values escape."""
    if not z.size:
        return 1, False, b"", b""
    exact = next(w for w in WIDTHS if w >= int(z.max()).bit_length())
    candidates = [(exact, False)] + [(w, True) for w in WIDTHS if w < exact
                                      and np.count_nonzero(z >= (1 << w) - 1) <= _MAX_ESCAPED * z.size]
    if len(candidates) == 1:
        return exact, False, *_values(z, size, exact, False)
    compressor = zstandard.ZstdCompressor(level=level)
    best = None
    for width, escapes in candidates:
        fields, over = _values(z, size, width, escapes)
        cost = len(compressor.compress(fields + over))
        if best is None or cost < best[0]:
            best = (cost, width, escapes, fields, over)
    return best[1], best[2], best[3], best[4]  # type: ignore[index]


def encode_delta(base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], *,
                 level: int = ZSTD_LEVEL) -> bytes:
    """The delta that turns `base` into `new` (same tensor names, dtypes and shapes).

    `level` is zstandard's; the default is the format's (other levels give other, equally valid bytes)."""
    if set(base) != set(new):
        raise ValueError(f"tensor names differ: {sorted(set(base) ^ set(new))[:5]}")
    table = [_HEADER.pack(_MAGIC, _VERSION, len(new))]
    # per class (itemsize, key): the changed flags of its items (bit-packed segments and their lengths, an
    # eighth of a byte an item while the tensors are read) and the values of its changes, in visiting order
    masks: dict[tuple[int, int], list[tuple[np.ndarray, int]]] = {}
    values: dict[tuple[int, int], list[np.ndarray]] = {}
    for name in sorted(new):
        b, n = base[name], new[name]
        _check_pair(name, b, n)
        encoded = name.encode()
        if len(encoded) > 0xFFFF:
            raise ValueError(f"tensor name of {len(encoded)} bytes; at most 65535")
        old_bits, new_bits = tensor_bits(b), tensor_bits(n)
        size = n.element_size()
        table += [struct.pack("<H", len(encoded)), encoded, _ENTRY.pack(size, n.numel())]
        for start in range(0, old_bits.size, RUN_ITEMS):
            old, now = old_bits[start:start + RUN_ITEMS], new_bits[start:start + RUN_ITEMS]
            keys = run_keys(old)
            counts = key_counts(keys, old.size)
            changed = old != now
            order = None if keys is None else np.argsort(keys, kind="stable")
            flags = changed if order is None else changed[order]
            index = np.flatnonzero(changed) if order is None else order[flags]
            z = _zigzag(now[index] - old[index], size) - old.dtype.type(1)
            bounds = np.concatenate(([0], np.cumsum(counts)))
            upto = np.concatenate(([0], np.cumsum(flags)))
            for key in np.flatnonzero(counts).tolist():
                lo, hi = bounds[key], bounds[key + 1]
                masks.setdefault((size, key), []).append((np.packbits(flags[lo:hi]), int(hi - lo)))
                values.setdefault((size, key), []).append(z[upto[lo]:upto[hi]])
    classes, bitmap, gaps, fields, overflow = [struct.pack("<I", len(masks))], [], [], [], []
    carry = np.zeros(0, bool)  # the bitmap's bits not yet a whole byte
    low, high = BITMAP_BAND
    for cls in sorted(masks):
        size = cls[0]
        mask = np.concatenate([np.unpackbits(packed, count=n).view(bool) for packed, n in masks.pop(cls)])
        z = np.concatenate(values.pop(cls))
        items, count = mask.size, z.size
        if count and count < items and low < count / items < high:
            mode = BITMAP
            bits = np.concatenate((carry, mask))
            whole = bits.size // 8 * 8
            bitmap.append(np.packbits(bits[:whole], bitorder="little").tobytes())
            carry = bits[whole:]
        elif count / items <= low or count == 0:
            mode = GAPS_CHANGED
            gaps.append(np.diff(np.flatnonzero(mask), prepend=-1))
        else:
            mode = GAPS_UNCHANGED
            gaps.append(np.diff(np.flatnonzero(~mask), prepend=-1))
        width, escapes, packed, over = _choose_width(z, size, level)
        classes.append(_CLASS.pack(size, cls[1], items, mode, width, int(escapes), count))
        fields.append(packed)
        overflow.append(over)
    bitmap.append(np.packbits(carry, bitorder="little").tobytes())
    positions = encode_varints(np.concatenate(gaps).astype(np.uint64)) if gaps else np.zeros(0, np.uint8)
    content = b"".join([*table, *classes, *bitmap, *fields, positions.tobytes(), *overflow])
    return zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False,
                                    threads=0).compress(content)


Layout = Mapping[str, tuple[int, int]]  # tensor name -> (itemsize, numel): all a delta is checked against


def _layout(base: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    return {name: (t.element_size(), t.numel()) for name, t in base.items()}


def max_delta_bytes(base: Mapping[str, torch.Tensor]) -> int:
    """An upper bound on a valid delta's decompressed size against `base` (header + worst-case payload)."""
    return _max_delta_bytes(_layout(base))


def _max_delta_bytes(layout: Layout) -> int:
    bound = _HEADER.size + 4
    for itemsize in {size for size, _ in layout.values()}:
        bound += 256 * (_CLASS.size + 1)  # a class entry and a padding byte of fields per key
    for name, (itemsize, numel) in layout.items():
        # bitmap bits, fields of at most 8*itemsize bits, a gap per item, an overflow per item
        bound += 2 + len(name.encode()) + _ENTRY.size + numel * (1 + _varint_len(numel) + 2 * itemsize)
    return bound + 1


def _decompress(layout: Layout, blob: bytes) -> bytes:
    """The frame's content: exactly one frame, declaring a content size within the base's bound."""
    bound = _max_delta_bytes(layout)
    try:
        declared = zstandard.get_frame_parameters(blob).content_size
    except zstandard.ZstdError as e:
        raise DeltaError("malformed", f"delta is not a zstandard frame: {e}") from None
    if declared == zstandard.CONTENTSIZE_UNKNOWN:
        raise DeltaError("malformed", "delta frame does not declare its content size")
    if declared > bound:
        raise DeltaError("too_large", f"delta declares {declared} bytes; at most {bound} fit this base")
    decompressor = zstandard.ZstdDecompressor()
    try:
        # One-shot into a buffer of the declared size: a frame that holds more fails, it never grows.
        raw = decompressor.decompress(blob)
        rest = decompressor.decompressobj()
        rest.decompress(blob)
    except zstandard.ZstdError as e:
        raise DeltaError("malformed", f"delta is not a valid zstandard frame: {e}") from None
    if len(raw) != declared or not rest.eof or rest.unused_data:
        raise DeltaError("malformed", "delta holds bytes beyond its one zstandard frame")
    return raw


def _read_table(base: Layout, buf: bytes) -> tuple[list[str], int]:
    if len(buf) < _HEADER.size:
        raise DeltaError("malformed", "delta is shorter than its header")
    magic, version, count = _HEADER.unpack_from(buf, 0)
    if magic != _MAGIC:
        raise DeltaError("malformed", "not an e2s-delta blob")
    if version != _VERSION:
        raise DeltaError("format", f"delta format {version}, we read {_VERSION} ({DELTA_FORMAT})")
    if count != len(base):
        raise DeltaError("wrong_base", f"delta has {count} tensors, the base has {len(base)}")
    pos, names, previous = _HEADER.size, [], None
    try:
        for _ in range(count):
            (name_len,) = struct.unpack_from("<H", buf, pos)
            raw_name = buf[pos + 2:pos + 2 + name_len]
            if len(raw_name) != name_len:
                raise DeltaError("malformed", "delta table ends inside a tensor name")
            name = raw_name.decode()
            pos += 2 + name_len
            if name not in base:
                raise DeltaError("wrong_base", f"delta names tensor {name[:80]!r}, which the base lacks")
            if previous is not None and raw_name <= previous:
                raise DeltaError("malformed", f"tensor {name[:80]!r} repeated or out of name order")
            previous = raw_name
            itemsize, numel = _ENTRY.unpack_from(buf, pos)
            pos += _ENTRY.size
            base_itemsize, base_numel = base[name]
            if itemsize != base_itemsize or numel != base_numel:
                raise DeltaError("wrong_base", f"{name}: delta for {numel} items of {itemsize} bytes, "
                                 f"base has {base_numel} of {base_itemsize}")
            names.append(name)
    except (struct.error, UnicodeDecodeError) as e:
        raise DeltaError("malformed", f"delta table is truncated or malformed: {e}") from None
    return names, pos


class _Class:
    """One class (itemsize, key) while a delta is read: its items, entry, and decoded changes."""

    def __init__(self, size: int, key: int, items: int):
        self.size, self.key, self.items = size, key, items
        self.mode = self.width = self.escapes = self.count = 0
        self.ranks = np.zeros(0, np.int64)
        self.z = np.zeros(0, _UINT[size])


def _unpack_fields(data: np.ndarray, count: int, width: int, size: int, where: str) -> np.ndarray:
    if width >= 8:
        planes = width // 8
        grid = np.ascontiguousarray(data.reshape(planes, count).T)
        return grid.view(f"<u{planes}").reshape(-1).astype(_UINT[size])
    per = 8 // width
    mask = np.uint8((1 << width) - 1)
    grid = np.stack([(data >> np.uint8(width * i)) & mask for i in range(per)], axis=1).reshape(-1)
    if grid[count:].any():
        raise DeltaError("malformed", f"{where}: value fields' padding bits are not zero")
    return grid[:count].astype(_UINT[size])


def _ranks_of_gaps(gaps: np.ndarray, items: int, where: str) -> np.ndarray:
    if not gaps.size:
        return np.zeros(0, np.int64)
    if gaps.min() == 0 or gaps.max() > items:
        raise DeltaError("malformed", f"{where}: change positions out of order or out of range")
    ranks = np.cumsum(gaps) - np.uint64(1)
    if ranks[-1] >= items or (items >= 1 << 32 and (np.diff(ranks).astype(np.int64) <= 0).any()):
        raise DeltaError("malformed", f"{where}: change positions out of order or out of range")
    return ranks.astype(np.int64)


def apply_delta(base: Mapping[str, torch.Tensor], blob: bytes) -> dict[str, torch.Tensor]:
    """`base` with the delta applied: new tensors (base is not modified). DeltaError if malformed."""
    bits = {name: tensor_bits(t).copy() for name, t in base.items()}
    apply_delta_bits(bits, blob)
    import torch

    return {name: torch.from_numpy(bits[name].view(np.uint8)).view(t.dtype).reshape(t.shape)
            for name, t in base.items()}


def apply_delta_bits(bits: Mapping[str, np.ndarray], blob: bytes,
                     orders: Mapping[str, TensorOrder] | None = None,
                     moved: dict[str, list[Moved]] | None = None) -> list[str]:
    """Apply the delta IN PLACE to the base's bit patterns: `bits` maps every base tensor's name to
    its flat, writable unsigned array of its item size (e.g. views into a copy of the base's
    safetensors file). Returns the names of the tensors with at least one change.

    `orders`: the base's visiting orders (`orders.visit_orders(bits)`, any subset of the tensors), so
    that nothing is sorted or counted here; they must be of these very bits (a wrong order rebuilds
    wrong tensors, which the caller's hash check then refuses). `moved`: filled, for each tensor of
    `orders` that has any, with the items whose key the delta changed, per run: what
    `orders.advance(orders[name], moved[name])` needs to make them the rebuilt bits' orders (off the
    critical path: a follower does it while it waits for the next version). DeltaError if malformed;
    then some arrays may be changed already: apply only to a copy.
    """
    layout = {name: (a.dtype.itemsize, a.size) for name, a in bits.items()}
    raw = _decompress(layout, blob)
    names, pos = _read_table(layout, raw)
    buf = np.frombuffer(raw, dtype=np.uint8)
    held = {} if orders is None else {n: o for n, o in orders.items() if n in bits and o.fits(bits[n])}
    # The base's runs (of RUN_ITEMS items a tensor) and how many items of each key each holds.
    runs: list[tuple[str, int, int]] = []
    counts: list[np.ndarray] = []
    for name in names:
        tensor = bits[name]
        for start in range(0, tensor.size, RUN_ITEMS):
            run = tensor[start:start + RUN_ITEMS]
            runs.append((name, start, run.size))
            counts.append(held[name].counts[start // RUN_ITEMS] if name in held
                          else key_counts(run_keys(run), run.size))
    per_run = np.array(counts, np.int64).reshape(-1, 256)
    run_size = np.array([bits[name].dtype.itemsize for name, _, _ in runs], np.int64)
    classes = [_Class(size, key, int(per_run[run_size == size, key].sum()))
               for size in sorted(set(run_size.tolist())) for key in range(256)
               if per_run[run_size == size, key].any()]
    try:
        (n_classes,) = struct.unpack_from("<I", raw, pos)
        pos += 4
        if n_classes != len(classes):
            raise DeltaError("wrong_base", f"delta has {n_classes} classes, the base has {len(classes)}")
        for c in classes:
            size, key, items, c.mode, c.width, c.escapes, c.count = _CLASS.unpack_from(raw, pos)
            pos += _CLASS.size
            where = f"class (itemsize {c.size}, key {c.key})"
            if (size, key, items) != (c.size, c.key, c.items):
                raise DeltaError("wrong_base", f"{where}: the delta has class (itemsize {size}, key {key}) of "
                                 f"{items} items here, the base {c.items} items")
            if c.mode not in (BITMAP, GAPS_CHANGED, GAPS_UNCHANGED) or c.width not in WIDTHS \
                    or c.width > 8 * c.size or c.escapes not in (0, 1) or (c.escapes and c.width == 8 * c.size):
                raise DeltaError("malformed", f"{where}: mode {c.mode}, width {c.width}, escapes {c.escapes}")
            if c.count > c.items:
                raise DeltaError("malformed", f"{where}: {c.count} changes in {c.items} items")
    except struct.error:
        raise DeltaError("malformed", "delta's class table is truncated") from None

    def take(n: int, what: str) -> np.ndarray:
        nonlocal pos
        if n > len(buf) - pos:
            raise DeltaError("malformed", f"the delta ends inside its {what}")
        pos += n
        return buf[pos - n:pos]

    # Positions coded as bitmaps: one bit an item, the classes' bits in a row, low bits first; unpacked
    # `_BITS_AT_ONCE` at a time (a byte a bit while unpacked).
    mapped = [c for c in classes if c.mode == BITMAP]
    total = sum(c.items for c in mapped)
    section = take(-(-total // 8), "bitmap")
    offset = 0
    for c in mapped:
        ranks = []
        for lo in range(0, c.items, _BITS_AT_ONCE):
            first, n = offset + lo, min(_BITS_AT_ONCE, c.items - lo)
            unpacked = np.unpackbits(section[first // 8:-(-(first + n) // 8)], bitorder="little")
            ranks.append(np.flatnonzero(unpacked[first % 8:first % 8 + n]) + lo)
        c.ranks = np.concatenate(ranks) if ranks else np.zeros(0, np.int64)
        offset += c.items
        if c.ranks.size != c.count:
            raise DeltaError("malformed", f"class (itemsize {c.size}, key {c.key}): its bitmap holds "
                             f"{c.ranks.size} changes, its entry {c.count}")
    if total % 8 and section[-1] >> np.uint8(total % 8):
        raise DeltaError("malformed", "the bitmap's padding bits are not zero")
    # Values: each class's fields, then (after the gaps) the overflow of its escaped fields.
    for c in classes:
        if c.count:
            c.z = _unpack_fields(take(_field_bytes(c.count, c.width), "values"), c.count, c.width, c.size,
                                 f"class (itemsize {c.size}, key {c.key})")
    # Positions coded as gaps: between the ranks of changed (or of unchanged) items, as varints.
    gapped = [c for c in classes if c.mode != BITMAP]
    wanted = [c.count if c.mode == GAPS_CHANGED else c.items - c.count for c in gapped]
    # Gaps >= 1 summing to at most the class's items: at most items // 127 continuation bytes a class.
    most = sum(wanted) + sum(c.items // 127 for c, n in zip(gapped, wanted) if n)
    gaps, used = decode_varints(buf[pos:], sum(wanted), max_bytes=most)
    pos += used
    first = 0
    for c, n in zip(gapped, wanted):
        where = f"class (itemsize {c.size}, key {c.key})"
        ranks = _ranks_of_gaps(gaps[first:first + n], c.items, where)
        first += n
        if c.mode == GAPS_CHANGED:
            c.ranks = ranks
        else:
            keep = np.ones(c.items, bool)
            keep[ranks] = False
            c.ranks = np.flatnonzero(keep)
    del gaps
    for c in classes:
        full = 8 * c.size
        top = c.z.dtype.type((1 << full) - 1)  # a value word whose zigzag is 0: no change
        if c.escapes:
            escape = c.z.dtype.type((1 << c.width) - 1)
            hit = np.flatnonzero(c.z == escape)
            grid = take(hit.size * c.size, "overflow").reshape(c.size, hit.size)
            over = np.ascontiguousarray(grid.T).view(f"<u{c.size}").reshape(-1).astype(c.z.dtype)
            if (over >= top - escape).any():
                raise DeltaError("malformed", f"class (itemsize {c.size}, key {c.key}): an overflow past the "
                                 "item's bits")
            c.z[hit] += over
        elif c.width == full and (c.z == top).any():
            raise DeltaError("malformed", f"class (itemsize {c.size}, key {c.key}): a value that changes nothing")
    if pos != len(buf):
        raise DeltaError("malformed", f"{len(buf) - pos} bytes beyond the delta's last section")
    # Apply, run by run: a class's items are its key's items of each run (of its item size) in turn.
    parts: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in runs]
    starts = per_run.cumsum(axis=1) - per_run  # where each key's items start in a run's visiting order
    for c in classes:
        if not c.count:
            continue
        rows = np.flatnonzero(run_size == c.size)
        ends = per_run[rows, c.key].cumsum()
        cuts = np.searchsorted(c.ranks, ends)
        lo = 0
        for row, hi, end in zip(rows.tolist(), cuts.tolist(), ends.tolist()):
            if hi > lo:
                segment = end - int(per_run[row, c.key])
                parts[row].append((c.ranks[lo:hi] - segment + int(starts[row, c.key]), c.z[lo:hi]))
            lo = hi
    changed: list[str] = []
    for (name, start, size), row in zip(runs, parts):
        if not row:
            continue
        run = bits[name][start:start + size]
        ranks = np.concatenate([r for r, _ in row])
        z = np.concatenate([v for _, v in row])
        ahead = held.get(name)
        if run.dtype.itemsize == 1:
            index = ranks
        elif ahead is not None:
            index = ahead.order[start:start + size][ranks]
        else:
            index = np.argsort(run_keys(run), kind="stable")[ranks]
        old = run[index]
        run[index] = old + _unzigzag(z + z.dtype.type(1))
        if moved is not None and ahead is not None:
            was, now = run_keys(old), run_keys(run[index])
            move = np.flatnonzero(was != now)
            if move.size:
                moved.setdefault(name, []).append((start // RUN_ITEMS, index[move], was[move], now[move]))
        if not changed or changed[-1] != name:
            changed.append(name)
    return changed
