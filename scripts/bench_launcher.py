#!/usr/bin/env python
"""Local swarm start-up: daemons spawned as new interpreters against daemons forked from the launcher
(runtime/launcher.py), in one invocation.

    python scripts/bench_launcher.py [--rollout-peers 2] [--rounds 3]

Each round starts, on 127.0.0.1, a bootstrap, a learner (tiny model, 3 steps) and the rollout peers
(engine hosts isolated, as by default), waits until every peer has delivered rollouts and the
learner has stepped, then stops them all; once with every process a new interpreter (what a user's
`echo2swarm daemon` is) and once forked from a launcher (what the test suite and `echo2swarm demo`
do: daemons and their engine hosts). Reports per mode the wall seconds to the first learner step,
and the CPU seconds of every process involved (the launcher's own imports included, once per
invocation as the suite pays them once per run), then the ratios forked / spawned.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from echo2swarm.runtime.launcher import Launcher  # noqa: E402
from echo2swarm.runtime.processes import DaemonProcess, loopback_args, wait_until  # noqa: E402


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _stats(daemon: DaemonProcess) -> dict:
    with urllib.request.urlopen(daemon.info["chunk_url"] + "/v1/info", timeout=10) as resp:
        return json.loads(resp.read())["stats"]


def one_round(root: Path, model: Path, key: Path, peers: int, launcher: Launcher | None, n: int) -> float:
    """Seconds from the first start to the learner's first step with every peer delivering."""
    swarm = f"bl{os.getpid() % 10000}x{n}"
    common = loopback_args(swarm, "INFO")
    toml = root / "learner.toml"
    toml.write_text(f'role = "learner"\n[publish]\nmodel = "{model}"\npolicy_key = "{key}"\n'
                    '[train]\ntask = "arith"\nsteps = 1000\nprompts_per_step = 4\ngroup_size = 4\nmax_new_tokens = 4\n'
                    'threads = 1\n[leases]\nmax_prompts = 4\ntimeout_s = 5.0\n')
    daemons: list[DaemonProcess] = []
    started = time.monotonic()
    try:
        boot = DaemonProcess("bootstrap", [*common, "--role", "bootstrap", "--new-swarm"], root / f"boot{n}",
                             launcher=launcher).start()
        daemons.append(boot)
        boot.wait_ready(120)
        join = ["--initial-peers", boot.maddr]
        learner = DaemonProcess("learner", [*common, *join, "--config", str(toml)], root / f"learner{n}",
                                launcher=launcher).start()
        daemons.append(learner)
        for i in range(peers):
            daemons.append(DaemonProcess(f"rollout-{i}", [*common, *join, "--role", "rollout", "--trust", f"{key}.pub"],
                                         root / f"rollout{n}-{i}", env={"ECHO2SWARM_ENGINE__THREADS": "1"},
                                         launcher=launcher).start())
        for d in daemons[1:]:
            d.wait_ready(180)

        def working() -> bool:
            delivered = all(_stats(d).get("worker", {}).get("rollouts", 0) > 0 for d in daemons[2:])
            return delivered and _stats(learner).get("steps_done", 0) >= 1

        wait_until(working, 300, interval=0.1, what="every peer to deliver and the learner to step")
        return time.monotonic() - started
    finally:
        for d in reversed(daemons):
            d.terminate(grace=10)


def run_mode(forked: bool, model: Path, key: Path, args: argparse.Namespace) -> dict:
    root = Path(tempfile.mkdtemp(prefix="e2s-bench-launcher-"))
    cpu_before = _children_cpu()
    launcher = Launcher().start() if forked else None
    try:
        walls = [one_round(root, model, key, args.rollout_peers, launcher, n) for n in range(args.rounds)]
    finally:
        if launcher:
            launcher.close()  # reaped here: its CPU, and that of the children it reaped, count from now
        shutil.rmtree(root, ignore_errors=True)
    cpu = _children_cpu() - cpu_before
    return {"wall_s": walls, "cpu_s": cpu / args.rounds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollout-peers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    if args.rollout_peers < 1 or args.rounds < 1:
        parser.error("--rollout-peers and --rounds must be at least 1")

    from echo2swarm.models.tiny import write_tiny_model
    from echo2swarm.wire.signing import PolicyKey

    work = Path(tempfile.mkdtemp(prefix="e2s-bench-launcher-model-"))
    try:
        model, key = work / "model", work / "learner.key"
        write_tiny_model(model, seed=0)
        PolicyKey.generate().save(key)
        results = {"spawned": run_mode(False, model, key, args), "forked": run_mode(True, model, key, args)}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    daemons = 2 + args.rollout_peers
    print(f"{daemons} daemons (bootstrap, learner, {args.rollout_peers} rollout peers with engine hosts), "
          f"{args.rounds} rounds each, to the learner's first step with every peer delivering")
    print(f"{'mode':<10} {'wall s (median)':>16} {'CPU s per round':>16}")
    for mode, r in results.items():
        print(f"{mode:<10} {statistics.median(r['wall_s']):>16.1f} {r['cpu_s']:>16.1f}")
    spawned, forked = results["spawned"], results["forked"]
    print(f"forked / spawned: wall x{statistics.median(forked['wall_s']) / statistics.median(spawned['wall_s']):.2f}, "
          f"CPU x{forked['cpu_s'] / spawned['cpu_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
