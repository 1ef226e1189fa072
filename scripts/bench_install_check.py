#!/usr/bin/env python
"""What checking a dense version costs a follower: time and peak memory, ours against the load-it-all check.

    python scripts/bench_install_check.py [--gib 1.0] [--repeats 3]

Publishes one dense bf16 version (random tensors in a Qwen3-like mix of shapes, --gib of weights)
with the learner's VersionWriter into a temporary store, then checks it (every tensor's name, dtype,
shape and signed sha256) three ways, each in a fresh process so that its peak RSS is its own:

    load-all    what `catchup.check_dense` did before: safetensors.load_file of the whole file, then
                sha256 of each tensor's bytes (a copy of each made by tobytes), one at a time
    map, 1      `check_dense` with catchup.HASH_THREADS = 1: the file read through a memory map,
                tensors hashed in place, one at a time
    map, N      `check_dense` as shipped: the same on HASH_THREADS threads (min(8, CPUs))

Prints the best of --repeats wall seconds, the growth of the process's peak RSS during the check
(VmHWM after it, less before it, with torch and the checks' modules already imported; pages of
a memory map count while they are resident, though they are clean page cache that the kernel can
take back, where load-all's copies are anonymous memory), and the ratios against load-all.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _publish(root: Path, gib: float) -> None:
    import torch

    from echo2swarm.learner.versions import VersionWriter
    from echo2swarm.policy.store import ChunkStore, VersionStore
    from echo2swarm.wire.signing import PolicyKey

    hidden = 2048
    items = int(gib * (1 << 30) / 2)
    layer = 4 * hidden * hidden + 3 * hidden * 2 * hidden  # q, k, v, o + gate, up, down
    layers = max(1, items // layer - 1)
    g = torch.Generator().manual_seed(0)
    state = {"embed.weight": torch.randn(items - layers * layer, generator=g).bfloat16()}
    for i in range(layers):
        for name, shape in (("q", (hidden, hidden)), ("k", (hidden, hidden)), ("v", (hidden, hidden)),
                            ("o", (hidden, hidden)), ("gate", (2 * hidden, hidden)), ("up", (2 * hidden, hidden)),
                            ("down", (hidden, 2 * hidden))):
            state[f"layers.{i}.{name}.weight"] = (torch.randn(shape, generator=g) * 0.02).bfloat16()
    writer = VersionWriter("bench", PolicyKey.generate(), ChunkStore(root), VersionStore(root), "auto", "bench")
    writer.write_state(state, {"config.json": b"{}"}, 1, previous=None, keyframe=None, keyframe_every=10,
                            max_ratio=0.5)


def _peak_rss() -> int:
    """This process's peak resident set, bytes: /proc's VmHWM (ru_maxrss would carry the parent's
    peak over the exec of a spawned process)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _check(root: str, mode: str, out: mp.Queue) -> None:
    __import__("torch")  # imported by every mode before the clock starts
    from safetensors.torch import load_file

    from echo2swarm.policy import catchup
    from echo2swarm.policy.delta import tensor_sha256
    from echo2swarm.policy.store import VersionStore

    versions = VersionStore(Path(root))
    manifest = versions.manifest(1)
    assert manifest is not None
    base = _peak_rss()
    started = time.perf_counter()
    if mode == "load-all":
        tensors = load_file(str(versions.dir(1) / manifest.tensors[0].file))
        for t in manifest.tensors:
            assert tensor_sha256(tensors[t.name]) == t.sha256, t.name
        del tensors
    else:
        catchup.HASH_THREADS = 1 if mode == "map, 1" else catchup.HASH_THREADS
        catchup.check_dense(manifest, versions.dir(1))
    seconds = time.perf_counter() - started
    out.put((seconds, _peak_rss() - base))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0, help="weights to check, GiB of bf16 (default 1.0)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not 0.01 <= args.gib <= 64 or args.repeats < 1:
        parser.error("--gib must be in 0.01..64 and --repeats >= 1")
    from echo2swarm.policy.catchup import HASH_THREADS

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="bench-check-") as tmp:
        started = time.perf_counter()
        _publish(Path(tmp), args.gib)
        print(f"published a {args.gib:g} GiB bf16 version in {time.perf_counter() - started:.1f} s; "
              f"{os.cpu_count()} CPUs, HASH_THREADS {HASH_THREADS}", flush=True)
        rows = {}
        for mode in ("load-all", "map, 1", f"map, {HASH_THREADS}"):
            runs = []
            for _ in range(args.repeats):
                out: mp.Queue = ctx.Queue()
                proc = ctx.Process(target=_check, args=(tmp, mode if mode != f"map, {HASH_THREADS}" else "map, N", out))
                proc.start()
                runs.append(out.get(timeout=600))
                proc.join()
            rows[mode] = (min(s for s, _ in runs), max(m for _, m in runs))
        first = rows["load-all"]
        print(f"{'check':<10} {'best s':>7} {'peak RSS MiB':>13} {'speed-up':>9} {'memory':>7}")
        for mode, (seconds, rss) in rows.items():
            print(f"{mode:<10} {seconds:>7.2f} {rss / (1 << 20):>13.0f} {first[0] / seconds:>8.2f}x "
                  f"{rss / max(first[1], 1):>6.2f}x")


if __name__ == "__main__":
    main()
