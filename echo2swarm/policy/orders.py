"""Visiting orders: the index of a base version that a delta decoder looks items up in.

A delta (policy/delta.py, docs/protocol.md §5.6.1) names changed items by their rank within a
*class* of the base (the items sharing an exponent, in tensor and index order). Turning ranks into
positions needs each class's items in order: per run of `RUN_ITEMS` items of a tensor, the run's
offsets sorted by key, ties by offset (one stable sort of 8-bit keys) and how many items of each key
the run holds. That is what costs a rebuild most, and it depends on the base alone, so a follower
keeps it for the version it holds:

    held = visit_orders(bits)                    # O(items): after a dense install, ahead of time
    moved = {}
    apply_delta_bits(bits, blob, held, moved)    # no sort, no count: only the delta's own work
    for name, items in moved.items():            # later, while waiting for the next version
        advance(held[name], items)               # held now describes the rebuilt bits

`advance` moves only the items whose key a delta changed (a value crossing a power of two: ~1 in
64 of the changes at lr 1e-6) from their old class's segment to their new one, so a follower that
rebuilds version after version never sorts again: one delete and one insert over the order (two
copies of it) instead of a sort of every item. That pays while few items move: past
`ADVANCE_MAX_SHARE` of a tensor's items (fp32 versions, a large lr) sorting it anew is cheaper, and
`worth_advancing` says which.

Runs are the implementation's, not the format's: any run length gives the same ranks. Nothing here
is trusted beyond this process: an order that is wrong can only rebuild tensors whose signed hash
then fails (policy/catchup.rebuild redoes such a rebuild without orders).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass

import numpy as np

__all__ = ["ADVANCE_MAX_SHARE", "RUN_ITEMS", "Moved", "TensorOrder", "advance", "key_counts", "run_keys",
           "visit_orders", "worth_advancing"]

RUN_ITEMS = 1 << 18  # items one stable sort of keys covers (its arrays stay in cache); no part of the format
_KEYS = np.arange(256, dtype=np.uint8)  # searched in uint8: no cast of the run's keys
Moved = tuple[int, np.ndarray, np.ndarray, np.ndarray]  # (run, offsets, old keys, new keys) of items that changed key
# Above this share of a tensor's items changing key, sorting it anew beats advancing its order: a sort
# costs ~8 ns an item, an advance ~2 ns an item plus ~0.4 us a moved one (scripts/bench_orders.py).
ADVANCE_MAX_SHARE = 0.01


@dataclass
class TensorOrder:
    """One tensor's visiting order: `order` (uint32, one per item: each run's item offsets sorted by
    key then offset, runs concatenated) and `counts` (int64, runs x 256: the items of each key a run
    holds). 4 bytes an item plus 2 KiB a run."""

    order: np.ndarray
    counts: np.ndarray

    def fits(self, bits: np.ndarray) -> bool:
        """Shaped for these bits (it may still be of other bits: only a hash check tells)."""
        return (self.order.dtype == np.uint32 and self.order.size == bits.size and self.counts.dtype == np.int64
                and self.counts.shape == (-(-bits.size // RUN_ITEMS), 256))


def run_keys(run: np.ndarray) -> np.ndarray | None:
    """Each item's key, (b >> (8*itemsize - 9)) & 0xFF of its bits; None: every key is 0 (itemsize 1)."""
    if run.dtype.itemsize == 1:
        return None
    # the cast to uint8 keeps the low 8 bits: the mask in one pass fewer
    return (run >> run.dtype.type(8 * run.dtype.itemsize - 9)).astype(np.uint8)


def key_counts(keys: np.ndarray | None, size: int) -> np.ndarray:
    """Items of each of the 256 keys (`keys` None: all `size` items have key 0)."""
    if keys is None:
        counts = np.zeros(256, np.int64)
        counts[0] = size
        return counts
    return np.bincount(keys, minlength=256).astype(np.int64, copy=False)


