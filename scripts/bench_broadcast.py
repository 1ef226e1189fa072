#!/usr/bin/env python
"""Broadcast time of one policy version to N peers, star vs peer-assisted pipelined (ECHO-2 Fig. 4).

    python scripts/bench_broadcast.py [--model-bytes 128MiB] [--receivers 1,2,4,8,12]
                                      [--upload-limit 16MiB] [--chunk-size 1MiB] [--png docs/bench_broadcast.png]

Real daemons as separate processes on 127.0.0.1: a bootstrap node, N relay peers (they follow
and re-serve versions exactly as rollout peers do, without generating), then a learner that
publishes a synthetic Qwen3-style model of about M bytes as version 1. Every daemon's upload,
the learner's included, is capped at B with `--upload-limit`, emulating WAN uplinks.

    star       every relay fetches only from the learner (`--no-peer-assist`)
    pipelined  ours: the learner's signed stripe-and-chain plan, re-serving while fetching
    ideal      not run: M / B, the time for the learner to upload one copy

Every peer's state dir is in /dev/shm unless --on-disk: on one machine all N peers would share one
disk (each writes every byte twice, chunk store and installed version), while real peers each have
their own. T_bcast is measured from outside: from when the learner's signed head first appears on its chunk
server until the last relay holds the installed version (polled every 50 ms). The learner's own
T_bcast (peers' reported arrival times, what the capacity model uses) is printed beside it, and
so is the learner's upload per version.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from echo2swarm.config.units import format_bytes, parse_bytes  # noqa: E402
from echo2swarm.runtime.processes import DaemonProcess, child_pids, loopback_args, pid_alive, wait_until  # noqa: E402

SWARM = "bench-bcast"


def write_model(path: Path, target_bytes: int) -> int:
    """A Qwen3-style model of about `target_bytes` (fp32), with the tiny tokenizer; returns its size."""
    from echo2swarm.models.tiny import build_tiny_model

    hidden = 1024
    per_layer = 4 * (2 * hidden * hidden + 2 * hidden * 256 + 3 * hidden * 2 * hidden)
    layers = max(1, round(target_bytes / per_layer))
    model, tokenizer = build_tiny_model(seed=0, hidden_size=hidden, num_layers=layers, num_heads=8)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def relay_cards(addr: str) -> int:
    """How many relay cards the DHT holds, read by a short-lived client node."""
    import asyncio

    from echo2swarm.config.models import OverlayConfig
    from echo2swarm.overlay.node import Overlay

    async def count() -> int:
        overlay = await Overlay.start(OverlayConfig(swarm=SWARM, initial_peers=[addr], host_maddrs=[]), client_mode=True)
        try:
            cards, _ = await overlay.get_cards()
            return sum(c.role == "relay" for c in cards)
        finally:
            await overlay.stop()

    return asyncio.run(count())


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far (Linux /proc), 0 where unavailable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def get_json(url: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return json.loads(resp.read())
    except OSError:
        return None


def run_once(root: Path, model: Path, key: Path, n: int, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    daemons: list[DaemonProcess] = []
    children: set[int] = set()
    limit = ["--upload-limit", str(args.upload_limit)]
    env = {"ECHO2SWARM_FETCH__HEAD_POLL_S": "0.2", "ECHO2SWARM_FETCH__PARALLEL_CHUNKS": str(args.parallel_chunks)}

    def start(name: str, *extra: str, env: dict[str, str] | None = None) -> DaemonProcess:
        # Announce every 2 s rather than the loopback default 1 s: each DHT store and read costs every
        # co-located node CPU, and the broadcast does not wait for cards (the bench polls the peers).
        slower = ["--announce-period", "2", "--record-ttl", "6"]
        d = DaemonProcess(name, [*loopback_args(SWARM, "INFO"), *slower, *extra], root / name, env=env).start()
        daemons.append(d)
        return d

    try:
        boot = start("bootstrap", "--role", "bootstrap", "--new-swarm")
        boot.wait_ready(60)
        join = ["--initial-peers", boot.maddr]
        assist = ["--no-peer-assist"] if mode == "star" else []
        relays = [start(f"relay{i}", "--role", "relay", "--trust", f"{key}.pub", *join, *limit, *assist, env=env)
                  for i in range(n)]
        for relay in relays:
            relay.wait_ready(120)
        # The learner plans over the relay cards it sees when it publishes: wait for all of them.
        wait_until(lambda: relay_cards(boot.maddr) >= n, 60, interval=0.5, what="relay cards")
        learner = start("learner", "--role", "learner", "--model", str(model), "--policy-key", str(key),
                        "--chunk-size", args.chunk_size, *join, *limit)
        # The head appears on the learner's server as soon as version 1 is published (before daemon.json).
        port_file = root / "learner" / "daemon.json"
        wait_until(port_file.exists, 300, interval=0.02, what="learner up")
        url = json.loads(port_file.read_text())["chunk_url"]
        wait_until(lambda: get_json(url + "/v1/head"), 60, interval=0.02, what="learner head")
        published = time.monotonic()
        urls = [json.loads((root / r.name / "daemon.json").read_text())["chunk_url"] for r in relays]
        done: dict[str, float] = {}
        deadline = published + args.timeout
        while len(done) < n and time.monotonic() < deadline:
            for u in urls:
                if u not in done and (info := get_json(u + "/v1/info")) and 1 in info.get("versions", []):
                    done[u] = time.monotonic() - published
            time.sleep(0.1)  # polling N relays costs them CPU too: keep it light
        if len(done) < n:
            raise RuntimeError(f"{mode} N={n}: only {len(done)} of {n} relays got the version in {args.timeout:.0f} s")
        t_learner = None
        learner_bytes = 0
        for _ in range(40):  # the learner sees the last arrival at its next card refresh
            info = get_json(url + "/v1/info") or {}
            stats = info.get("stats", {})
            learner_bytes = stats.get("server", {}).get("bytes_served", 0)
            t_learner = stats.get("t_bcast", {}).get("1")
            if t_learner is not None or mode == "star":
                break
            time.sleep(0.25)
        for d in daemons:
            children.update(child_pids(d.pid))
        return {"mode": mode, "n": n, "t_bcast_s": max(done.values()), "t_first_s": min(done.values()),
                "t_bcast_learner_s": t_learner, "learner_bytes": learner_bytes,
                "relay_cpu_s": sum(cpu_seconds(r.pid) for r in relays) / n, "learner_cpu_s": cpu_seconds(learner.pid)}
    finally:
        for d in reversed(daemons):
            if d.running():
                children.update(child_pids(d.pid))
            d.terminate(grace=10)
        for pid in children:
            if pid_alive(pid):
                os.kill(pid, 9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-bytes", default="128MiB", help="synthetic model size M (default 128MiB)")
    parser.add_argument("--receivers", default="1,2,4,8,12", help="comma-separated N to sweep")
    parser.add_argument("--upload-limit", default="16MiB", help="every peer's upload cap B, bytes/s (default 16MiB)")
    parser.add_argument("--chunk-size", default="1MiB", help="learner chunk size (default 1MiB)")
    parser.add_argument("--parallel-chunks", type=int, default=4, help="chunks in flight per fetcher (default 4)")
    parser.add_argument("--modes", default="star,pipelined", help="comma-separated: star, pipelined")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one broadcast may take")
    parser.add_argument("--png", type=Path, help="write a plot of T_bcast vs N here")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    parser.add_argument("--on-disk", action="store_true",
                        help="keep the peers' state dirs on disk instead of /dev/shm (all peers then share one disk)")
    parser.add_argument("--keep", type=Path, help="run in this directory and keep the daemons' logs and state")
    args = parser.parse_args()
    try:
        receivers = [int(x) for x in args.receivers.split(",") if x]
        modes = [m for m in args.modes.split(",") if m]
        bandwidth = parse_bytes(args.upload_limit.removesuffix("/s"))
        target = parse_bytes(args.model_bytes)
        if any(n < 1 for n in receivers) or not set(modes) <= {"star", "pipelined"}:
            raise ValueError("--receivers are integers >= 1; --modes are star and/or pipelined")
    except ValueError as e:
        parser.error(str(e))

    # Co-located peers share this machine's one disk, which real peers do not: at N = 8 the VM's
    # ~240 MB/s of writeback, not the protocol, set the pace. State dirs live in RAM by default.
    base = None if args.on_disk or not Path("/dev/shm").is_dir() else "/dev/shm"
    with tempfile.TemporaryDirectory(prefix="bench-bcast-", dir=base) as tmp:
        tmp_path = Path(tmp)
        if args.keep:
            tmp_path = args.keep
            tmp_path.mkdir(parents=True, exist_ok=False)
        model = tmp_path / "model"
        model_bytes = write_model(model, target)
        key = tmp_path / "learner.key"
        from echo2swarm.wire.signing import PolicyKey

        PolicyKey.generate().save(key)
        (tmp_path / "learner.key.pub").write_text(PolicyKey.load(key).public.text + "\n")
        ideal = model_bytes / bandwidth
        print(f"M = {format_bytes(model_bytes)}, B = {format_bytes(bandwidth)}/s, chunk {args.chunk_size}, "
              f"ideal M/B = {ideal:.2f} s", file=sys.stderr, flush=True)
        rows = []
        for n in receivers:
            for mode in modes:
                run_dir = tmp_path / f"{mode}-{n}"
                row = run_once(run_dir, model, key, n, mode, args)
                if not args.keep:  # N peers x 2 copies of M each: in /dev/shm that is RAM the next run needs
                    shutil.rmtree(run_dir, ignore_errors=True)
                row.update(ideal_s=ideal, ratio=row["t_bcast_s"] / ideal, learner_copies=row["learner_bytes"] / model_bytes)
                rows.append(row)
                print(f"  {mode:>9} N={n:<3} T_bcast {row['t_bcast_s']:7.2f} s  ({row['ratio']:.2f}x ideal)  "
                      f"learner uploaded {row['learner_copies']:.2f} M  CPU s: relay {row['relay_cpu_s']:.1f} (mean, "
                      f"start-up included), learner {row['learner_cpu_s']:.1f}", file=sys.stderr, flush=True)

    if args.json:
        print(json.dumps({"model_bytes": model_bytes, "upload_limit": bandwidth, "rows": rows}, indent=2))
    else:
        print(f"\nM = {format_bytes(model_bytes)}, B = {format_bytes(bandwidth)}/s, ideal M/B = {ideal:.2f} s")
        print(f"{'N':>3} {'mode':>9} {'T_bcast s':>10} {'x ideal':>8} {'learner T_bcast s':>18} {'first s':>8} "
              f"{'learner upload':>15}")
        for r in rows:
            t_l = f"{r['t_bcast_learner_s']:.2f}" if r["t_bcast_learner_s"] is not None else "-"
            print(f"{r['n']:>3} {r['mode']:>9} {r['t_bcast_s']:>10.2f} {r['ratio']:>8.2f} {t_l:>18} "
                  f"{r['t_first_s']:>8.2f} {r['learner_copies']:>13.2f} M")
        for n in receivers:
            by_mode = {r["mode"]: r for r in rows if r["n"] == n}
            if len(by_mode) == 2:
                print(f"N={n}: star / pipelined = {by_mode['star']['t_bcast_s'] / by_mode['pipelined']['t_bcast_s']:.2f}x")
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for mode in modes:
            pts = [(r["n"], r["t_bcast_s"]) for r in rows if r["mode"] == mode]
            ax.plot(*zip(*pts), marker="o", label=mode)
        ax.axhline(ideal, color="gray", linestyle="--", label="ideal M/B")
        ax.set_xlabel("receivers N")
        ax.set_ylabel("T_bcast (s)")
        ax.set_title(f"Broadcast of {format_bytes(model_bytes)} at {format_bytes(bandwidth)}/s per peer")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)
        print(f"plot: {args.png}", file=sys.stderr)


if __name__ == "__main__":
    main()
