"""Sparse deltas between two policy versions: which bit patterns changed, and their new values.

    blob = encode_delta(base, new)              # base, new: {name: CPU tensor}, same names/dtypes/shapes
    rebuilt = apply_delta(base, blob)           # bit-identical to `new`; DeltaError on anything malformed
    tensor_sha256(rebuilt[name])                # what a manifest carries per resulting tensor

A delta is exact: it compares bit patterns, not values (so -0.0 vs 0.0 and NaN payloads are
changes like any other), and rebuilding gives the same bytes as the learner's dense tensor.

Format "e2s-delta/1": one zstandard frame (level `ZSTD_LEVEL` = 1, single-threaded, content size in
the frame header, no checksum) whose content is, all integers little-endian:

    header     "E2SD" | u16 version = 1 | u32 n_tensors
    table      per tensor, names in ascending code-point (= UTF-8 byte) order, each name once:
                 u16 name_len | name (UTF-8) | u8 itemsize (1, 2, 4 or 8) | u64 numel | u64 n_changed
    positions  for each tensor in table order, for each changed item in visiting order (below): the
               gap between its rank in the visiting order and the previous changed item's (the first
               counts from -1, so every gap is >= 1) as an unsigned LEB128 varint in its shortest form
               (7 bits a byte, low bits first, high bit set on every byte but the last)
    values     itemsize byte planes: plane j (j = 0 .. 7) holds byte j (little-endian) of the value
               word of every change of every tensor whose itemsize > j, tensors in table order,
               changes in visiting order; planes in ascending j
    nothing after the last plane.

Visiting order of a tensor's items (flat, row-major): runs of `RUN_ITEMS` = 2^20 consecutive items
(the last run may be shorter), in index order; within a run, items by ascending key and, for equal
keys, ascending index. The key of an item is read from the BASE's bit pattern b (an unsigned
itemsize-byte integer): (b >> (8*itemsize - 9)) & 0xFF, the 8 bits below the sign bit (bf16's and
fp32's exponent); for itemsize 1 every key is 0 (plain index order). The decoder knows the base, so it
rebuilds the order; grouping items by exponent groups them by their chance of changing (a step of
about lr changes a bf16 value with a probability of roughly lr / ulp, and the ulp doubles with each
exponent), which the gaps and the values' entropy coder then see.

The value word of a change is zigzag(d), d = new_bits - base_bits modulo 2^(8*itemsize) read as a
signed itemsize-byte integer, zigzag(d) = (d << 1) XOR (d >> (8*itemsize - 1)) (arithmetic shift),
so a one-ulp step up or down (the common change at small learning rates) is the word 2 or 1 and the
sign/exponent byte of a change is almost always zero. Every table entry says the base's numel and
itemsize for that name, and n_changed <= numel. The zstandard bytes are libzstd's at that level; any
implementation that writes the same content rebuilds the same tensors, and a version's hashes cover
the resulting tensors, not the frame.

Why this layout: measured by scripts/bench_delta.py on a 69M-parameter Qwen3-style model trained by
GRPOTrainer (fp32 master, AdamW, bf16 publish; the tables are in docs/benchmarks.md, "Delta
versions"). On the v9 -> v10 delta at lr 1e-6, one AdamW update per version (1.59 % of the 69.3M
bf16 values changed; dense 138.56 MB), 2-core VM under load:

    layout (zstd level)                                          bytes  dense/x  B/changed  enc s  dec s
    index order, per tensor [gaps | XOR words] (3; first draft)  1688012   82.1x    1.537
    index order, gaps + XOR words interleaved (1)                1683678   82.3x    1.533
    index order, gaps + XOR words in byte planes (1)             1543029   89.8x    1.405
    index order, gaps + new values in byte planes (1)            2696090   51.4x    2.454
    index order, gaps + zigzag differences interleaved (1)       1537160   90.1x    1.399
    index order, gaps + zigzag differences in byte planes (1)    1427202   97.1x    1.299
    index order, bitmap + zigzag differences in planes (1)       2030160   68.3x    1.848
    exponent order, gaps + XOR words in byte planes (1)          1259705  110.0x    1.147
    exponent order, gaps + zigzag planes, frame per stream (1)   1105790  125.3x    1.007
    exponent order, gaps + zigzag planes, frame per tensor (1)   1128099  122.8x    1.027
    THIS FORMAT (1)                                              1106861  125.2x    1.008   0.86   0.73
    this layout at zstd 3 / 9 / 19                     1123837 / 1096488 / 1077777          1.22 / 1.05 / 2.93
    order-0 entropy of gaps + values: index / exponent order     1269080 / 1073676 (no table)

So: differences beat XOR words (a one-ulp step is +-1, 1 bit of sign, where its XOR is a run of
trailing ones) and new values (8+ bits); byte planes put the all-but-always-zero high bytes
together; gaps beat a bitmap at 1.6 % and at 10 % changed (a bitmap won only at 24 %, in index
order); visiting items by the base's exponent (the decoder knows it) cuts the positions' entropy
from 7.4 to 5.0 bits per change, measured, the largest single gain; zstd level 1 is within 2-3 %
of levels 3 and 9 and the fastest (19 saves 3 % at 3.4x the time, 9 % at 8x at lr 1e-5); separate
frames per stream or per tensor gain nothing. The whole delta is within 3 % of the order-0 entropy
of its gaps and values. At lr 1e-5 (10 % changed) the same format gives 0.78 bytes per changed
value. Encode and decode are numpy throughout: one stable argsort of uint8 keys per run of 2^20
items dominates at low densities (~0.5-0.9 s each way for 69M values on this loaded 2-core VM).

Pure: no network, no disk, no per-item Python loops (numpy throughout). Every length is bounded by
what the base tensors say: the frame must declare its content size, at most `max_delta_bytes(base)`,
before anything is decompressed; the positions stream may take at most n_changed + numel // 127
bytes per tensor (what gaps summing to at most numel need). A hostile blob costs at most those
allocations and raises DeltaError (`reason`: "malformed", "format", "wrong_base" or "too_large").
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Mapping

from typing import TYPE_CHECKING

import numpy as np
import zstandard

if TYPE_CHECKING:  # torch is imported where tensors are made: rebuilding in place needs numpy only
    import torch

__all__ = ["DELTA_FORMAT", "DeltaError", "apply_delta", "apply_delta_bits", "encode_delta", "max_delta_bytes",
           "tensor_bits", "tensor_sha256", "visit_orders"]

DELTA_FORMAT = "e2s-delta/1"
ZSTD_LEVEL = 1
RUN_ITEMS = 1 << 20  # items per run of the visiting order
_MAGIC = b"E2SD"
_VERSION = 1
_HEADER = struct.Struct("<4sHI")
_ENTRY = struct.Struct("<BQQ")
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_INT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
_MAX_VARINT = 9  # 63 bits: any gap within a tensor of fewer than 2^63 items
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


def _visit_order(base_bits: np.ndarray, start: int, stop: int) -> np.ndarray | None:
    """Offsets (from `start`) of the run's items in visiting order: by key, ties by index; None: index order."""
    itemsize = base_bits.dtype.itemsize
    if itemsize == 1:
        return None
    # the cast to uint8 keeps the low 8 bits: (b >> (8*itemsize - 9)) & 0xFF in one pass fewer
    key = (base_bits[start:stop] >> base_bits.dtype.type(8 * itemsize - 9)).astype(np.uint8)
    return np.argsort(key, kind="stable")


