"""Seeded heterogeneous pools of rollout peers, priced and sized like rented GPUs (tests and benchmarks).

The catalogue is our own rough reading of 2025 marketplace listings (consumer cards on peer
marketplaces, data-centre cards on-demand), with rollouts/s relative to an RTX 3090 for a
small-model GRPO workload. Each peer gets jitter on both, and some are spot/interruptible at a
discount, so cost per rollout spreads over about an order of magnitude.
"""

from __future__ import annotations

import random

from echo2swarm.control.activation import Worker

# name: (USD per hour, rollouts/s relative to an RTX 3090)
GPU_CATALOGUE: dict[str, tuple[float, float]] = {
    "rtx3060": (0.08, 0.35),
    "rtx3090": (0.22, 1.0),
    "rtx4090": (0.35, 1.6),
    "l4": (0.45, 0.7),
    "a10": (0.60, 0.9),
    "a100": (1.30, 2.6),
    "h100": (2.40, 4.8),
}


def gpu_pool(n: int, seed: int, base_mu: float = 10.0, spot_share: float = 0.3) -> list[Worker]:
    """`n` peers drawn from the catalogue; `base_mu` is an RTX 3090's rollouts/s."""
    rng = random.Random(seed)
    names = sorted(GPU_CATALOGUE)
    pool = []
    for i in range(n):
        name = rng.choice(names)
        price, speed = GPU_CATALOGUE[name]
        price *= rng.uniform(0.8, 1.3)
        if rng.random() < spot_share:
            price *= rng.uniform(0.35, 0.6)
        mu = base_mu * speed * rng.uniform(0.85, 1.15)
        pool.append(Worker(f"{name}-{i:02d}", mu=round(mu, 3), price=round(price, 4)))
    return pool
