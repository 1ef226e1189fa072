#!/usr/bin/env python
"""Keeping a follower's visiting orders (policy/orders.py) across a delta: advancing them by the items
that changed key against sorting the tensor anew, by the share of items that moved, in one run.

    python scripts/bench_orders.py [--items 262144,1048576] [--shares 0.001,0.01,0.05,0.2] [--repeat 5] [--json]

Per tensor size and share: random fp32 weights (N(0, 0.02)), that share of their items scaled by 2.5
(most cross a power of two: their key changes), the median of `--repeat` runs of `advance` (on a
fresh copy of the base's order) and of `visit_orders` on the new bits; both must give the same order.
The rule the orders thread follows (`worth_advancing`: at most ADVANCE_MAX_SHARE of the items moved)
picks one; its time over always advancing is printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from echo2swarm.policy.orders import (ADVANCE_MAX_SHARE, RUN_ITEMS, TensorOrder, advance, run_keys, visit_orders,
                                      worth_advancing)


def moved_items(base: np.ndarray, new: np.ndarray) -> list:
    """`advance`'s input: per run, the offsets and old/new keys of the items whose key changed."""
    out = []
    for row, start in enumerate(range(0, base.size, RUN_ITEMS)):
        old, now = run_keys(base[start:start + RUN_ITEMS]), run_keys(new[start:start + RUN_ITEMS])
        changed = np.flatnonzero(old != now)
        if changed.size:
            out.append((row, changed.astype(np.uint32), old[changed], now[changed]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", default="262144,1048576", help="tensor sizes, comma-separated")
    parser.add_argument("--shares", default="0.001,0.005,0.01,0.02,0.05,0.2", help="shares of items changed")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()
    try:
        sizes = [int(x) for x in args.items.split(",") if x.strip()]
        shares = [float(x) for x in args.shares.split(",") if x.strip()]
    except ValueError as e:
        parser.error(f"--items and --shares take comma-separated numbers: {e}")
    if not sizes or min(sizes) < 1 or not shares or not all(0 < s <= 1 for s in shares) or args.repeat < 1:
        parser.error("--items >= 1, --shares in (0, 1], --repeat >= 1")
    rng = np.random.default_rng(0)
    rows = []
    for n in sizes:
        weights = (rng.standard_normal(n) * 0.02).astype(np.float32)
        base_bits = weights.view(np.uint32)
        base = visit_orders({"t": base_bits})["t"]
        for share in shares:
            new = weights.copy()
            new[rng.choice(n, max(1, int(n * share)), replace=False)] *= 2.5
            new_bits = new.view(np.uint32)
            moved = moved_items(base_bits, new_bits)
            t_advance, t_sort = [], []
            for _ in range(args.repeat):
                entry = TensorOrder(base.order.copy(), base.counts.copy())
                started = time.perf_counter()
                ok = advance(entry, moved)
                t_advance.append(time.perf_counter() - started)
                started = time.perf_counter()
                fresh = visit_orders({"t": new_bits})["t"]
                t_sort.append(time.perf_counter() - started)
                assert ok and np.array_equal(entry.order, fresh.order) and np.array_equal(entry.counts, fresh.counts)
            advanced, sorted_ = statistics.median(t_advance), statistics.median(t_sort)
            rule = "advance" if worth_advancing(base, moved) else "sort"
            chosen = advanced if rule == "advance" else sorted_
            rows.append({"items": n, "moved": sum(o.size for _, o, _, _ in moved), "advance_s": advanced,
                         "sort_s": sorted_, "rule": rule, "rule_over_advance": chosen / advanced})
    if args.json:
        print(json.dumps({"advance_max_share": ADVANCE_MAX_SHARE, "rows": rows}, indent=2))
        return
    print(f"ADVANCE_MAX_SHARE = {ADVANCE_MAX_SHARE}; medians of {args.repeat} runs")
    print(f"{'items':>9} {'moved':>8} {'share':>7} {'advance':>10} {'sort':>10} {'rule':>8} {'rule/advance':>13}")
    for r in rows:
        print(f"{r['items']:>9} {r['moved']:>8} {r['moved'] / r['items']:>7.4f} {r['advance_s'] * 1e3:>7.2f} ms "
              f"{r['sort_s'] * 1e3:>7.2f} ms {r['rule']:>8} {r['rule_over_advance']:>12.2f}x")


if __name__ == "__main__":
    main()
