"""Run a swarm in the WAN lab by hand: public bootstrap, relay and learner, rollout peers in homes behind NAT.

    sudo .venv/bin/python scripts/wan_lab.py --homes 2 --steps 30 --home-up 20

Every daemon is started through the CLI inside its own network namespace, with no NAT flags. The
script runs `echo2swarm doctor` in the first home, waits for the learner to finish, then prints the
`peers` table (read from the bootstrap's host), each home's reachability and the chunk bytes it
served over libp2p per client, and every home's uplink bytes; then it ends the daemons and deletes
the lab. Needs root, `ip`, `tc` and `iptables` (tests/helpers/wanlab.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from echo2swarm.models.tiny import write_tiny_model  # noqa: E402
from echo2swarm.wire.signing import PolicyKey  # noqa: E402
from tests.helpers.wanlab import WanLab  # noqa: E402
from tests.helpers.wanswarm import WanSwarm  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--homes", type=int, default=2, help="homes behind NAT, one rollout peer each")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--home-up", type=float, default=20.0, help="each home's uplink, Mbit/s")
    ap.add_argument("--home-down", type=float, default=100.0)
    ap.add_argument("--public-mbit", type=float, default=100.0, help="public hosts' up- and downlink, Mbit/s")
    ap.add_argument("--dir", type=Path, default=None, help="state and logs (default: a new temporary dir)")
    args = ap.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="wanlab-"))
    root.mkdir(parents=True, exist_ok=True)
    model = write_tiny_model(root / "tiny", seed=0) if not (root / "tiny").exists() else root / "tiny"
    key = root / "learner.key"
    if not key.exists():
        PolicyKey.generate().save(key)
    trust = PolicyKey.load(key).public.text
    toml = root / "learner.toml"
    toml.write_text("\n".join([
        'role = "learner"', "[publish]", f'model = "{model}"', f'policy_key = "{key}"', 'chunk_size = "64KiB"',
        "[train]", 'task = "arith"', f"steps = {args.steps}", "staleness = 1", "prompts_per_step = 8",
        "group_size = 4", "max_new_tokens = 4", "checkpoint_every = 1000", "threads = 1",
        "[leases]", "max_prompts = 4", "timeout_s = 5.0", "[activation]", "enabled = false",
    ]) + "\n")
    mbit = args.public_mbit
    with WanLab() as lab:
        swarm = WanSwarm(lab, root / "swarm", "wan")
        try:
            boot = lab.public_host("boot", mbit, mbit)
            swarm.bootstrap(boot)
            relay = swarm.start(lab.public_host("relay", mbit, mbit), "relay", "--role", "relay", "--trust", trust)
            relay.wait_ready(90)
            swarm.initial_peers += swarm.public_addrs(relay)
            # go-libp2p hole-punches once 4 public peers saw a home's one QUIC mapping: boot, relay, boot2, learner
            boot2 = swarm.start(lab.public_host("boot2", mbit, mbit), "boot2", "--role", "bootstrap")
            boot2.wait_ready(90)
            swarm.initial_peers += swarm.public_addrs(boot2)
            homes = {f"h{i}": lab.home(f"h{i}", args.home_up, args.home_down)[0] for i in range(args.homes)}
            first = next(iter(homes.values()))
            print(swarm.cli(first, "doctor", "--swarm", "wan", "--initial-peers", swarm.initial_peers[0],
                            "--state-dir", str(root / "doctor")).stdout, flush=True)
            peers = {n: swarm.start(h, f"rollout-{n}", "--role", "rollout", "--trust", trust) for n, h in homes.items()}
            for d in peers.values():
                d.wait_ready(120)
            deadline = time.monotonic() + 90  # relay slots come ~15 s after start; plans leave out `private` peers
            while time.monotonic() < deadline and any(swarm.info(d)["reachability"]["state"] == "private"
                                                      for d in peers.values()):
                time.sleep(1)
            learner = swarm.start(lab.public_host("lrn", mbit, mbit), "learner", "--config", str(toml))
            learner.wait_ready(120)
            started = time.monotonic()
            assert learner.proc is not None
            learner.proc.wait()
            print(f"learner finished {args.steps} steps in {time.monotonic() - started:.0f} s "
                  f"(exit {learner.proc.returncode})", flush=True)
            print(swarm.cli(boot, "peers", "--initial-peers", swarm.initial_peers[0], "--swarm", "wan").stdout)
            for name, d in peers.items():
                info = swarm.info(d)
                reach = info["reachability"]
                print(f"{name}: {reach['state']} (seen as {reach['observed']}), card maddrs {reach['maddrs']}, "
                      f"hole-punched {reach.get('holepunch')} to {[p[-8:] for p in reach.get('direct') or {}]}, "
                      f"version {info['version']}, served over libp2p "
                      f"{json.dumps({k[-8:]: v for k, v in info['p2p_served_to'].items()})}, "
                      f"uplink {lab.uplink_bytes(name)} bytes")
            print(f"logs and state: {root}")
        finally:
            swarm.close()


if __name__ == "__main__":
    main()
