#!/usr/bin/env python
"""Entropy of bf16 delta versions under contexts a follower can know (analysis for issue 19).

    python scripts/analyze_delta_contexts.py DIR [--prefix lr1e-05] [--json OUT]

DIR holds <prefix>_v0.safetensors, <prefix>_v1.safetensors, ... (bf16 state dicts of consecutive versions).
For each pair v-1 -> v it prints the empirical conditional entropy of "which items changed" (positions)
and "by how much" (z = zigzag(new - base) - 1 of each change) given each context, plus the side
information the context needs, as bits per item and as the implied ratio 16 / bits-per-item (dense
bf16 over the floor). Contexts (key = the base's 8 bits under the sign, e2s-delta/2's class):
  key                    e2s-delta/2's model
  key x tensor           a rate per (tensor, key)
  key x row q / col q    per row (column) a 3-bit quantised rate multiplier, sent (3 bits a row)
  key x prev             the previous delta (v-2 -> v-1): unchanged / -1 / +1 / <-1 / >+1 ulp
  key x prevmag          the previous delta's sign x log2|d| (1, 2-3, 4-7, 8-15, 16-31, 32+ ulps): 13 values
  key x prev x prev2     also the delta before (v-3 -> v-2)
  values x rowsignq      per row a 2-bit quantised fraction of positive changes, sent (values only)
  key x prevrow          the row's rate multiplier in the previous delta (free: the follower knows it)
  key x mant*            the base's mantissa bits
Table costs (a 16-bit rate per non-empty context cell) are counted as side information. Values z >= 63
count as one symbol plus 16 raw bits, so every floor here is ~1-2 % below bench_delta.py's `floor` (which
models z over all 2^16 values); the differences between contexts are what this measures. The versions can be
written by a scratch run of bench_delta.py's steps that saves trainer.weights_state(torch.bfloat16) per version.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_delta import _counts_bits as counts_bits  # noqa: E402  (the same order-0 entropy as the bench's floor)

from echo2swarm.policy.delta import tensor_bits  # noqa: E402

ZCAP = 64  # values z >= ZCAP - 1 are coded as one symbol plus 16 raw bits


def load(path: Path):
    state = load_file(str(path))
    names = sorted(state)
    bits, rows, cols, tids = [], [], [], []
    row_base = 0
    for i, name in enumerate(names):
        t = state[name]
        b = tensor_bits(t)
        assert b.dtype == np.uint16, f"{name}: itemsize {b.dtype.itemsize}"
        n = b.size
        ncols = t.shape[-1] if t.dim() >= 2 else n
        idx = np.arange(n, dtype=np.int64)
        rows.append((idx // ncols + row_base).astype(np.int32))
        cols.append((idx % ncols).astype(np.int32) + (i << 20))
        row_base += n // ncols
        bits.append(b)
        tids.append(np.full(n, i, np.int16))
    return names, np.concatenate(bits), np.concatenate(rows), np.concatenate(cols), np.concatenate(tids)


def load_bits(path: Path) -> np.ndarray:
    state = load_file(str(path))
    return np.concatenate([tensor_bits(state[name]) for name in sorted(state)])


def h_pos(ctx: np.ndarray, changed: np.ndarray) -> tuple[float, int]:
    """H(changed | ctx) in bits, and the non-empty contexts (for the table's cost)."""
    c = np.bincount(ctx.astype(np.int64) * 2 + changed, minlength=2)
    c = np.append(c, np.zeros(c.size % 2, np.int64)).reshape(-1, 2)
    return counts_bits(c), int(np.count_nonzero(c.sum(axis=1)))


def h_val(ctx: np.ndarray, z: np.ndarray) -> tuple[float, int]:
    """H(min(z, ZCAP-1) | ctx) + 16 bits per escape, and the non-empty (ctx, z) cells."""
    zc = np.minimum(z, ZCAP - 1).astype(np.int64)
    c = np.bincount(ctx.astype(np.int64) * ZCAP + zc)
    c = np.append(c, np.zeros((-c.size) % ZCAP, np.int64)).reshape(-1, ZCAP)
    return counts_bits(c) + 16.0 * int(np.count_nonzero(z >= ZCAP - 1)), int(np.count_nonzero(c))


def prev_cat(base: np.ndarray, new: np.ndarray) -> np.ndarray:
    """0 unchanged, 1: d = -1, 2: d = +1, 3: d < -1, 4: d > +1 (d = new - base bits, signed)."""
    d = (new - base).view(np.int16)
    cat = np.zeros(d.size, np.uint8)
    cat[d == -1] = 1
    cat[d == 1] = 2
    cat[d < -1] = 3
    cat[d > 1] = 4
    return cat


def prev_mag(base: np.ndarray, new: np.ndarray) -> np.ndarray:
    """0 unchanged; else 1 + 2 * min(floor(log2|d|), 5) + (d > 0): sign x |d| in 1, 2-3, 4-7, 8-15, 16-31, 32+."""
    d = (new - base).view(np.int16).astype(np.int32)
    a = np.abs(d)
    lg = np.minimum(np.floor(np.log2(np.maximum(a, 1))).astype(np.int32), 5)
    return np.where(d == 0, 0, 1 + 2 * lg + (d > 0)).astype(np.uint8)


def group_q(group: np.ndarray, changed: np.ndarray, expected: np.ndarray, levels: int = 8,
            step: float = 0.5) -> np.ndarray:
    """Per group (row / column id): round(log2(observed / expected) / step), clipped to `levels` values
    centred on 0 (as 0..levels-1); returned per group id."""
    ng = int(group.max()) + 1
    obs = np.bincount(group, weights=changed, minlength=ng)
    exp = np.bincount(group, weights=expected, minlength=ng)
    q = np.round(np.log2((obs + 0.5) / (exp + 0.5)) / step) + levels // 2
    return np.clip(q, 0, levels - 1).astype(np.uint8)


def entropy_of(symbols: np.ndarray) -> float:
    _, c = np.unique(symbols, return_counts=True)
    return counts_bits(c[None, :])


def analyze_pair(key, changed, z, prev, prevm, prev2, rows, cid, tids, mant, prev_changed_rowq, prev_changed_colq):
    n = key.size
    out = {}
    key32 = key.astype(np.int32)
    # global rate per key: the "expected" change probability per item
    kc = np.bincount(key32 * 2 + changed, minlength=512).reshape(256, 2)
    p_key = kc[:, 1] / np.maximum(kc.sum(axis=1), 1)
    expected = p_key[key]
    zidx = np.flatnonzero(changed)

    def add(label, ctx, side_bits=0.0, vctx=None):
        hp, cells = h_pos(ctx, changed)
        vc = ctx if vctx is None else vctx
        hv, vcells = h_val(vc[zidx], z)
        table = 16.0 * (cells + vcells)
        total = hp + hv + side_bits + table
        out[label] = {"pos_bits": hp, "val_bits": hv, "side_bits": side_bits + table, "bits_per_item": total / n,
                      "ratio": 16.0 * n / total, "pos_bpi": hp / n, "val_per_change": hv / max(zidx.size, 1)}

    add("key", key32)
    add("key x tensor", tids.astype(np.int32) * 256 + key32)
    # sent per-row / per-column multipliers (3 bits each, or their order-0 entropy)
    rq = group_q(rows, changed, expected)
    add("key x rowq (sent, 3 bit/row)", key32 * 8 + rq[rows], side_bits=3.0 * rq.size, vctx=key32)
    cq = group_q(cid, changed, expected)
    add("key x colq (sent, 3 bit/col)", key32 * 8 + cq[cid], side_bits=3.0 * cq.size, vctx=key32)
    add("key x rowq x colq (sent)", (key32 * 8 + rq[rows]) * 8 + cq[cid], side_bits=3.0 * (rq.size + cq.size),
        vctx=key32)
    out["_side_rows_cols"] = {"rows": int(rq.size), "cols": int(cq.size), "rowq_entropy_bits": entropy_of(rq),
                             "colq_entropy_bits": entropy_of(cq)}
    # mantissa contexts
    add("key x mant top3", key32 * 8 + (mant >> 4))
    edge = np.where(mant == 0, 0, np.where(mant == 127, 2, 1)).astype(np.int32)
    add("key x mant edge(0/mid/127)", key32 * 3 + edge)
    if prev is not None:
        pc = prev.astype(np.int32)
        add("key x prev", key32 * 5 + pc)
        add("key x prevrowq (free)", key32 * 8 + prev_changed_rowq[rows])
        add("key x prev x prevrowq (free)", (key32 * 5 + pc) * 8 + prev_changed_rowq[rows])
        add("key x prev x prevrowq x prevcolq (free)",
            ((key32 * 5 + pc) * 8 + prev_changed_rowq[rows]) * 8 + prev_changed_colq[cid])
        add("key x prev x rowq (sent)", (key32 * 5 + pc) * 8 + rq[rows], side_bits=3.0 * rq.size)
        add("key x prev x rowq x colq (sent)", ((key32 * 5 + pc) * 8 + rq[rows]) * 8 + cq[cid],
            side_bits=3.0 * (rq.size + cq.size))
        add("key x prev, values by key only", key32 * 5 + pc, vctx=key32)
        if prev2 is not None:
            add("key x prev x prev2", (key32 * 5 + pc) * 5 + prev2.astype(np.int32))
            add("key x prev x prev2 x prevrowq x prevcolq (free)",
                (((key32 * 5 + pc) * 5 + prev2.astype(np.int32)) * 8 + prev_changed_rowq[rows]) * 8
                + prev_changed_colq[cid])
        pm = prevm.astype(np.int32)
        add("key x prevmag(13)", key32 * 13 + pm)
        add("key x prevmag x prevrowq (free)", (key32 * 13 + pm) * 8 + prev_changed_rowq[rows])
        zsign = np.zeros(key.size, np.float64)
        zsign[zidx] = (z % 2 == 1)  # z odd: d > 0
        pos_frac = np.bincount(rows, weights=zsign, minlength=rq.size) / np.maximum(
            np.bincount(rows, weights=changed, minlength=rq.size), 1)
        sq = np.clip(np.floor(pos_frac * 4), 0, 3).astype(np.int32)
        add("key x prevmag; values x rowsignq (sent, 2 bit/row)", key32 * 13 + pm,
            side_bits=2.0 * rq.size, vctx=(key32 * 13 + pm) * 4 + sq[rows])
        add("key x prevmag x rowq (sent)", (key32 * 13 + pm) * 8 + rq[rows], side_bits=3.0 * rq.size)
        if prev2 is not None:
            p2 = prev2.astype(np.int32)
            add("key x prevmag x prev2", (key32 * 13 + pm) * 5 + p2)
            add("key x prevmag x prev2 x prevrowq (free)", ((key32 * 13 + pm) * 5 + p2) * 8 + prev_changed_rowq[rows])
            add("key x prevmag x prev2 x rowq (sent)", ((key32 * 13 + pm) * 5 + p2) * 8 + rq[rows],
                side_bits=3.0 * rq.size)
        # sign of the change given the previous change's sign (changed items, z in {0, 1})
        pm = pc[zidx]
        small = z <= 1
        tab = np.zeros((5, 2), np.int64)
        np.add.at(tab, (pm[small], z[small].astype(np.int64)), 1)
        out["_sign_given_prev"] = {"rows: prev unchanged/-1/+1/<-1/>+1; cols: now -1, +1": tab.tolist()}
        # P(changed | prev)
        t2 = np.bincount(pc * 2 + changed, minlength=10).reshape(5, 2)
        out["_p_changed_given_prev"] = (t2[:, 1] / np.maximum(t2.sum(axis=1), 1)).tolist()
    return out, rq, cq


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path)
    ap.add_argument("--prefix", default="lr1e-05")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    paths = sorted(a.dir.glob(f"{a.prefix}_v*.safetensors"), key=lambda p: int(p.stem.split("_v")[1]))
    names, bits0, rows, cols, tids = load(paths[0])
    n = bits0.size
    print(f"{a.prefix}: {len(paths)} versions, {len(names)} tensors, {n / 1e6:.1f}M bf16 items, "
          f"{int(rows.max()) + 1} rows", flush=True)
    cid = np.unique(cols, return_inverse=True)[1].astype(np.int32)
    del cols
    states = [bits0]
    prev = prev2 = prevm = None
    prev_rowq = prev_colq = None
    report = []
    for v in range(1, len(paths)):
        t0 = time.perf_counter()
        new = load_bits(paths[v])
        base = states[-1]
        changed = (base != new).astype(np.uint8)
        d = (new - base).view(np.int16).astype(np.int32)
        zz = np.where(d >= 0, 2 * d, -2 * d - 1) - 1
        z = zz[changed.astype(bool)].astype(np.int64)
        key = ((base >> 7) & 0xFF).astype(np.uint8)
        mant = (base & 0x7F).astype(np.int32)
        res, rq, cq = analyze_pair(key, changed, z, prev, prevm, prev2, rows, cid, tids, mant, prev_rowq, prev_colq)
        res["_changed_frac"] = float(changed.mean())
        report.append({"version": v, **res})
        print(f"\n## v{v - 1} -> v{v}: changed {changed.mean():.2%} ({time.perf_counter() - t0:.0f} s)", flush=True)
        for label, r in res.items():
            if label.startswith("_"):
                print(f"   {label}: {r}")
                continue
            print(f"{r['ratio']:7.2f}x {r['bits_per_item']:.4f} b/item (pos {r['pos_bpi']:.4f}, "
                  f"val {r['val_per_change']:.3f} b/change, side {r['side_bits'] / 8e3:.1f} KB)  {label}", flush=True)
        # the follower's knowledge for the next pair
        prev2 = prev
        prev = prev_cat(base, new)
        prevm = prev_mag(base, new)
        prev_rowq, prev_colq = rq, cq
        states = [new]
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
