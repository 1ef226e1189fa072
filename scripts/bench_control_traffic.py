#!/usr/bin/env python
"""Control-plane traffic per node as the swarm grows: the DHT bytes and requests every daemon sends
and serves, measured on real daemons while a learner trains and N followers install every version.

    python scripts/bench_control_traffic.py [--followers 4,8,16,40] [--designs upstream,all] [--rollouts 2]
                                              [--window-s 30] [--step-s 5] [--announce-period 10] [--json]

Per N, on 127.0.0.1, every daemon through the CLI (forked from one launcher, runtime/launcher.py,
so that N daemons fit two cores): a bootstrap, a learner training the tiny model on arith (a version
per step), `--rollouts` rollout peers feeding it, and N relay followers (the follower role without an engine:
they fetch, verify, install and re-serve every version). Once every relay holds a version, the
counters of every daemon (overlay/traffic.py: DHT requests and protobuf bytes, sent and served) are
read, again after `--window-s`, and the difference is the traffic of that window. Printed per N:
the versions published in the window and whether every relay installed the last of them; the
learner's upload in copies (its chunk-server bytes over the verified bytes one relay fetched in the
window, from anyone); DHT bytes and requests a second per node (mean, and the busiest node); and the
growth of the per-node mean against the smallest N, beside N's own growth: a control plane whose
per-node load grows with N shows a ratio near N's, one that grows logarithmically stays near 1; and
what `echo2swarm simulate` predicts a node's DHT traffic to be for the same swarm (its followers,
the tiny model's bytes as a dense version, R and T_train as here), with measured / model.

Each N runs once per design of the followers' card reads (`fetch.upstream_cards`): `upstream`, a
follower placed by the broadcast plan reads its upstream peers' cards by their own keys (the
default), and `all`, every follower reads the swarm's cards at every fetch (the design before);
the table ends with the per-node bytes of the one over the other at each N.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from echo2swarm.runtime.launcher import Launcher  # noqa: E402
from echo2swarm.runtime.processes import DaemonProcess, loopback_args, terminate_all, wait_until  # noqa: E402

SWARM = "bench-control"


def get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def learner_toml(path: Path, model: Path, key: Path, step_s: float) -> Path:
    """GRPO on arith, a version per step, a step every `step_s` at most (a real model's pace, not the
    tiny model's ten a second), one rollout peer's worth of work."""
    path.write_text("\n".join([
        'role = "learner"', "[publish]", f'model = "{model}"', f'policy_key = "{key}"',
        # All followers are one client here (127.0.0.1): let their long-polls in at once, as many hosts' would be.
        "[chunk_server]", "max_connections = 1024", "max_waiting = 256", "max_waiting_per_client = 128", "control_slots = 128",
        "control_slots_per_client = 64", "max_connections_per_client = 512",
        "[train]", 'task = "arith"', "steps = 100000", "staleness = 1", "publish_every = 1", "prompts_per_step = 4",
        "group_size = 4", "max_new_tokens = 4", "checkpoint_every = 100000", "threads = 1", f"min_step_s = {step_s}",
        "[leases]", "max_prompts = 4", "timeout_s = 30.0", "[activation]", "enabled = false",
    ]) + "\n")
    return path


def counters(info: dict[str, Any]) -> tuple[int, int]:
    stats = info.get("stats", {})
    return sum(stats.get("dht_bytes", {}).values()), sum(stats.get("dht_requests", {}).values())


DESIGNS = {"upstream": "true", "all": "false"}  # design -> fetch.upstream_cards


def run(root: Path, launcher: Launcher, model: Path, key: Path, n: int, design: str,
        args: argparse.Namespace) -> dict[str, Any]:
    daemons: list[DaemonProcess] = []
    # The public defaults' announce period and TTL unless told otherwise (loopback_args' are the tests' 1 s).
    overlay = ["--announce-period", str(args.announce_period), "--record-ttl", str(3 * args.announce_period)]
    follower_env = {"ECHO2SWARM_FETCH__UPSTREAM_CARDS": DESIGNS[design]}  # roles without `fetch` refuse it

    def start(name: str, *extra: str, env: dict[str, str] | None = None) -> DaemonProcess:
        d = DaemonProcess(name, [*loopback_args(SWARM, "WARNING"), *overlay, *extra], root / name, env=env,
                          launcher=launcher).start()
        daemons.append(d)
        return d

    try:
        boot = start("bootstrap", "--role", "bootstrap", "--new-swarm")
        boot.wait_ready(120)
        join = ["--initial-peers", boot.maddr]
        start("learner", "--config", str(learner_toml(root / "learner.toml", model, key, args.step_s)), *join)
        for i in range(args.rollouts):
            start(f"rollout{i}", "--role", "rollout", "--price", "0.3", "--trust", f"{key}.pub", *join, env=follower_env)
        relays = [start(f"relay{i}", "--role", "relay", "--trust", f"{key}.pub", *join, env=follower_env)
                  for i in range(n)]
        for d in daemons:
            d.wait_ready(300)
        urls = {d.name: d.info["http_url"] + "/v1/info" for d in daemons}
        wait_until(lambda: all((get_json(urls[r.name]).get("version") or 0) >= 1 for r in relays), 300, interval=1.0,
                   what="every relay to hold a version")
        before = {name: get_json(url) for name, url in urls.items()}
        started = time.monotonic()
        time.sleep(args.window_s)
        after = {name: get_json(url) for name, url in urls.items()}
        elapsed = time.monotonic() - started
        newest = after["learner"].get("version") or 0
        versions = newest - (before["learner"].get("version") or 0)
        # Every relay installs the newest version of the window (they may be a moment behind).
        try:
            wait_until(lambda: all((get_json(urls[r.name]).get("version") or 0) >= newest for r in relays), 120,
                       interval=1.0, what="every relay to install the window's last version")
            installed = True
        except TimeoutError:
            installed = False
        rates = {}
        by_rpc: dict[str, float] = {}  # mean bytes a second per node, by direction and RPC
        for name in urls:
            (b0, r0), (b1, r1) = counters(before[name]), counters(after[name])
            rates[name] = ((b1 - b0) / elapsed, (r1 - r0) / elapsed)
            was, now = before[name]["stats"].get("dht_bytes", {}), after[name]["stats"].get("dht_bytes", {})
            for rpc in now:
                by_rpc[rpc] = by_rpc.get(rpc, 0.0) + (now[rpc] - was.get(rpc, 0)) / elapsed / len(urls)
        served = (after["learner"]["stats"].get("server", {}).get("bytes_served", 0)
                  - before["learner"]["stats"].get("server", {}).get("bytes_served", 0))
        # What one relay needed in the window (verified bytes, from whomever): the learner's upload over it is copies.
        fetched = [after[r.name]["stats"]["fetch"].get("bytes_fetched", 0) - before[r.name]["stats"]["fetch"].get("bytes_fetched", 0)
                   for r in relays]
        one_copy = statistics.mean(fetched) if fetched else 0
        busiest = max(rates, key=lambda k: rates[k][0])
        return {
            "followers": n, "design": design, "daemons": len(daemons), "window_s": round(elapsed, 1), "versions": versions,
            "all_installed": installed,
            "learner_copies": round(served / one_copy, 3) if one_copy else None,
            "dht_bytes_per_node_s": round(statistics.mean(b for b, _ in rates.values())),
            "dht_requests_per_node_s": round(statistics.mean(r for _, r in rates.values()), 2),
            "busiest": busiest, "busiest_bytes_s": round(rates[busiest][0]),
            "dht_bytes_per_node_s_by_rpc": {k: round(v) for k, v in sorted(by_rpc.items(), key=lambda kv: -kv[1])},
            # reads of the one dictionary holding every card, a second per node, by role
            "shared_card_reads_s": {role: round(statistics.mean(
                (after[name]["stats"].get("card_reads", {}).get("shared", 0)
                 - before[name]["stats"].get("card_reads", {}).get("shared", 0)) / elapsed
                for name in urls if name.rstrip("0123456789") == role), 3)
                for role in ("bootstrap", "learner", "rollout", "relay")},
            "model_dht_bytes_per_node_s": predicted(n + args.rollouts, model, args),
        }
    finally:
        terminate_all(list(reversed(daemons)), grace=10)


def predicted(followers: int, model: Path, args: argparse.Namespace) -> float:
    """Per-node DHT bytes a second that `echo2swarm simulate` predicts for this swarm: `followers` peers,
    a dense version of the tiny model's bytes, a step every `--step-s` (the learner's R: 16 rollouts)."""
    from echo2swarm.sim.run import Scenario, simulate

    version_bytes = sum(p.stat().st_size for p in model.iterdir() if p.is_file())
    scenario = Scenario(peers=followers, params=version_bytes / 2, dtype_bytes=2, delta_ratio=1.0,
                        t_train_s=max(args.step_s, 0.1), rollouts_per_step=16, l_gen_s=1.0, nat_share=0.0)
    return float(simulate(scenario)["control_bytes_per_node_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--followers", default="4,8,16", help="comma-separated numbers of relay followers")
    parser.add_argument("--designs", default="upstream,all",
                        help="followers' card reads to compare: upstream (by the plan, the default), all (every card)")
    parser.add_argument("--rollouts", type=int, default=2, help="rollout peers feeding the learner (each loads the model)")
    parser.add_argument("--window-s", type=float, default=30.0, help="seconds of traffic measured per N")
    parser.add_argument("--step-s", type=float, default=5.0, help="the learner's shortest step: a version this often")
    parser.add_argument("--announce-period", type=float, default=10.0,
                        help="every daemon's --announce-period (record TTL 3x); 10 s is the public default")
    parser.add_argument("--json", action="store_true", help="one JSON object per N instead of the table")
    args = parser.parse_args()
    try:
        sizes = [int(x) for x in args.followers.split(",")]
    except ValueError:
        parser.error(f"--followers takes numbers separated by commas, not {args.followers!r}")
    if not sizes or min(sizes) < 1 or max(sizes) > 200:
        parser.error("--followers: each between 1 and 200")
    designs = args.designs.split(",")
    if not designs or any(d not in DESIGNS for d in designs):
        parser.error(f"--designs takes {' and '.join(DESIGNS)} separated by commas, not {args.designs!r}")
    if args.window_s <= 0 or args.announce_period <= 0 or args.step_s < 0:
        parser.error("--window-s and --announce-period must be positive, --step-s not negative")
    if not 1 <= args.rollouts <= 8:
        parser.error("--rollouts: between 1 and 8")

    from echo2swarm.models.tiny import write_tiny_model
    from echo2swarm.wire.signing import PolicyKey

    with tempfile.TemporaryDirectory(prefix="bench-control-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as tmp:
        root = Path(tmp)
        model = write_tiny_model(root / "model", seed=0)
        key = root / "learner.key"
        PolicyKey.generate().save(key)
        launcher = Launcher(root / "launcher").start()
        results = []
        try:
            for n in sizes:
                for design in designs:
                    result = run(root / f"n{n}-{design}", launcher, model, key, n, design, args)
                    results.append(result)
                    if args.json:
                        print(json.dumps(result), flush=True)
                    else:
                        print(f"N={n} {design}: {result}", file=sys.stderr, flush=True)
        finally:
            launcher.close()
    if args.json:
        return
    print(f"{'followers':>9} {'design':>8} {'versions':>8} {'installed':>9} {'copies':>6} {'DHT B/s/node':>12} {'req/s/node':>10} "
          f"{'busiest B/s':>11} {'model B/s':>9} {'meas/model':>10}  growth (per-node bytes / N)")
    for r in results:
        base = next(b for b in results if b["design"] == r["design"])
        growth = r["dht_bytes_per_node_s"] / max(base["dht_bytes_per_node_s"], 1)
        print(f"{r['followers']:>9} {r['design']:>8} {r['versions']:>8} {str(r['all_installed']):>9} {r['learner_copies'] or 0:>6.2f} "
              f"{r['dht_bytes_per_node_s']:>12,} {r['dht_requests_per_node_s']:>10.1f} {r['busiest_bytes_s']:>11,} "
              f"{r['model_dht_bytes_per_node_s']:>9,.0f} {r['dht_bytes_per_node_s'] / max(r['model_dht_bytes_per_node_s'], 1):>9.2f}x  "
              f"x{growth:.2f} / x{r['followers'] / base['followers']:.2f} ({r['busiest']})")

    if set(designs) == set(DESIGNS):
        for n in sizes:
            by = {r["design"]: r for r in results if r["followers"] == n}
            print(f"N={n}: per-node DHT bytes, upstream / all: "
                  f"x{by['upstream']['dht_bytes_per_node_s'] / max(by['all']['dht_bytes_per_node_s'], 1):.2f}")


if __name__ == "__main__":
    main()
