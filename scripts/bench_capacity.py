#!/usr/bin/env python
"""Bubble ratio against provisioned throughput (ECHO-2 Fig. 3c), measured on real daemons next to the model.

    python scripts/bench_capacity.py [--ratios 0.5,0.75,0.9,1.0,1.1,1.25,1.5,2.0] [--png docs/bench_capacity.png]

For each ratio x a fresh local swarm runs: bootstrap, learner (T_train padded to --t-train seconds
by train.min_step_s, standing in for a larger model) and --peers rollout peers on the real engine,
each paced (worker.max_rollouts_per_s) so that together they provide x times the bare floor
R / T_train. Activation is off, so every provisioned peer works. The learner's measured bubble
ratio (steps after --skip) is printed next to control.capacity's prediction from the learner's
own measured T_train, T_bcast and L_gen. The knee is where the bubble first falls to --knee-at.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run_point(model_dir: Path, run_dir: Path, ratio: float, args: argparse.Namespace) -> dict:
    from echo2swarm.wire.signing import PolicyKey
    from echo2swarm.runtime.processes import DaemonProcess, loopback_args

    run_dir.mkdir(parents=True)
    key = run_dir / "learner.key"
    PolicyKey.generate().save(key)
    rollouts = args.prompts_per_step * args.group_size
    pace = ratio * rollouts / args.t_train / args.peers
    config = run_dir / "learner.toml"
    config.write_text(
        f'role = "learner"\n[publish]\nmodel = "{model_dir}"\npolicy_key = "{key}"\n'
        f'[train]\ntask = "arith"\nsteps = {args.steps}\nstaleness = {args.staleness}\n'
        f"prompts_per_step = {args.prompts_per_step}\ngroup_size = {args.group_size}\nmax_new_tokens = 4\n"
        f"threads = 1\ncheckpoint_every = 1000\nmin_step_s = {args.t_train}\n"
        "[leases]\nmax_prompts = 1\ntimeout_s = 30.0\n[activation]\nenabled = false\n"
    )
    common = loopback_args(f"cap{int(ratio * 100)}", "WARNING")
    env = {"ECHO2SWARM_ENGINE__THREADS": "1", "ECHO2SWARM_WORKER__MAX_ROLLOUTS_PER_S": f"{pace:.4f}",
           "ECHO2SWARM_WORKER__MAX_PROMPTS": "1"}
    daemons = []
    try:
        boot = DaemonProcess("bootstrap", [*common, "--role", "bootstrap", "--new-swarm"], run_dir / "bootstrap").start()
        daemons.append(boot)
        boot.wait_ready(60)
        join = ["--initial-peers", boot.maddr]
        for i in range(args.peers):
            daemons.append(DaemonProcess(f"rollout-{i}", [*common, *join, "--role", "rollout", "--trust", f"{key}.pub"],
                                         run_dir / f"rollout-{i}", env=env).start())
        for d in daemons[1:]:
            d.wait_ready(120)
        learner = DaemonProcess("learner", [*common, *join, "--config", str(config)], run_dir / "learner").start()
        daemons.append(learner)
        assert learner.proc is not None
        learner.proc.wait(args.timeout)
        records = [json.loads(line) for line in (run_dir / "learner" / "run" / "metrics.jsonl").read_text().splitlines()]
    finally:
        for d in reversed(daemons):
            d.terminate()
    used = records[args.skip:]
    wait = sum(r["wait_s"] for r in used)
    wall = used[-1]["time_s"] - records[args.skip - 1]["time_s"]
    t_train = (wall - wait) / len(used)
    last = records[-1]
    return {"ratio": ratio, "pace": pace, "measured": wait / wall, "t_train": t_train,
            "t_bcast": last.get("t_bcast_s") or 0.0, "rollouts": rollouts, "steps": len(used)}


def predict(point: dict, args: argparse.Namespace, l_gen: float) -> float:
    from echo2swarm.control.capacity import CapacityInputs

    inputs = CapacityInputs(rollouts_per_step=point["rollouts"], t_train=point["t_train"], t_bcast=point["t_bcast"],
                            staleness=args.staleness, l_gen=l_gen)
    return inputs.bubble_ratio(point["pace"] * args.peers)


def knee(xs: list[float], ys: list[float], level: float) -> float | None:
    """Smallest x where y falls to `level`, interpolated linearly between sweep points."""
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if y0 > level >= y1:
            return x0 + (y0 - level) * (x1 - x0) / (y0 - y1)
    return xs[0] if ys and ys[0] <= level else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ratios", default="0.5,0.75,0.9,1.0,1.1,1.25,1.5,2.0")
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--t-train", type=float, default=1.0, help="learner seconds per step (min_step_s)")
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--staleness", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--skip", type=int, default=4, help="first steps left out (start-up)")
    parser.add_argument("--knee-at", type=float, default=0.05, help="bubble level that defines the knee")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--png", type=Path, default=None)
    args = parser.parse_args()
    ratios = [float(r) for r in args.ratios.split(",")]

    from echo2swarm.models.tiny import write_tiny_model

    points = []
    with tempfile.TemporaryDirectory(prefix="bench-capacity-") as tmp:
        model_dir = write_tiny_model(Path(tmp) / "model", seed=0)
        for ratio in ratios:
            points.append(run_point(model_dir, Path(tmp) / f"x{ratio}", ratio, args))
            print(f"  x = {ratio:.2f}: measured bubble {points[-1]['measured']:.3f}", file=sys.stderr, flush=True)
    for p in points:
        # L_gen of one lease (1 prompt x G rollouts) at a peer's pace.
        p["predicted"] = predict(p, args, l_gen=args.group_size / p["pace"])
    print(f"\nbubble ratio vs provisioned throughput: {args.peers} paced rollout peers, R = "
          f"{args.prompts_per_step}x{args.group_size} rollouts/step, T_train ~ {args.t_train} s, S = {args.staleness}, "
          f"{os.cpu_count()} CPU cores")
    print(f"{'mu/mu_floor':>12}{'sum mu /s':>11}{'T_train s':>11}{'T_bcast s':>11}{'measured':>10}{'predicted':>11}")
    for p in points:
        print(f"{p['ratio']:>12.2f}{p['pace'] * args.peers:>11.1f}{p['t_train']:>11.3f}{p['t_bcast']:>11.3f}"
              f"{p['measured']:>10.3f}{p['predicted']:>11.3f}")
    xs = [p["ratio"] for p in points]
    km, kp = knee(xs, [p["measured"] for p in points], args.knee_at), knee(xs, [p["predicted"] for p in points], args.knee_at)
    at_gamma = min(points, key=lambda p: abs(p["ratio"] - 1.1))
    print(f"knee (bubble <= {args.knee_at:.0%}): measured x = {km if km is None else round(km, 3)}, "
          f"predicted x = {kp if kp is None else round(kp, 3)}"
          + (f", predicted/measured = {kp / km:.2f}" if km and kp else ""))
    print(f"at gamma = {at_gamma['ratio']}: measured bubble {at_gamma['measured']:.1%}")
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(xs, [p["measured"] for p in points], "o-", label="measured (real daemons)")
        ax.plot(xs, [p["predicted"] for p in points], "s--", label="capacity model")
        ax.axvline(1.1, color="grey", lw=0.8, ls=":", label="gamma = 1.1")
        ax.set_xlabel("provisioned throughput / floor (sum mu / (R / T_train))")
        ax.set_ylabel("learner bubble ratio")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)
        print(f"plot: {args.png}")


if __name__ == "__main__":
    main()
