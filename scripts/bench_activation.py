#!/usr/bin/env python
"""Cost per learner step of cost-aware, random and all-active activation (ECHO-2 Table 2), plus the optimum.

    python scripts/bench_activation.py [--pools 200] [--sizes 8,12,24,48] [--png docs/bench_activation.png]

Seeded heterogeneous pools (control/pools.py: consumer and data-centre GPUs, on-demand and spot
prices, per-peer jitter). Each pool gets a learner whose floor gamma * R / T_train needs a random
30-70 % of the pool's throughput. Every strategy meets that same floor, so the capacity model
predicts the same (zero) bubble ratio and the same step time for all of them: the difference is
only what the active peers cost per step. Brute force gives the exact optimum on pools of at
most 12 peers.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pools", type=int, default=200, help="seeded pools per size")
    parser.add_argument("--sizes", default="8,12,24,48")
    parser.add_argument("--rollouts-per-step", type=float, default=1024)
    parser.add_argument("--gamma", type=float, default=1.1)
    parser.add_argument("--png", type=Path, default=None)
    args = parser.parse_args()

    from echo2swarm.control.activation import brute_force, choose_active, greedy_by_rho, random_active, total_mu, total_price
    from echo2swarm.control.capacity import CapacityInputs
    from echo2swarm.control.pools import gpu_pool

    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        costs: dict[str, list[float]] = {"cost-aware": [], "rho-greedy only": [], "random": [], "all active": [],
                                         "optimum": []}
        bubbles: dict[str, list[float]] = {k: [] for k in costs}
        rng = random.Random(size)
        for i in range(args.pools):
            pool = gpu_pool(size, seed=size * 10_000 + i)
            need = rng.uniform(0.3, 0.7) * total_mu(pool)
            inputs = CapacityInputs(rollouts_per_step=args.rollouts_per_step, gamma=args.gamma,
                                    t_train=args.gamma * args.rollouts_per_step / need, t_bcast=0.0, staleness=1)
            floor = inputs.floor()
            sets = {
                "cost-aware": choose_active(pool, floor),
                "rho-greedy only": greedy_by_rho(pool, floor),
                "random": random_active(pool, floor, random.Random(i)),
                "all active": pool,
                "optimum": brute_force(pool, floor) if size <= 12 else None,
            }
            for name, chosen in sets.items():
                if chosen is None:
                    continue
                step = inputs.step_time(total_mu(chosen))
                costs[name].append(total_price(chosen) * step / 3600)
                bubbles[name].append(inputs.bubble_ratio(total_mu(chosen)))
        base = statistics.mean(costs["random"])
        for name, values in costs.items():
            if values:
                rows.append((size, name, statistics.mean(values) * 1000, statistics.mean(bubbles[name]),
                             statistics.mean(values) / base))
        if costs["optimum"]:
            gaps = [a / b - 1 for a, b in zip(costs["cost-aware"], costs["optimum"])]
            rows.append((size, "cost-aware gap to optimum: mean / max", statistics.mean(gaps), max(gaps), None))
    print(f"\ncost per learner step by activation strategy ({args.pools} seeded GPU pools per size; every set meets "
          f"the floor gamma*R/T_train, gamma = {args.gamma})")
    print(f"{'peers':>6}  {'strategy':<38}{'m$/step':>9}{'bubble':>8}{'vs random':>11}")
    for size, name, cost, bubble, rel in rows:
        if rel is None:
            print(f"{size:>6}  {name:<38}{cost:>8.2%} / {bubble:.2%}")
        else:
            print(f"{size:>6}  {name:<38}{cost:>9.3f}{bubble:>8.1%}{rel:>10.1%}")
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = ["cost-aware", "rho-greedy only", "random", "all active"]
        sizes = sorted({r[0] for r in rows})
        fig, ax = plt.subplots(figsize=(6, 4))
        width = 0.2
        for k, name in enumerate(names):
            vals = [next(r[4] for r in rows if r[0] == s and r[1] == name) for s in sizes]
            ax.bar([j + k * width for j in range(len(sizes))], vals, width, label=name)
        ax.set_xticks([j + 1.5 * width for j in range(len(sizes))], [f"{s} peers" for s in sizes])
        ax.set_ylabel("cost per step relative to random activation")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)
        print(f"plot: {args.png}")


if __name__ == "__main__":
    main()
