#!/usr/bin/env python3
"""Soak: a demo-sized swarm under background attacks for an hour; does any daemon's memory grow?

    bootstrap, learner (paced steps), 2 rollout peers (paced), a relay      -- real daemons, 127.0.0.1
    noise: a card flood (a raw DHT client storing cards under fresh subkeys every few seconds: half
           validly signed by fresh keys, half unsigned),
           lease hoarding (a client that asks for leases and never submits; a fresh identity when banned),
           slow readers (connections that drip-read chunks from the relay and the learner)
    every --sample-s: RSS and open file descriptors of each daemon (its children included: p2pd, the
    engine process), printed as a table row

At the end, for each daemon: RSS and fds at the end of the run against their value at --warmup-minutes,
each the median of 3 samples (a transient socket or a step's buffers is not growth), as a ratio; a
daemon passes when neither grows by more than 10 %. The largest value after the warm-up is shown too. Everything is paced so the machine is
mostly idle: the soak measures memory and descriptors, not speed.

    .venv/bin/python scripts/bench_soak.py --minutes 60          # the issue's run (~62 min)
    .venv/bin/python scripts/bench_soak.py --minutes 6 --warmup-minutes 2 --sample-s 20   # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from echo2swarm.runtime.processes import DaemonProcess, child_pids, loopback_args

GROWTH_LIMIT = 1.10


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def open_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, PermissionError):
        return 0


def footprint(daemon: DaemonProcess) -> tuple[int, int]:
    """RSS and fds of the daemon and every process it started (p2pd, the engine)."""
    pids = [daemon.pid, *child_pids(daemon.pid)]
    return sum(rss_bytes(p) for p in pids), sum(open_fds(p) for p in pids)


# -- noise -----------------------------------------------------------------------------------------
async def card_flood(bootstrap: str, swarm: str, stop: threading.Event, stats: dict[str, int], per_round: int) -> None:
    from hivemind.dht.node import DHTNode
    from hivemind.p2p import P2P
    from hivemind.utils.timed_storage import get_dht_time

    from echo2swarm.overlay.dht_keys import peers_key
    from echo2swarm.wire.peer_keys import PeerKey
    from echo2swarm.wire.records import PeerCard

    p2p = await P2P.create(initial_peers=[bootstrap], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    node = await DHTNode.create(p2p=p2p, initial_peers=[bootstrap], record_validator=None, client_mode=True)
    try:
        while not stop.is_set():
            for i in range(per_round):
                if i % 2:  # a validly signed card from a fresh key (free to make), claiming to be the cheapest peer
                    key = PeerKey.generate()
                    card = PeerCard(peer_id=key.peer_id, role="rollout", price=0.0, state="ready", software="0.1.0",
                                    rollouts_per_s=1e6, updated_ms=int(time.time() * 1000)).signed(key, swarm, 30)
                    subkey, value = key.peer_id, card.model_dump(mode="json")
                else:  # an unsigned one, which every validating node refuses
                    subkey = "12D3KooW" + secrets.token_hex(22)[:44]
                    value = {"peer_id": subkey, "role": "rollout", "price": 0.0, "state": "ready", "software": "0.1.0",
                             "rollouts_per_s": 1e6, "updated_ms": int(time.time() * 1000)}
                stored = await node.store(peers_key(swarm), value, get_dht_time() + 30, subkey=subkey)
                stats["cards_accepted" if stored else "cards_refused"] += 1
            await asyncio.sleep(5.0)  # pacing of the flood
    finally:
        await node.shutdown()
        await p2p.shutdown()


async def lease_hoarder(bootstrap: str, swarm: str, learner: str, stop: threading.Event, stats: dict[str, int]) -> None:
    from hivemind.p2p import P2P

    from echo2swarm.overlay.rpc import RpcStub
    from echo2swarm.wire.surfaces import LEARNER_RPC
    from echo2swarm.wire.work import Lease, LeaseRequest

    while not stop.is_set():
        p2p = await P2P.create(initial_peers=[bootstrap], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        stats["hoarder_identities"] += 1
        stub = RpcStub(p2p, swarm, LEARNER_RPC, learner)
        try:
            while not stop.is_set():
                try:
                    reply = await stub.lease(LeaseRequest(max_prompts=8), timeout=10)
                except Exception:
                    stats["hoarder_errors"] += 1
                    await asyncio.sleep(1.0)
                    continue
                if isinstance(reply, Lease):
                    stats["hoarded_prompts"] += len(reply.prompts)
                elif reply.done:  # banned: come back as someone else
                    stats["hoarder_banned"] += 1
                    break
                await asyncio.sleep(0.5)
        finally:
            await p2p.shutdown()


async def slow_reader(url: str, stop: threading.Event, stats: dict[str, int]) -> None:
    """Asks for a chunk and reads its body a kilobyte a second, forever (until the server cuts it)."""
    import aiohttp

    while not stop.is_set():
        try:
            async with aiohttp.ClientSession() as session:
                async with session.get(url + "/v1/info", timeout=aiohttp.ClientTimeout(total=10)) as r:
                    info = await r.json()
                version = info.get("version")
                async with session.get(f"{url}/v1/manifest/{version}", timeout=aiohttp.ClientTimeout(total=10)) as r:
                    manifest = json.loads(await r.read())["manifest"]
                sha = manifest["files"][0]["chunks"][0]["sha256"]
                async with session.get(f"{url}/v1/chunk/{sha}", timeout=aiohttp.ClientTimeout(total=120)) as r:
                    stats["slow_reads"] += 1
                    while not stop.is_set():
                        block = await r.content.read(1024)
                        if not block:
                            break
                        await asyncio.sleep(1.0)
        except Exception:
            stats["slow_reader_cut"] += 1
        await asyncio.sleep(1.0)


def run_noise(bootstrap: str, swarm: str, learner: dict[str, Any], relay: dict[str, Any], stop: threading.Event,
              stats: dict[str, int], cards_per_round: int) -> None:
    async def main() -> None:
        tasks = [
            asyncio.create_task(card_flood(bootstrap, swarm, stop, stats, cards_per_round)),
            asyncio.create_task(lease_hoarder(bootstrap, swarm, learner["peer_id"], stop, stats)),
            *(asyncio.create_task(slow_reader(url, stop, stats)) for url in (relay["chunk_url"], learner["chunk_url"])
              for _ in range(2)),
        ]
        while not stop.is_set():
            await asyncio.sleep(0.5)
            for t in tasks:
                if t.done() and t.exception() is not None:
                    stats[f"noise_failed_{type(t.exception()).__name__}"] += 1
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())


# -- the run ---------------------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=60.0, help="how long to soak after the swarm is up")
    parser.add_argument("--warmup-minutes", type=float, default=10.0, help="growth is measured from here on")
    parser.add_argument("--sample-s", type=float, default=60.0, help="seconds between samples")
    parser.add_argument("--cards-per-round", type=int, default=50, help="flood cards stored every 5 s")
    parser.add_argument("--out", type=Path, default=None, help="directory for the run (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print the samples and verdicts as JSON at the end")
    args = parser.parse_args()
    if args.warmup_minutes >= args.minutes:
        parser.error("--warmup-minutes must be below --minutes")
    # SIGTERM (or SIGINT, which a background job ignores) ends the run through `finally`: daemons stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from echo2swarm.models.tiny import write_tiny_model
    from echo2swarm.wire.signing import PolicyKey

    root = args.out or Path(tempfile.mkdtemp(prefix="echo2swarm-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    model = root / "model"
    if not (model / "config.json").exists():
        write_tiny_model(model, seed=0)
    key = root / "learner.key"
    if not key.exists():
        PolicyKey.generate().save(key)
    swarm = "soak" + secrets.token_hex(3)
    common = loopback_args(swarm, log_level="WARNING")
    toml = root / "learner.toml"
    toml.write_text(
        f'role = "learner"\n[publish]\nmodel = "{model}"\npolicy_key = "{key}"\n'
        "[train]\ntask = \"arith\"\nsteps = 1000000\nstaleness = 1\nprompts_per_step = 8\ngroup_size = 4\n"
        "max_new_tokens = 4\nthreads = 1\ncheckpoint_every = 200\nmin_step_s = 1.0\n"
        "[leases]\nmax_prompts = 4\ntimeout_s = 10.0\n[peers]\nwindow_s = 20.0\n"
    )
    paced = {"ECHO2SWARM_WORKER__MAX_ROLLOUTS_PER_S": "40", "ECHO2SWARM_ENGINE__THREADS": "1", "OMP_NUM_THREADS": "1"}
    daemons: list[DaemonProcess] = []
    noise: threading.Thread | None = None
    stop = threading.Event()
    stats: Counter[str] = Counter()
    samples: list[dict[str, Any]] = []
    try:
        boot = DaemonProcess("bootstrap", [*common, "--role", "bootstrap", "--new-swarm"], root / "bootstrap")
        daemons.append(boot.start())
        boot.wait_ready(60)
        join = ["--initial-peers", boot.maddr]
        learner = DaemonProcess("learner", [*common, *join, "--config", str(toml)], root / "learner")
        daemons.append(learner.start())
        for i in (1, 2):
            daemons.append(DaemonProcess(f"rollout-{i}", [*common, *join, "--role", "rollout", "--price", f"0.{i}",
                                                         "--trust", f"{key}.pub"], root / f"rollout-{i}", env=paced).start())
        relay = DaemonProcess("relay", [*common, *join, "--role", "relay", "--trust", f"{key}.pub"], root / "relay")
        daemons.append(relay.start())
        for d in daemons:
            d.wait_ready(180)
        noise = threading.Thread(target=run_noise, args=(boot.maddr, swarm, learner.info, relay.info, stop, stats,
                                                          args.cards_per_round), daemon=True)
        noise.start()
        started = time.monotonic()
        names = [d.name for d in daemons]
        print(f"soak in {root}: swarm {swarm}, {args.minutes:g} min, a sample every {args.sample_s:g} s", flush=True)
        print("min    " + "  ".join(f"{n:>20}" for n in names) + "   (RSS MiB / fds)", flush=True)
        while True:
            elapsed = time.monotonic() - started
            row = {"minute": round(elapsed / 60, 2)}
            for d in daemons:
                if not d.running():
                    raise RuntimeError(f"{d.name} exited:\n{d.log_tail()}")
                rss, fds = footprint(d)
                row[d.name] = {"rss": rss, "fds": fds}
            samples.append(row)
            print(f"{row['minute']:6.1f} " + "  ".join(
                f"{row[n]['rss'] / 2**20:13.1f} / {row[n]['fds']:4d}" for n in names) + f"   noise {dict(stats)}", flush=True)
            if elapsed >= args.minutes * 60:
                break
            time.sleep(min(args.sample_s, max(0.0, args.minutes * 60 - elapsed)))
    finally:
        stop.set()
        if noise is not None:
            noise.join(30)  # its libp2p daemons shut down before ours do
        for d in reversed(daemons):
            d.terminate()

    verdicts = {}
    at = next(i for i, s in enumerate(samples) if s["minute"] >= args.warmup_minutes)
    base, end, later = samples[max(0, at - 1):at + 2], samples[-3:], samples[at:]
    for name in names:
        ratio = {}
        for what in ("rss", "fds"):
            start = max(1, statistics.median(s[name][what] for s in base))
            ratio[what] = statistics.median(s[name][what] for s in end) / start
            ratio[f"{what}_max"] = max(s[name][what] for s in later) / start
        ok = ratio["rss"] <= GROWTH_LIMIT and ratio["fds"] <= GROWTH_LIMIT
        verdicts[name] = {**{k: round(v, 3) for k, v in ratio.items()}, "ok": ok}
        print(f"{name:>10}: end / minute {samples[at]['minute']:.0f}: RSS {ratio['rss']:.3f} (max {ratio['rss_max']:.3f}), "
              f"fds {ratio['fds']:.3f} (max {ratio['fds_max']:.3f})  {'ok' if ok else 'GROWS'} (limit {GROWTH_LIMIT:.2f})")
    print(f"noise over the run: {dict(stats)}")
    if args.json:
        print(json.dumps({"samples": samples, "verdicts": verdicts, "noise": dict(stats)}))
    return 0 if all(v["ok"] for v in verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