def visit_orders(bits: Mapping[str, np.ndarray], stop: Callable[[], bool] = lambda: False,
                 out: MutableMapping[str, TensorOrder] | None = None) -> MutableMapping[str, TensorOrder]:
    """Every tensor's visiting order (tensors of itemsize 1 need none: their order is the index).

    Tensors already in `out` are kept; the others are added as each is complete. When `stop()` turns
    true (checked between runs) it returns with the tensors done so far: a rebuild sorts the rest."""
    out = {} if out is None else out
    for name, b in bits.items():
        if b.dtype.itemsize == 1 or name in out:
            continue
        order = np.empty(b.size, np.uint32)
        counts = np.empty((-(-b.size // RUN_ITEMS), 256), np.int64)
        for row, start in enumerate(range(0, b.size, RUN_ITEMS)):
            if stop():
                return out
            keys = run_keys(b[start:start + RUN_ITEMS])
            by_key = np.argsort(keys, kind="stable")
            order[start:start + keys.size] = by_key
            counts[row, :-1] = np.diff(np.searchsorted(keys[by_key], _KEYS))  # faster than a bincount
            counts[row, -1] = keys.size - counts[row, :-1].sum()
        out[name] = TensorOrder(order, counts)
    return out


def _first_at_least(order: np.ndarray, lo: np.ndarray, hi: np.ndarray, values: np.ndarray) -> np.ndarray:
    """For each i, the first p in [lo[i], hi[i]) with order[p] >= values[i] (hi[i] if none): a binary
    search of many sorted segments of `order` at once."""
    lo, hi = lo.copy(), hi.copy()
    while True:
        live = lo < hi
        if not live.any():
            return lo
        mid = (lo + hi) // 2
        below = live & (order[np.minimum(mid, order.size - 1)] < values)
        lo = np.where(below, mid + 1, lo)
        hi = np.where(live & ~below, mid, hi)


def worth_advancing(entry: TensorOrder, moved: list[Moved]) -> bool:
    """Is advancing `entry` by `moved` cheaper than sorting the tensor anew (`ADVANCE_MAX_SHARE`)?"""
    return sum(offsets.size for _, offsets, _, _ in moved) <= ADVANCE_MAX_SHARE * entry.order.size


def advance(entry: TensorOrder, moved: list[Moved]) -> bool:
    """Make `entry` (changed in place) the order of the tensor after some of its items changed key:
    `moved` lists, per run (its index, ascending), the run offsets of those items (distinct) and
    their old and new keys (every one differs). False: `entry.order` does not hold an item where its
    old key says (it was not of these bits); `entry` is then unchanged, and must not be used.

    All runs at once: one batched binary search for where the items are, one delete and one insert
    over the whole order (each run keeps its size: an item stays in its run)."""
    if not moved:
        return True
    order, counts = entry.order, entry.counts
    rows = np.concatenate([np.full(o.size, r, np.int64) for r, o, _, _ in moved])
    offsets = np.concatenate([o for _, o, _, _ in moved]).astype(np.uint32)
    old_keys = np.concatenate([k for _, _, k, _ in moved]).astype(np.int64)
    new_keys = np.concatenate([k for _, _, _, k in moved]).astype(np.int64)
    starts = np.cumsum(counts, axis=1) - counts  # where each key's items start in a run's order
    lo = rows * RUN_ITEMS + starts[rows, old_keys]
    at = _first_at_least(order, lo, lo + counts[rows, old_keys], offsets)
    if (order[np.minimum(at, order.size - 1)] != offsets).any() or (at >= lo + counts[rows, old_keys]).any():
        return False
    kept = np.delete(order, at)
    np.subtract.at(counts, (rows, old_keys), 1)
    removed_before = np.searchsorted(rows, np.arange(counts.shape[0]))  # moved items in the runs before each
    starts = np.cumsum(counts, axis=1) - counts
    by = np.lexsort((offsets, new_keys, rows))  # np.insert keeps ties in this order: by run, key, offset
    rows, offsets, new_keys = rows[by], offsets[by], new_keys[by]
    lo = rows * RUN_ITEMS - removed_before[rows] + starts[rows, new_keys]
    into = _first_at_least(kept, lo, lo + counts[rows, new_keys], offsets)
    order[:] = np.insert(kept, into, offsets)
    np.add.at(counts, (rows, new_keys), 1)
    return True