def visit_orders(bits: Mapping[str, np.ndarray], stop: Callable[[], bool] = lambda: False,
                 out: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Every tensor's visiting order, ahead of a delta against these bits (`apply_delta_bits(orders=)`):
    per tensor of itemsize > 1, each run's item offsets in visiting order, runs concatenated (uint32,
    numel items: 4 bytes an item). What rebuilding costs most (one stable sort a run) depends on the
    base alone, so a follower can compute it while it waits for the next version.

    Tensors are added to `out` (returned) as each is complete; when `stop()` turns true (checked
    between runs) it returns with the tensors done so far: a rebuild sorts the rest itself."""
    out = {} if out is None else out
    for name, b in bits.items():
        if b.dtype.itemsize == 1:
            continue
        order = np.empty(b.size, np.uint32)
        for start in range(0, b.size, RUN_ITEMS):
            if stop():
                return out
            stop_at = min(start + RUN_ITEMS, b.size)
            order[start:stop_at] = _visit_order(b, start, stop_at)  # type: ignore[assignment]
        out[name] = order
    return out


def _changes(old_bits: np.ndarray, new_bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ranks in visiting order, item indices) of the changed items, in visiting order."""
    ranks, indices = [], []
    for start in range(0, old_bits.size, RUN_ITEMS):
        stop = min(start + RUN_ITEMS, old_bits.size)
        changed = old_bits[start:stop] != new_bits[start:stop]
        if not changed.any():
            continue
        order = _visit_order(old_bits, start, stop)
        if order is None:
            rank = np.flatnonzero(changed)
            index = rank
        else:
            rank = np.flatnonzero(changed[order])
            index = order[rank]
        ranks.append(rank + start)
        indices.append(index + start)
    if not ranks:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(ranks), np.concatenate(indices)


