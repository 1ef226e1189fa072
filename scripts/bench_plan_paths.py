#!/usr/bin/env python
"""Learner upload per version when versions are dense with a delta beside them: star vs the broadcast plan.

    python scripts/bench_plan_paths.py [--peers 6] [--versions 20] [--skip 5]

When a delta is more than `publish.delta_max_ratio` (0.5) of the dense weights (fp32 publishing, where
most steps move most values' low bits), the learner publishes the version dense and offers the delta from
the version before as an alternative; followers that hold that version take the delta (fewer bytes). The
broadcast plan names a parent per chunk index whatever the path, so its chains serve those deltas too.

For each mode a fresh local swarm on 127.0.0.1: bootstrap, learner (the tiny model in fp32, AdamW with
weight decay so that every step moves every value), --peers rollout peers on the real engine, paced.
    star       followers fetch from the learner only (`fetch.peer_assist = false`): what these versions
               cost while the plan was followed on a version's default (dense) path only
    pipelined  ours: plan parents on the path the follower takes, holders, the learner last
Printed per mode, over --versions versions after the first --skip: the learner's chunk bytes served per
version in dense copies, the followers' bytes fetched per version, the learner's share of them, the
versions' kinds (dense with the ratio reason is the case measured) and the followers' paths; then the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PACE = {"ECHO2SWARM_WORKER__MAX_ROLLOUTS_PER_S": "40", "ECHO2SWARM_ENGINE__THREADS": "1"}


def info(daemon: Any) -> dict[str, Any]:
    with urllib.request.urlopen(daemon.info["chunk_url"] + "/v1/info", timeout=10) as resp:
        return json.loads(resp.read())


def until(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (result := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.3)  # polling a live swarm: bounded by the deadline
    return result


def run_mode(model_dir: Path, run_dir: Path, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    from echo2swarm.runtime.processes import DaemonProcess, loopback_args
    from echo2swarm.wire.signing import PolicyKey

    run_dir.mkdir(parents=True)
    key = run_dir / "learner.key"
    PolicyKey.generate().save(key)
    config = run_dir / "learner.toml"
    config.write_text(
        f'role = "learner"\n[publish]\nmodel = "{model_dir}"\npolicy_key = "{key}"\n'
        f"delta_max_ratio = {args.delta_max_ratio}\n"
        '[train]\ntask = "arith"\nsteps = 100000\nstaleness = 1\nprompts_per_step = 16\ngroup_size = 8\n'
        "max_new_tokens = 4\nthreads = 1\ncheckpoint_every = 100000\nlr = 1e-4\nweight_decay = 2.0\n"
        "[leases]\nmax_prompts = 4\ntimeout_s = 30.0\n"
    )
    common = loopback_args(f"pp{mode[:4]}{os.getpid() % 10000}", "WARNING")
    env = {**PACE, **({"ECHO2SWARM_FETCH__PEER_ASSIST": "false"} if mode == "star" else {})}
    daemons = []
    try:
        boot = DaemonProcess("bootstrap", [*common, "--role", "bootstrap", "--new-swarm"], run_dir / "bootstrap").start()
        daemons.append(boot)
        boot.wait_ready(60)
        join = ["--initial-peers", boot.maddr]
        learner = DaemonProcess("learner", [*common, *join, "--config", str(config)], run_dir / "learner").start()
        daemons.append(learner)
        peers = [DaemonProcess(f"rollout-{i}", [*common, *join, "--role", "rollout", "--trust", f"{key}.pub"],
                               run_dir / f"rollout-{i}", env=env).start() for i in range(args.peers)]
        daemons += peers
        for d in daemons[1:]:
            d.wait_ready(180)

        def published() -> int:
            return info(learner)["stats"].get("published_version") or 0

        until(lambda: published() >= args.skip, 300, f"v{args.skip}")
        first, served0 = published(), info(learner)["stats"]["server"].get("bytes_served", 0)
        fetched0 = sum(info(p)["stats"]["fetch"].get("bytes_fetched", 0) for p in peers)
        until(lambda: published() >= first + args.versions, args.timeout, f"{args.versions} more versions")
        stats = info(learner)["stats"]
        last, served = published(), stats["server"].get("bytes_served", 0) - served0
        fetched = sum(info(p)["stats"]["fetch"].get("bytes_fetched", 0) for p in peers) - fetched0
        kinds = Counter(f"{r['kind']}/{r['keyframe_reason']}" if r.get("keyframe_reason") else r["kind"]
                        for v, r in stats["versions"].items() if int(v) > first)
        dense = max(r["dense_bytes"] for r in stats["versions"].values())
        paths: Counter[str] = Counter()
        for p in peers:
            paths.update(info(p)["stats"].get("fetch_paths", {}))
    finally:
        for d in reversed(daemons):
            d.terminate()
    n = last - first
    return {"mode": mode, "versions": n, "learner_copies": served / dense / n, "fetched_mb": fetched / n / 1e6,
            "learner_share": served / max(1, fetched), "kinds": dict(kinds), "paths": dict(paths)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=6, help="rollout peers")
    parser.add_argument("--versions", type=int, default=20, help="versions measured")
    parser.add_argument("--skip", type=int, default=5, help="versions left out first (start-up)")
    parser.add_argument("--delta-max-ratio", type=float, default=0.25,
                        help="the learner's publish.delta_max_ratio: below this run's delta/dense (~0.4), so that "
                        "every version is dense with its delta beside it, the case a trained fp32 policy is in")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    if args.peers < 2 or args.versions < 1 or args.skip < 1:
        parser.error("--peers >= 2, --versions >= 1, --skip >= 1")

    from echo2swarm.models.tiny import write_tiny_model

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-plan-paths-") as tmp:
        model_dir = write_tiny_model(Path(tmp) / "model", seed=0)
        for mode in ("star", "pipelined"):
            rows.append(run_mode(model_dir, Path(tmp) / mode, mode, args))
            print(f"  {mode}: {rows[-1]['learner_copies']:.2f} learner copies a version", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows))
        return
    print(f"\nlearner upload per version: {args.peers} rollout peers, fp32 versions, {os.cpu_count()} CPU cores")
    print(f"{'mode':<10}{'versions':>9}{'learner copies':>16}{'fetched MB/v':>14}{'learner share':>15}  kinds; paths")
    for r in rows:
        print(f"{r['mode']:<10}{r['versions']:>9}{r['learner_copies']:>16.2f}{r['fetched_mb']:>14.2f}"
              f"{r['learner_share']:>15.2f}  {r['kinds']}; {r['paths']}")
    star, ours = rows
    print(f"learner upload, pipelined / star: {ours['learner_copies'] / star['learner_copies']:.3f}x")


if __name__ == "__main__":
    main()
