#!/usr/bin/env python
"""Broadcast time of one policy version to N peers, star vs peer-assisted pipelined (ECHO-2 Fig. 4).

    python scripts/bench_broadcast.py [--model-bytes 128MiB] [--receivers 1,2,4,8,12]
                                      [--upload-limit 16MiB] [--chunk-size 1MiB] [--png docs/bench_broadcast.png]
    python scripts/bench_broadcast.py --stream 4 --delta [--receivers 8] [--upload-limit 1.5MiB] [--model-bytes 40MB]
                                      [--delta-only] [--delta-chunk-size 64KiB] [--head-poll-s 2]
    sudo python scripts/bench_broadcast.py --wan [--receivers 2,4,8] [--wan-up-mbit 24] [--model-bytes 32MB]

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
so is the learner's upload per version. Every run also prints what hedged requests (policy/hedge.py) cost
the followers: hedges fired and won, and the bytes they received over the verified bytes they needed
(the duplicates are what requests cancelled because another copy won had received).

`--stream V [--delta]`: T_bcast of a stream of V versions that a real learner trains (GRPO on arith
with operands 0..4, lr 1e-6, one AdamW update and one bf16 version per step, on-policy so that each
version waits for the last) on a Qwen3-style model (Qwen3's init, std 0.02; ~40 MB in bf16; a short
supervised warm-up so that groups have mixed rewards and steps move weights), fed by one rollout
peer; N relays follow. The dense run publishes with `publish.keyframe_every = 1` (every version
dense, on the wire too); with --delta the same stream is run again with the default keyframes (v2..
are deltas). Per version: T_bcast (learner's manifest for v written -> last relay's manifest for v
written, read from their stores every 20 ms), its parts (relays' own head-seen -> installed time, and
the rest: the head's way to them), the learner's chunk-server bytes while v was newest, each relay's
bytes fetched for v, and dense/delta in the same run.

Every row also prints what `echo2swarm simulate`'s broadcast model predicts for the same swarm
(sim/broadcast.py `lab_broadcast`: the same N, M, chunk size, stripes and caps, the learner's real
stripe-and-chain plan; in the WAN lab the homes and how many of them punched as measured) and the
model over the measurement: the calibration of the simulator against real daemons (issue 35).

`--wan`: the Fig. 4 comparison inside the WAN lab (tests/helpers/wanlab.py; root, ip netns, tc,
iptables): a fresh lab per (N, mode) with a public bootstrap and learner, N relay receivers of which
3 of every 4 are in their own home behind a NAT router (N = 2: 1 + 1), every uplink capped by the
kernel (tbf, --wan-up-mbit) and no --upload-limit; daemons started through the CLI in their
namespaces with no NAT flags, listening on TCP and QUIC. Homes hole-punch (DCUtR) once four public
peers observed the same address of theirs: where the public receivers and the bootstrap are fewer
than four, extra public bootstraps (boot2, ...) join first; the learner publishes once every home's
card says it punches (or after 60 s). T_bcast as above (stores on the shared file system); the learner's and
the public relays' uplink bytes are the lab's interface counters. The lab (namespaces, processes) is
torn down after each run, also on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from echo2swarm.config.models import PublishConfig, auto_chunk_size  # noqa: E402
from echo2swarm.config.units import format_bytes, parse_bytes  # noqa: E402
from echo2swarm.runtime.processes import DaemonProcess, child_pids, loopback_args, pid_alive, wait_until  # noqa: E402
from echo2swarm.sim.broadcast import FRAME_PAYLOAD, lab_broadcast  # noqa: E402

SWARM = "bench-bcast"
SEEDS = PublishConfig().seeds  # the learner's stripes (its default publish.seeds), as the model is told
# On 127.0.0.1 only the uplinks are capped (--upload-limit); downloads run at what the CPU gives: the
# model takes them as unlimited (10 GB/s).
LOOPBACK_DOWN_BPS = 1e10


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


def daemon_cpu(d: DaemonProcess) -> tuple[float, float]:
    """CPU seconds so far of a daemon and of its children (p2pd)."""
    return cpu_seconds(d.pid), sum(cpu_seconds(c) for c in child_pids(d.pid))


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU jiffies of the whole machine so far (/proc/stat), every engineer's jobs included."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return float(sum(fields) - idle), float(sum(fields))


def get_json(url: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return json.loads(resp.read())
    except OSError:
        return None


def hedge_totals(fetch_stats: list[dict[str, Any]]) -> dict[str, Any]:
    """What hedged requests cost the followers (`stats.fetch` of each): hedges fired and won, the verified chunk
    bytes they needed, the duplicate bytes of requests cancelled because another copy won, and the ratio
    received / needed (1.0: no byte twice)."""
    needed = sum(f.get("bytes_fetched", 0) for f in fetch_stats)
    duplicate = sum(f.get("hedge_bytes", 0) for f in fetch_stats)
    return {"hedges_fired": sum(f.get("hedges_fired", 0) for f in fetch_stats),
            "hedges_won": sum(f.get("hedges_won", 0) for f in fetch_stats),
            "bans": sum(f.get("bans", 0) for f in fetch_stats), "needed_bytes": needed, "duplicate_bytes": duplicate,
            "received_over_needed": (needed + duplicate) / needed if needed else None}


def hedge_line(h: dict[str, Any]) -> str:
    ratio = f"{h['received_over_needed']:.4f}" if h["received_over_needed"] is not None else "-"
    return (f"hedges fired {h['hedges_fired']}, won {h['hedges_won']}; followers received {format_bytes(h['needed_bytes'])} "
            f"needed + {format_bytes(h['duplicate_bytes'])} duplicates: received / needed = {ratio}; source bans {h['bans']}")


def run_once(root: Path, model: Path, key: Path, n: int, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    daemons: list[DaemonProcess] = []
    children: set[int] = set()
    limit = ["--upload-limit", str(args.upload_limit)]
    env = {"ECHO2SWARM_FETCH__HEAD_POLL_S": "0.2", "ECHO2SWARM_FETCH__PARALLEL_CHUNKS": str(args.parallel_chunks)}
    if args.hedge_after is not None:
        env["ECHO2SWARM_FETCH__HEDGE_AFTER"] = str(args.hedge_after)

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
        hedges = hedge_totals([(get_json(u + "/v1/info") or {}).get("stats", {}).get("fetch", {}) for u in urls])
        for d in daemons:
            children.update(child_pids(d.pid))
        return {"mode": mode, "n": n, "t_bcast_s": max(done.values()), "t_first_s": min(done.values()),
                "t_bcast_learner_s": t_learner, "learner_bytes": learner_bytes, "hedges": hedges,
                "relay_cpu_s": sum(cpu_seconds(r.pid) for r in relays) / n, "learner_cpu_s": cpu_seconds(learner.pid)}
    finally:
        for d in reversed(daemons):
            if d.running():
                children.update(child_pids(d.pid))
            d.terminate(grace=10)
        for pid in children:
            if pid_alive(pid):
                os.kill(pid, 9)


def write_trainable_model(path: Path, target_bf16_bytes: int, warmup_steps: int) -> int:
    """A Qwen3-style model (init std 0.02, Qwen3's own) of about `target_bf16_bytes` once cast to bf16, after a
    short supervised warm-up on arith with operands 0..4, so that sampled groups have mixed rewards and GRPO
    steps move the weights (a model that never answers right gets zero advantages and would publish empty
    deltas). Returns its parameter count."""
    from echo2swarm.models.tiny import write_tiny_model

    hidden = 1024
    per_layer = 2 * (2 * hidden * hidden + 2 * hidden * 128 + 3 * hidden * 2 * hidden)
    layers = max(1, round(target_bf16_bytes / per_layer))
    write_tiny_model(path, seed=0, task="arith", warmup_steps=warmup_steps, task_options={"max_operand": 4},
                     hidden_size=hidden, num_layers=layers, num_heads=16)
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())


def _numel(shape: list[int]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def learner_toml(path: Path, model: Path, key: Path, keyframe_every: int | None, args: argparse.Namespace) -> Path:
    """The learner of a stream run: GRPO on arith (operands 0..4), tiny steps, lr 1e-6, a bf16 version per
    step, on-policy (staleness 0: step t waits for rollouts of version t, so the versions are a stream
    that a follower receives one by one rather than skipping)."""
    publish = [f'model = "{model}"', f'policy_key = "{key}"', f'chunk_size = "{args.chunk_size}"', 'dtype = "bfloat16"']
    if keyframe_every is not None:
        publish.append(f"keyframe_every = {keyframe_every}")
    if args.delta_chunk_size:
        publish.append(f'delta_chunk_size = "{args.delta_chunk_size}"')
    path.write_text("\n".join([
        'role = "learner"', "[publish]", *publish,
        # On 127.0.0.1 every peer is the same client (one IP): let all 9 followers' head long-polls, and
        # their manifest and plan requests right after, in at once, as 9 hosts of their own would be.
        "[chunk_server]", "max_waiting = 64", "max_waiting_per_client = 32", "control_slots = 64",
        "control_slots_per_client = 32", "max_connections_per_client = 128",
        "[train]", 'task = "arith"', "task_options = { max_operand = 4 }", "steps = 100000", "staleness = 0",
        "publish_every = 1", "prompts_per_step = 4", "group_size = 4", "max_new_tokens = 3", f"lr = {args.lr}",
        "ppo_epochs = 1", "minibatches = 1", "checkpoint_every = 100000", "threads = 1",
        "[leases]", "max_prompts = 4", "timeout_s = 60.0", "[activation]", "enabled = false",
    ]) + "\n")
    return path


def run_stream(root: Path, model: Path, key: Path, n: int, kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """One stream run: `args.stream` versions after the first, every one dense (`kind` dense: keyframe_every 1)
    or deltas between keyframes (`kind` delta: the default keyframe_every)."""
    daemons: list[DaemonProcess] = []
    children: set[int] = set()
    limit = ["--upload-limit", str(args.upload_limit)]
    # Heads reach the followers by their long-poll of the learner (fetch.head_wait_s); the DHT is read at
    # the default fetch.head_poll_s (2 s), not every 0.2 s: ten daemons polling it cost the 2 cores.
    env = {"ECHO2SWARM_FETCH__PARALLEL_CHUNKS": str(args.parallel_chunks)}
    if args.hedge_after is not None:
        env["ECHO2SWARM_FETCH__HEDGE_AFTER"] = str(args.hedge_after)
    if args.head_poll_s is not None:
        env["ECHO2SWARM_FETCH__HEAD_POLL_S"] = str(args.head_poll_s)

    def start(name: str, *extra: str, env: dict[str, str] | None = None) -> DaemonProcess:
        slower = ["--announce-period", "2", "--record-ttl", "6"]
        d = DaemonProcess(name, [*loopback_args(SWARM, "INFO"), *slower, *extra], root / name, env=env).start()
        daemons.append(d)
        return d

    try:
        boot = start("bootstrap", "--role", "bootstrap", "--new-swarm")
        boot.wait_ready(60)
        join = ["--initial-peers", boot.maddr]
        trust = ["--trust", f"{key}.pub"]
        relays = [start(f"relay{i}", "--role", "relay", *trust, *join, *limit, env=env) for i in range(n)]
        rollout = start("rollout", "--role", "rollout", *trust, *join, *limit, env=env)
        for d in [*relays, rollout]:
            d.wait_ready(180)
        # On a loaded 2-core machine, 10 daemons' first cards can take minutes to be all readable.
        wait_until(lambda: relay_cards(boot.maddr) >= n, 300, interval=1.0, what="relay cards")
        toml = learner_toml(root / "learner.toml", model, key, 1 if kind == "dense" else None, args)
        learner = start("learner", "--config", str(toml), *join, *limit)
        port_file = root / "learner" / "daemon.json"
        wait_until(port_file.exists, 300, interval=0.05, what="learner up")
        url = json.loads(port_file.read_text())["chunk_url"]
        urls = {r.name: json.loads((root / r.name / "daemon.json").read_text())["chunk_url"] for r in relays}
        last = 1 + args.stream  # version 1 is the learner's first publish (dense in both runs); then the stream
        head_at: dict[int, float] = {}
        served_at: dict[int, int] = {}
        held_at: dict[int, dict[str, float]] = {v: {} for v in range(1, last + 1)}
        started = time.monotonic()
        deadline = started + args.timeout * (args.stream + 1)
        # Installed = the version's signed manifest is in the peer's store (written last, atomically: §5.4): read
        # from the shared file system every 20 ms, which costs the peers nothing (HTTP polls of 9 daemons on a
        # loaded 2-core machine take up to a second a round). The learner's own manifest for v marks "published"
        # (it is written just before its head is served).
        def manifest(name: str, v: int) -> Path:
            return root / name / "versions" / f"v{v:08d}.manifest"

        while time.monotonic() < deadline and len(held_at[last]) < n:
            if not learner.running():
                raise RuntimeError(f"{kind}: the learner exited: {learner.log_tail(20)}")
            for v in range(1, last + 1):
                if v not in head_at and manifest("learner", v).exists():
                    head_at[v] = time.monotonic()
                    served_at[v] = ((get_json(url + "/v1/info") or {}).get("stats", {}).get("server", {})
                                    .get("bytes_served", 0))
                    print(f"    {kind}: learner published v{v} at {head_at[v] - started:.1f} s", file=sys.stderr,
                          flush=True)
                for name in urls:
                    if name not in held_at[v] and manifest(name, v).exists():
                        held_at[v][name] = time.monotonic()
            time.sleep(0.02)
        if len(held_at[last]) < n:
            raise RuntimeError(f"{kind} N={n}: {len(held_at[last])} of {n} relays hold v{last} after "
                               f"{time.monotonic() - started:.0f} s (heads seen: {sorted(head_at)})")
        final_served = (get_json(url + "/v1/info") or {}).get("stats", {}).get("server", {}).get("bytes_served", 0)
        learner_info = (get_json(url + "/v1/info") or {}).get("stats", {})
        relay_stats = [(get_json(u + "/v1/info") or {}).get("stats", {}) for u in urls.values()]
        for d in daemons:
            children.update(child_pids(d.pid))
        versions = []
        for v in range(2, last + 1):
            times = [t - head_at[v] for t in held_at[v].values()] if v in head_at else []
            report = learner_info.get("versions", {}).get(str(v), {})
            paths = [s.get("fetch_path_of", {}).get(str(v), {}) for s in relay_stats]
            received = [p["bytes"] for p in paths if isinstance(p.get("bytes"), int)]
            upload_end = served_at.get(v + 1, final_served)
            versions.append({
                "version": v, "kind": report.get("kind"), "dense_bytes": report.get("dense_bytes"),
                "delta_bytes": report.get("delta_bytes"),
                "relays_held": len(times), "skipped": n - len(times),
                "t_bcast_s": max(times) if len(times) == n else None, "t_first_s": min(times) if times else None,
                "learner_upload_bytes": upload_end - served_at[v] if v in served_at else None,
                "relay_received_bytes": sum(received) / len(received) if received else None,
                "relay_paths": sorted({str(p.get("path")) for p in paths}),
                # each relay's own time from first seeing v's head (DHT read) to installing it; the rest of
                # T_bcast is the head's way from the learner to the relay (announce, DHT store, head poll)
                "relay_fetch_install_s": _mean([a for s in relay_stats
                                                if (a := s.get("arrival_s", {}).get(str(v))) is not None]),
                "relay_head_seen_s": _mean([held_at[v][name] - head_at[v] - a for name, s in zip(urls, relay_stats)
                                            if v in head_at and name in held_at[v]
                                            and (a := s.get("arrival_s", {}).get(str(v))) is not None]),
                "t_bcast_learner_s": learner_info.get("t_bcast", {}).get(str(v)),
                # where the relays' fetch+install went (policy/follower.py `spans`), mean over the relays
                "relay_spans_s": {part: _mean([p["spans"][part] for p in paths if part in p.get("spans", {})])
                                  for part in ("manifest", "path", "chunks", "check", "commit")},
                # relays whose rebuild used visiting orders computed ahead (policy/catchup.BaseOrders)
                "relays_sorted_ahead": sum(bool(p.get("spans", {}).get("sorted_ahead")) for p in paths),
            })
        return {"kind": kind, "n": n, "versions": versions, "hedges": hedge_totals([s.get("fetch", {}) for s in relay_stats]),
                "relay_cpu_s": sum(cpu_seconds(r.pid) for r in relays) / n, "learner_cpu_s": cpu_seconds(learner.pid)}
    finally:
        for d in reversed(daemons):
            if d.running():
                children.update(child_pids(d.pid))
            d.terminate(grace=10)
        for pid in children:
            if pid_alive(pid):
                os.kill(pid, 9)


def stream_main(args: argparse.Namespace, tmp_path: Path, key: Path, bandwidth: int) -> None:
    n = int(args.receivers.split(",")[-1]) if args.receivers else 8
    model = tmp_path / "model"
    t0 = time.monotonic()
    params = write_trainable_model(model, parse_bytes(args.model_bytes), args.warmup_steps)
    dense_bytes = 2 * params
    ideal = dense_bytes / bandwidth
    print(f"stream: {params / 1e6:.1f}M parameters, bf16 version ~{format_bytes(dense_bytes)} (model built and warmed "
          f"up in {time.monotonic() - t0:.0f} s), B = {format_bytes(bandwidth)}/s, N = {n} relays + 1 rollout peer, "
          f"{args.stream} versions after v1, M/B = {ideal:.2f} s", file=sys.stderr, flush=True)
    runs = {}
    for kind in args.stream_kinds:
        run_dir = tmp_path / f"stream-{kind}"
        runs[kind] = run_stream(run_dir, model, key, n, kind, args)
        for v in runs[kind]["versions"]:  # as it comes: a later run that fails does not lose this one
            print(f"    {kind} v{v['version']} ({v['kind']}): T_bcast {v['t_bcast_s']} s, learner uploaded "
                  f"{v['learner_upload_bytes']} B, relays received {v['relay_received_bytes']} B each "
                  f"by {v['relay_paths']}", file=sys.stderr, flush=True)
        if not args.keep:
            shutil.rmtree(run_dir, ignore_errors=True)
    summary: dict[str, Any] = {"params": params, "dense_bf16_bytes": dense_bytes, "upload_limit": bandwidth,
                               "n": n, "ideal_s": ideal, "runs": runs}
    totals = {}
    for kind, run in runs.items():
        ts = [v["t_bcast_s"] for v in run["versions"] if v["t_bcast_s"] is not None]
        totals[kind] = {"t_bcast_sum_s": sum(ts), "t_bcast_mean_s": sum(ts) / len(ts) if ts else None,
                        "complete": len(ts), "learner_upload_bytes": sum(v["learner_upload_bytes"] or 0
                                                                         for v in run["versions"]),
                        "relay_received_bytes": sum(v["relay_received_bytes"] or 0 for v in run["versions"])}
    summary["totals"] = totals
    if {"dense", "delta"} <= set(totals):
        # Versions whose weights changed (a GRPO step whose groups all scored alike changes nothing: the
        # dense run's relays then fetch 0 bytes, its chunks being held already) are what the ratio compares.
        moved = {v["version"] for v in runs["dense"]["versions"] if v["relay_received_bytes"]}
        pairs = [(a["t_bcast_s"], b["t_bcast_s"]) for a, b in zip(runs["dense"]["versions"], runs["delta"]["versions"])
                 if a["version"] in moved and a["t_bcast_s"] is not None and b["t_bcast_s"] is not None]
        if pairs:
            summary["changed_versions"] = sorted(moved)
            summary["dense_over_delta"] = (sum(a for a, _ in pairs) / len(pairs)) / (sum(b for _, b in pairs) / len(pairs))
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(f"\nstream of {args.stream} versions (v2..v{args.stream + 1}), N = {n} relays (+1 rollout peer), "
          f"B = {format_bytes(bandwidth)}/s, dense bf16 M = {format_bytes(dense_bytes)}, M/B = {ideal:.2f} s")
    print(f"{'kind':>5} {'v':>3} {'published':>9} {'T_bcast s':>9} {'first s':>8} {'x M/B':>6} {'head s':>6} "
          f"{'fetch+inst s':>12} {'learner up':>11} {'relay recv':>11} {'relay path':>10}  "
          f"of fetch+inst: manifest/path/chunks/check/commit s")
    for kind, run in runs.items():
        for v in run["versions"]:
            t = f"{v['t_bcast_s']:.2f}" if v["t_bcast_s"] is not None else f"{v['skipped']} skip"
            first = f"{v['t_first_s']:.2f}" if v["t_first_s"] is not None else "-"
            ratio = f"{v['t_bcast_s'] / ideal:.3f}" if v["t_bcast_s"] is not None else "-"
            up = format_bytes(v["learner_upload_bytes"]) if v["learner_upload_bytes"] is not None else "-"
            recv = format_bytes(int(v["relay_received_bytes"])) if v["relay_received_bytes"] is not None else "-"
            head = f"{v['relay_head_seen_s']:.2f}" if v["relay_head_seen_s"] is not None else "-"
            inst = f"{v['relay_fetch_install_s']:.2f}" if v["relay_fetch_install_s"] is not None else "-"
            spans = "/".join(f"{x:.2f}" if x is not None else "-" for x in v["relay_spans_s"].values())
            spans += f" ({v['relays_sorted_ahead']} sorted ahead)"
            print(f"{kind:>5} {v['version']:>3} {v['kind'] or '-':>9} {t:>9} {first:>8} {ratio:>6} {head:>6} {inst:>12} "
                  f"{up:>11} {recv:>11} {','.join(v['relay_paths']):>10}  {spans}")
    for kind, tot in totals.items():
        mean = f"{tot['t_bcast_mean_s']:.2f}" if tot["t_bcast_mean_s"] is not None else "-"
        print(f"{kind}: mean T_bcast {mean} s over {tot['complete']} versions, learner uploaded "
              f"{format_bytes(tot['learner_upload_bytes'])}, each relay received {format_bytes(int(tot['relay_received_bytes']))}"
              f"; CPU over the whole run: {runs[kind]['relay_cpu_s']:.1f} s a relay, learner {runs[kind]['learner_cpu_s']:.1f} s")
        print(f"{kind}: {hedge_line(runs[kind]['hedges'])} (the relays, v1 included)")
    if "dense_over_delta" in summary:
        d, x = totals["dense"], totals["delta"]
        print(f"dense / delta over the versions whose weights changed ({summary['changed_versions']}): "
              f"mean T_bcast {summary['dense_over_delta']:.1f}x; over all versions: learner upload "
              f"{d['learner_upload_bytes'] / max(1, x['learner_upload_bytes']):.1f}x, relay bytes "
              f"{d['relay_received_bytes'] / max(1, x['relay_received_bytes']):.1f}x")


def wan_receivers(n: int) -> tuple[int, int]:
    """(public, behind NAT) of n receivers: 3 of every 4 behind NAT, at least one public (N = 2: 1 + 1)."""
    public = max(1, n // 4)
    return public, n - public


def run_wan(root: Path, model: Path, key: Path, n: int, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One broadcast of v1 inside a fresh WAN lab: public bootstrap and learner, n relay receivers of which
    3 of every 4 sit in their own home behind NAT; every host's uplink capped by the kernel (tbf)."""
    from tests.helpers.wanlab import WanLab
    import contextlib

    from tests.helpers.wanswarm import LAB_HOST_MADDRS, WanSwarm

    from echo2swarm.wire.signing import PolicyKey

    up, down = args.wan_up_mbit, args.wan_down_mbit
    n_public, n_nat = wan_receivers(n)
    trust = PolicyKey.load(key).public.text
    lab = WanLab()
    swarm = WanSwarm(lab, root, SWARM)

    def start(host: Any, name: str, *extra: str, join: bool = True, follower: bool = False) -> DaemonProcess:
        # As WanSwarm.start, at INFO and a 2 s announce period: 11 daemons share this machine's CPUs.
        peers = ["--initial-peers", ",".join(swarm.initial_peers)] if join else []
        argv = ["--swarm", SWARM, "--host-maddrs", LAB_HOST_MADDRS, "--chunk-host", "0.0.0.0",
                "--announce-period", "2", "--record-ttl", "6", "--log-level", "INFO", *peers, *extra]
        env = {"ECHO2SWARM_FETCH__HEAD_POLL_S": "0.2"}
        if args.parallel_chunks is not None:
            env["ECHO2SWARM_FETCH__PARALLEL_CHUNKS"] = str(args.parallel_chunks)
        d = DaemonProcess(name, argv, root / name, wrap=host.wrap, env=env if follower else None)
        swarm.daemons.append(d.start())
        swarm.hosts[name] = host
        return d

    try:
        boot = start(lab.public_host("boot", up, down), "bootstrap", "--role", "bootstrap", "--new-swarm", join=False)
        boot.wait_ready(90)
        swarm.initial_peers = swarm.public_addrs(boot)  # TCP and QUIC: homes join over QUIC (hole punching)
        # go-libp2p hole-punches only once 4 public peers saw the same address of a home: with fewer public
        # receivers than 3, more public bootstraps (they upload no model, they relay and serve the DHT).
        boots = [start(lab.public_host(f"boot{i}", up, down), f"boot{i}", "--role", "bootstrap")
                 for i in range(2, 2 + max(0, 3 - n_public))]
        for b in boots:
            b.wait_ready(90)
            swarm.initial_peers += swarm.public_addrs(b)
        assist = ["--no-peer-assist"] if mode == "star" else []
        relays = [start(lab.public_host(f"pub{i}", up, down), f"pub{i}", "--role", "relay", "--trust", trust, *assist,
                        follower=True)
                  for i in range(n_public)]
        for r in relays:
            r.wait_ready(120)
        swarm.initial_peers += [a for r in relays for a in swarm.public_addrs(r)]
        homes = [start(lab.home(f"h{i}", up, down)[0], f"h{i}", "--role", "relay", "--trust", trust, *assist,
                       follower=True)
                 for i in range(n_nat)]
        for h in homes:
            h.wait_ready(180)
        # Plans leave out peers still `private` (no relay slot yet): wait until every home is relayed.
        wait_until(lambda: all(swarm.info(h)["reachability"]["state"] != "private" for h in homes), 120,
                   interval=1.0, what="every home to hold a relay slot")

        def cards() -> bool:
            out = swarm.cli(lab.hosts["boot"], "peers", "--initial-peers", swarm.initial_peers[0], "--swarm", SWARM,
                            "--json")
            listed = json.loads(out.stdout) if out.returncode == 0 and out.stdout.strip() else []
            return sum(p.get("role") == "relay" and p.get("reachability") != "private" for p in listed) >= n

        wait_until(cards, 120, interval=1.0, what=f"{n} relay cards")
        # Homes hole-punch once four public peers saw the same QUIC mapping of theirs; the learner's plan
        # reads the cards when it publishes, so wait (bounded) until every home's card says it punches.
        lrn = lab.public_host("lrn", up, down)
        punch_started = time.monotonic()

        def punched() -> bool:
            return n_nat < 2 or all(swarm.info(h)["reachability"].get("holepunch") for h in homes)

        with contextlib.suppress(TimeoutError):
            wait_until(punched, 60, interval=1.0, what="every home to hole-punch")
        punch_s = time.monotonic() - punch_started
        # the bootstrap is a public peer too: it serves circuit relays for the homes, as the public relays do
        uplinks = ["lrn", "boot", *(b.name for b in boots), *(r.name for r in relays), *(f"h{i}" for i in range(n_nat))]
        before = {name: lab.uplink_bytes(name) for name in uplinks}
        machine_before, receivers_cpu = machine_cpu(), {d.name: daemon_cpu(d) for d in [*relays, *homes]}
        learner = start(lrn, "learner", "--role", "learner", "--model", str(model), "--policy-key", str(key),
                        "--chunk-size", args.chunk_size)
        installed = [root / d.name / "versions" / "v00000001.manifest" for d in [*relays, *homes]]
        published_file = root / "learner" / "versions" / "v00000001.manifest"
        wait_until(published_file.exists, 300, interval=0.02, what="the learner's v1")
        published = time.monotonic()
        done: dict[Path, float] = {}
        while len(done) < n and time.monotonic() < published + args.timeout:
            for f in installed:
                if f not in done and f.exists():
                    done[f] = time.monotonic() - published
            if not learner.running():
                raise RuntimeError(f"wan {mode} N={n}: the learner exited: {learner.log_tail(20)}")
            time.sleep(0.05)
        if len(done) < n:
            raise RuntimeError(f"wan {mode} N={n}: only {len(done)} of {n} receivers installed v1 in {args.timeout:.0f} s")
        uploads = {name: lab.uplink_bytes(name) - b for name, b in before.items()}
        busy, total = (a - b for a, b in zip(machine_cpu(), machine_before))
        cpu = {d.name: tuple(a - b for a, b in zip(daemon_cpu(d), receivers_cpu[d.name])) for d in [*relays, *homes]}
        cpu["learner"] = daemon_cpu(learner)  # started with the broadcast: all of it is the learner's start + serving
        print(f"    CPU during the broadcast: machine {busy / max(total, 1e-9):.0%} busy "
              f"({os.cpu_count()} cores); daemon + p2pd seconds: "
              + ", ".join(f"{k} {a:.1f}+{b:.1f}" for k, (a, b) in cpu.items()), file=sys.stderr, flush=True)
        detail = wan_detail(swarm, learner, [*relays, *homes], done, root)
        home_up = [uploads[h.name] for h in homes]
        reach = [swarm.info(h)["reachability"] for h in homes]
        home_ids = {h.info["peer_id"] for h in homes}
        return {"mode": mode, "n": n, "public": n_public, "nat": n_nat, "t_bcast_s": max(done.values()),
                "t_first_s": min(done.values()),
                "t_bcast_nat_s": max((t for f, t in done.items() if f.parts[-3].startswith("h")), default=None),
                "learner_uplink_bytes": uploads["lrn"],
                "bootstrap_uplink_bytes": uploads["boot"] + sum(uploads[b.name] for b in boots),
                "public_relay_uplink_bytes": [uploads[r.name] for r in relays],
                "home_uplink_bytes": home_up,
                "reachability": [r["state"] for r in reach], "holepunch": [r.get("holepunch") for r in reach],
                "punch_wait_s": punch_s,
                # home-to-home connections that are direct (hole-punched), counted from both ends
                "direct_home_links": sum(len(home_ids & set(r.get("direct") or {})) for r in reach),
                "receivers": detail, "cpu_s": cpu, "machine_busy": busy / max(total, 1e-9)}
    finally:
        try:
            swarm.close()
        finally:
            lab.close()


def wan_detail(swarm: Any, learner: DaemonProcess, receivers: list[DaemonProcess], done: dict[Path, float],
               root: Path) -> list[dict[str, Any]]:
    """Per receiver: its chain positions in the learner's plan, when it finished, the share of its bytes it
    fetched from the learner (what the plan does not account for), its fetcher's non-zero counters (misses,
    busy sources, parents not begun or unknown) and its chunk server's held, unseen-version and refused
    requests; and what the learner's chunk server sent and refused. Printed to stderr, kept in the row."""
    if not learner.info:
        learner.wait_ready(60)
    url = learner.info["http_url"] + "/v1/plan/1"
    out = swarm.hosts[learner.name].run(
        [sys.executable, "-c", f"import urllib.request;print(urllib.request.urlopen({url!r},timeout=10).read().decode())"],
        timeout=20)
    stripes = json.loads(out.stdout)["stripes"] if out.returncode == 0 else []
    lserver = swarm.info(learner)["stats"].get("server", {})
    print(f"    learner sent {lserver.get('bytes_served', 0) / 2**20:.1f} MiB in {lserver.get('chunks_served', 0)} chunks, "
          f"refused {({k: v for k, v in lserver.items() if k.startswith('refused_') and v})}", file=sys.stderr, flush=True)
    rows = []
    for d in receivers:
        info = swarm.info(d)
        stats = info["stats"]
        server, fetched_from = stats.get("server", {}), stats.get("fetched_from", {})
        t = done.get(root / d.name / "versions" / "v00000001.manifest")
        row = {"name": d.name, "t_s": t, "positions": [c.index(info["peer_id"]) if info["peer_id"] in c else None
                                                       for c in stripes],
               "from_learner": sum(b for name, b in fetched_from.items() if name.startswith("learner:")),
               "fetched": sum(fetched_from.values()),
               "fetch": {k: v for k, v in stats.get("fetch", {}).items() if v and not k.startswith(("bytes_", "chunks_"))},
               "served": server.get("bytes_served", 0), "held": server.get("waited", 0),
               "unseen": server.get("wait_unseen", 0),
               "refused": {k: v for k, v in server.items() if k.startswith("refused_") and v}}
        rows.append(row)
        print(f"    {d.name:>5} pos {row['positions']} done {t if t is None else round(t, 2)} s, from the learner "
              f"{row['from_learner'] / max(1, row['fetched']):.3f} of {row['fetched'] / 2**20:.1f} MiB; sent "
              f"{row['served'] / 2**20:.1f} MiB, held {row['held']}, unseen {row['unseen']}, refused {row['refused']}; "
              f"fetch {row['fetch']}", file=sys.stderr, flush=True)
    return rows


def wan_main(args: argparse.Namespace, tmp_path: Path, key: Path, receivers: list[int], modes: list[str]) -> None:
    model = tmp_path / "model"
    model_bytes = write_model(model, parse_bytes(args.model_bytes))
    bandwidth = args.wan_up_mbit * 1e6 / 8
    ideal = model_bytes / bandwidth
    print(f"WAN lab: M = {format_bytes(model_bytes)}, every uplink {args.wan_up_mbit:g} Mbit/s "
          f"({format_bytes(int(bandwidth))}/s, kernel tbf), downlinks {args.wan_down_mbit:g} Mbit/s, "
          f"chunk {args.chunk_size}"
          f"{f' ({format_bytes(auto_chunk_size(model_bytes))})' if args.chunk_size == 'auto' else ''}, chunks in flight "
          f"{args.parallel_chunks or 'default'}, ideal M/B = {ideal:.2f} s", file=sys.stderr, flush=True)
    rows = []
    for n in receivers:
        for mode in modes:
            run_dir = tmp_path / f"wan-{mode}-{n}"
            row = run_wan(run_dir, model, key, n, mode, args)
            if not args.keep:
                shutil.rmtree(run_dir, ignore_errors=True)
            row.update(ideal_s=ideal, ratio=row["t_bcast_s"] / ideal,
                       learner_copies=row["learner_uplink_bytes"] / model_bytes,
                       public_relay_copies=[b / model_bytes for b in row["public_relay_uplink_bytes"]],
                       bootstrap_copies=row["bootstrap_uplink_bytes"] / model_bytes,
                       home_copies=[b / model_bytes for b in row["home_uplink_bytes"]])
            chunk = auto_chunk_size(model_bytes) if args.chunk_size == "auto" else parse_bytes(args.chunk_size)
            row["sim_s"] = lab_broadcast(n, model_bytes, chunk, bandwidth, args.wan_down_mbit * 1e6 / 8, SEEDS,
                                         star=mode == "star", homes=row["nat"],
                                         punching=sum(bool(h) for h in row["holepunch"]), relay_bps=bandwidth,
                                         payload_share=FRAME_PAYLOAD)  # tbf counts whole frames
            rows.append(row)
            print(f"  {mode:>9} N={n:<2} ({row['nat']} NAT) T_bcast {row['t_bcast_s']:7.2f} s ({row['ratio']:.2f}x M/B)  "
                  f"learner uplink {row['learner_copies']:.2f} M, public relay(s) "
                  f"{', '.join(f'{c:.2f}' for c in row['public_relay_copies'])} M, bootstrap "
                  f"{row['bootstrap_copies']:.2f} M, homes "
                  f"{sum(row['home_copies']):.2f} M in all; homes punching {sum(bool(h) for h in row['holepunch'])}"
                  f"/{row['nat']} (after {row['punch_wait_s']:.0f} s), direct home links {row['direct_home_links']}",
                  file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"wan": True, "model_bytes": model_bytes, "uplink_bytes_per_s": bandwidth, "ideal_s": ideal,
                          "rows": rows}, indent=2))
        return
    print(f"\nWAN lab, M = {format_bytes(model_bytes)}, every uplink B = {args.wan_up_mbit:g} Mbit/s "
          f"(tbf), ideal M/B = {ideal:.2f} s; uplink bytes are the lab's interface counters (all traffic)")
    print(f"{'N':>3} {'NAT':>3} {'mode':>9} {'T_bcast s':>10} {'x M/B':>6} {'first s':>8} {'learner up':>11} "
          f"{'public relay up':>16} {'bootstrap up':>13} {'homes up (sum)':>15} {'punch':>6} {'h-h direct':>10} "
          f"{'model s':>8} {'model/meas':>10}")
    for r in rows:
        pub = "+".join(f"{c:.2f}" for c in r["public_relay_copies"])
        print(f"{r['n']:>3} {r['nat']:>3} {r['mode']:>9} {r['t_bcast_s']:>10.2f} {r['ratio']:>6.2f} {r['t_first_s']:>8.2f} "
              f"{r['learner_copies']:>9.2f} M {pub:>14} M {r['bootstrap_copies']:>11.2f} M {sum(r['home_copies']):>13.2f} M "
              f"{sum(bool(h) for h in r['holepunch']):>3}/{r['nat']:<2} {r['direct_home_links']:>10} "
              f"{r['sim_s']:>8.2f} {r['sim_s'] / r['t_bcast_s']:>9.2f}x")
    for n in receivers:
        by_mode = {r["mode"]: r for r in rows if r["n"] == n}
        if len(by_mode) == 2:
            print(f"N={n}: star / pipelined = {by_mode['star']['t_bcast_s'] / by_mode['pipelined']['t_bcast_s']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-bytes", default=None,
                        help="model size M (default 128MiB fp32; with --stream 40MB once cast to bf16)")
    parser.add_argument("--receivers", default=None,
                        help="comma-separated N to sweep (default 1,2,4,8,12; with --stream the last one, default 8)")
    parser.add_argument("--upload-limit", default=None,
                        help="every peer's upload cap B, bytes/s (default 16MiB; with --stream 1.5MiB)")
    parser.add_argument("--stream", type=int, metavar="V",
                        help="T_bcast of a stream of V versions (after v1) trained by a real learner, dense")
    parser.add_argument("--delta", action="store_true",
                        help="with --stream: run the same stream with delta versions too (dense first, then delta)")
    parser.add_argument("--delta-only", action="store_true",
                        help="with --stream: only the delta run (to work on the delta side; no dense/delta ratio)")
    parser.add_argument("--wan", action="store_true",
                        help="star vs pipelined inside the WAN lab (root, ip netns, tc, iptables): kernel-capped "
                        "uplinks, 3 of every 4 receivers in homes behind NAT (default N 2,4,8, M 32MB)")
    parser.add_argument("--wan-up-mbit", type=float, default=24.0, help="with --wan: every host's uplink, Mbit/s")
    parser.add_argument("--wan-down-mbit", type=float, default=200.0, help="with --wan: every host's downlink, Mbit/s")
    parser.add_argument("--lr", type=float, default=1e-6, help="with --stream: the learner's learning rate")
    parser.add_argument("--warmup-steps", type=int, default=15,
                        help="with --stream: supervised warm-up steps of the model, so GRPO groups have mixed rewards")
    parser.add_argument("--chunk-size", default=None,
                        help="learner chunk size (default 1MiB; with --wan the learner's default, publish.chunk_size "
                        "= auto)")
    parser.add_argument("--delta-chunk-size", default=None,
                        help="with --stream: the learner's publish.delta_chunk_size (default: the config's, 64KiB)")
    parser.add_argument("--head-poll-s", type=float, default=None,
                        help="with --stream: the followers' fetch.head_poll_s (default: the config's, 2 s; heads "
                        "come by long-poll)")
    parser.add_argument("--parallel-chunks", type=int, default=None,
                        help="chunks in flight per fetcher (default 4; with --wan the followers' default, "
                        "fetch.parallel_chunks)")
    parser.add_argument("--hedge-after", type=float, default=None,
                        help="the relays' fetch.hedge_after (default: theirs, 4); 0 turns hedging off, a baseline (not with --wan)")
    parser.add_argument("--modes", default="star,pipelined", help="comma-separated: star, pipelined")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one broadcast may take")
    parser.add_argument("--png", type=Path, help="write a plot of T_bcast vs N here")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    parser.add_argument("--on-disk", action="store_true",
                        help="keep the peers' state dirs on disk instead of /dev/shm (all peers then share one disk)")
    parser.add_argument("--keep", type=Path, help="run in this directory and keep the daemons' logs and state")
    args = parser.parse_args()
    # Ctrl-C and SIGTERM unwind through the `finally`s that end the daemons and delete the WAN lab (a
    # background job may inherit SIGINT ignored; SIGTERM would otherwise end Python without unwinding).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if (args.delta or args.delta_only) and not args.stream:
        parser.error("--delta and --delta-only need --stream V")
    if args.stream is not None and not 1 <= args.stream <= 9:
        parser.error("--stream V: 1..9 versions (the delta run's default keyframe_every 10 keeps v2..v10 deltas)")
    args.stream_kinds = ["delta"] if args.delta_only else ["dense", "delta"] if args.delta else ["dense"]
    stream = args.stream is not None
    if args.wan and stream:
        parser.error("--wan and --stream are separate runs")
    args.model_bytes = args.model_bytes or ("40MB" if stream else "32MB" if args.wan else "128MiB")
    # --wan runs the daemons' defaults; the loopback runs keep the settings their published figures used
    args.chunk_size = args.chunk_size or ("auto" if args.wan else "1MiB")
    if args.parallel_chunks is None and not args.wan:
        args.parallel_chunks = 4
    args.upload_limit = args.upload_limit or ("1.5MiB" if stream else "16MiB")
    try:
        receivers = [int(x) for x in (args.receivers or ("2,4,8" if args.wan else "1,2,4,8,12")).split(",") if x]
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
        key = tmp_path / "learner.key"
        from echo2swarm.wire.signing import PolicyKey

        PolicyKey.generate().save(key)
        (tmp_path / "learner.key.pub").write_text(PolicyKey.load(key).public.text + "\n")
        if stream:
            stream_main(args, tmp_path, key, bandwidth)
            return
        if args.wan:
            from tests.helpers.wanlab import unavailable

            if reason := unavailable():
                sys.exit(f"--wan: {reason}")
            wan_main(args, tmp_path, key, receivers, modes)
            return
        model = tmp_path / "model"
        model_bytes = write_model(model, target)
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
                row["sim_s"] = lab_broadcast(n, model_bytes, parse_bytes(args.chunk_size), bandwidth, LOOPBACK_DOWN_BPS,
                                             SEEDS, star=mode == "star")
                rows.append(row)
                print(f"  {mode:>9} N={n:<3} T_bcast {row['t_bcast_s']:7.2f} s  ({row['ratio']:.2f}x ideal)  "
                      f"learner uploaded {row['learner_copies']:.2f} M  CPU s: relay {row['relay_cpu_s']:.1f} (mean, "
                      f"start-up included), learner {row['learner_cpu_s']:.1f}", file=sys.stderr, flush=True)
                print(f"    {hedge_line(row['hedges'])}", file=sys.stderr, flush=True)

    if args.json:
        print(json.dumps({"model_bytes": model_bytes, "upload_limit": bandwidth, "rows": rows}, indent=2))
    else:
        print(f"\nM = {format_bytes(model_bytes)}, B = {format_bytes(bandwidth)}/s, ideal M/B = {ideal:.2f} s")
        print(f"{'N':>3} {'mode':>9} {'T_bcast s':>10} {'x ideal':>8} {'learner T_bcast s':>18} {'first s':>8} "
              f"{'learner upload':>15} {'model s':>8} {'model/meas':>10}")
        for r in rows:
            t_l = f"{r['t_bcast_learner_s']:.2f}" if r["t_bcast_learner_s"] is not None else "-"
            print(f"{r['n']:>3} {r['mode']:>9} {r['t_bcast_s']:>10.2f} {r['ratio']:>8.2f} {t_l:>18} "
                  f"{r['t_first_s']:>8.2f} {r['learner_copies']:>13.2f} M {r['sim_s']:>8.2f} "
                  f"{r['sim_s'] / r['t_bcast_s']:>9.2f}x")
        for r in rows:
            print(f"N={r['n']} {r['mode']}: {hedge_line(r['hedges'])}")
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