def _indices(base_bits: np.ndarray, ranks: np.ndarray, order: np.ndarray | None = None) -> np.ndarray:
    """Item indices of the changes at `ranks` (ascending, < numel) of the visiting order (`order`: the
    tensor's `visit_orders` entry, computed ahead)."""
    if base_bits.dtype.itemsize == 1:
        return ranks
    if order is not None and order.dtype == np.uint32 and order.size == base_bits.size:
        return order[ranks].astype(np.int64) + (ranks // RUN_ITEMS) * RUN_ITEMS
    out = np.empty(ranks.size, np.int64)
    bounds = np.searchsorted(ranks, np.arange(0, base_bits.size + RUN_ITEMS, RUN_ITEMS))
    for run, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        if lo == hi:
            continue
        start = run * RUN_ITEMS
        order = _visit_order(base_bits, start, min(start + RUN_ITEMS, base_bits.size))
        out[lo:hi] = order[ranks[lo:hi] - start] + start
    return out


def encode_delta(base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], *,
                 level: int = ZSTD_LEVEL) -> bytes:
    """The delta that turns `base` into `new` (same tensor names, dtypes and shapes).

    `level` is zstandard's; the default is the format's (other levels give other, equally valid bytes)."""
    if set(base) != set(new):
        raise ValueError(f"tensor names differ: {sorted(set(base) ^ set(new))[:5]}")
    table = [_HEADER.pack(_MAGIC, _VERSION, len(new))]
    gaps: list[np.ndarray] = []
    words: list[np.ndarray] = []  # per tensor: (n_changed, itemsize) uint8, little-endian value words
    for name in sorted(new):
        b, n = base[name], new[name]
        _check_pair(name, b, n)
        encoded = name.encode()
        if len(encoded) > 0xFFFF:
            raise ValueError(f"tensor name of {len(encoded)} bytes; at most 65535")
        old_bits, new_bits = tensor_bits(b), tensor_bits(n)
        ranks, index = _changes(old_bits, new_bits)
        size = n.element_size()
        table += [struct.pack("<H", len(encoded)), encoded, _ENTRY.pack(size, n.numel(), ranks.size)]
        if ranks.size:
            gaps.append(np.diff(ranks, prepend=-1).astype(np.uint64))
            word = _zigzag(new_bits[index] - old_bits[index], size).astype(f"<u{size}")
            words.append(word.view(np.uint8).reshape(-1, size))
    planes = [w[:, j] for j in range(8) for w in words if w.shape[1] > j]
    positions = encode_varints(np.concatenate(gaps)) if gaps else np.zeros(0, np.uint8)
    content = b"".join([*table, positions.tobytes(), *(p.tobytes() for p in planes)])
    return zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False,
                                    threads=0).compress(content)


Layout = Mapping[str, tuple[int, int]]  # tensor name -> (itemsize, numel): all a delta is checked against


def _layout(base: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    return {name: (t.element_size(), t.numel()) for name, t in base.items()}


def max_delta_bytes(base: Mapping[str, torch.Tensor]) -> int:
    """An upper bound on a valid delta's decompressed size against `base` (header + worst-case payload)."""
    return _max_delta_bytes(_layout(base))


def _max_delta_bytes(layout: Layout) -> int:
    bound = _HEADER.size
    for name, (itemsize, numel) in layout.items():
        bound += 2 + len(name.encode()) + _ENTRY.size + numel * (_varint_len(numel) + itemsize)
    return bound


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


def _read_table(base: Layout, buf: bytes) -> tuple[list[tuple[str, int, int]], int]:
    if len(buf) < _HEADER.size:
        raise DeltaError("malformed", "delta is shorter than its header")
    magic, version, count = _HEADER.unpack_from(buf, 0)
    if magic != _MAGIC:
        raise DeltaError("malformed", "not an e2s-delta blob")
    if version != _VERSION:
        raise DeltaError("format", f"delta format {version}, we read {_VERSION} ({DELTA_FORMAT})")
    if count != len(base):
        raise DeltaError("wrong_base", f"delta has {count} tensors, the base has {len(base)}")
    pos, entries, previous = _HEADER.size, [], None
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
            itemsize, numel, n_changed = _ENTRY.unpack_from(buf, pos)
            pos += _ENTRY.size
            base_itemsize, base_numel = base[name]
            if itemsize != base_itemsize or numel != base_numel:
                raise DeltaError("wrong_base", f"{name}: delta for {numel} items of {itemsize} bytes, "
                                 f"base has {base_numel} of {base_itemsize}")
            if n_changed > numel:
                raise DeltaError("malformed", f"{name}: {n_changed} changes in {numel} items")
            entries.append((name, itemsize, n_changed))
    except (struct.error, UnicodeDecodeError) as e:
        raise DeltaError("malformed", f"delta table is truncated or malformed: {e}") from None
    return entries, pos


def apply_delta(base: Mapping[str, torch.Tensor], blob: bytes) -> dict[str, torch.Tensor]:
    """`base` with the delta applied: new tensors (base is not modified). DeltaError if malformed."""
    bits = {name: tensor_bits(t).copy() for name, t in base.items()}
    apply_delta_bits(bits, blob)
    import torch

    return {name: torch.from_numpy(bits[name].view(np.uint8)).view(t.dtype).reshape(t.shape)
            for name, t in base.items()}


def apply_delta_bits(bits: Mapping[str, np.ndarray], blob: bytes,
                     orders: Mapping[str, np.ndarray] | None = None) -> list[str]:
    """Apply the delta IN PLACE to the base's bit patterns: `bits` maps every base tensor's name to
    its flat, writable unsigned array of its item size (e.g. views into a copy of the base's
    safetensors file). Returns the names of the tensors with at least one change.

    `orders`: `visit_orders(bits)` computed ahead (it must be of these very bits: a wrong order
    rebuilds wrong tensors, which the caller's hash check then refuses). DeltaError if malformed;
    then some arrays may be changed already: apply only to a copy.
    """
    layout = {name: (a.dtype.itemsize, a.size) for name, a in bits.items()}
    raw = _decompress(layout, blob)
    entries, pos = _read_table(layout, raw)
    buf = np.frombuffer(raw, dtype=np.uint8)
    total = sum(n for _, _, n in entries)
    # Gaps >= 1 summing to at most numel: at most numel // 127 continuation bytes per tensor.
    most = total + sum(layout[name][1] // 127 for name, _, n in entries if n)
    gaps, used = decode_varints(buf[pos:], total, max_bytes=most)
    pos += used
    value_bytes = sum(n * size for _, size, n in entries)
    if len(buf) - pos != value_bytes:
        raise DeltaError("malformed", f"{len(buf) - pos} bytes of values where the table says {value_bytes}")
    # Where each tensor's bytes sit in each plane.
    plane_start, offsets = pos, {}
    for j in range(8):
        for name, size, n in entries:
            if size > j:
                offsets[name, j] = plane_start
                plane_start += n
    changed: list[str] = []
    first = 0
    for name, size, n in entries:
        if not n:
            continue
        tensor_bits_ = bits[name]
        tensor_gaps = gaps[first:first + n]
        first += n
        numel = tensor_bits_.size
        if tensor_gaps.min() == 0 or tensor_gaps.max() > numel:
            raise DeltaError("malformed", f"{name}: change positions out of order or out of range")
        ranks = np.cumsum(tensor_gaps) - np.uint64(1)
        if ranks[-1] >= numel or (numel >= 1 << 32 and (np.diff(ranks).astype(np.int64) <= 0).any()):
            raise DeltaError("malformed", f"{name}: change positions out of order or out of range")
        # from the base's bits: before any change
        index = _indices(tensor_bits_, ranks.astype(np.int64), None if orders is None else orders.get(name))
        word_bytes = np.stack([buf[offsets[name, j]:offsets[name, j] + n] for j in range(size)], axis=1)
        words = np.ascontiguousarray(word_bytes).view(f"<u{size}").reshape(-1).astype(tensor_bits_.dtype)
        tensor_bits_[index] += _unzigzag(words)
        changed.append(name)
    return changed
