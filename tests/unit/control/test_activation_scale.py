"""Cost-aware activation over pools the size of a public swarm (control/activation.py)."""

from __future__ import annotations

import random

from echo2swarm.control.activation import Worker, choose_active, greedy_by_rho


def test_a_pool_of_ten_thousand_is_planned_in_well_under_a_second_and_near_the_lp_bound() -> None:
    """The unbounded swaps took 94 s a re-plan over 3,000 peers (echo2swarm simulate found it); the
    learner re-plans every 10 s. The LP bound (cheapest rollouts, the last fractionally) is below any set."""
    import time

    rng = random.Random(5)
    pool = [Worker(f"p{i}", mu=rng.uniform(0.05, 1.0), price=rng.uniform(0.1, 2.5)) for i in range(10_000)]
    for floor in (5.0, 50.0, 400.0):
        started = time.monotonic()
        chosen = choose_active(pool, floor)
        took = time.monotonic() - started
        assert chosen is not None and sum(w.mu for w in chosen) >= floor - 1e-9
        lp, gap = 0.0, floor
        for w in sorted(pool, key=lambda w: w.rho):
            take = min(1.0, gap / w.mu)
            lp, gap = lp + take * w.price, gap - take * w.mu
            if gap <= 1e-12:
                break
        cost = sum(w.price for w in chosen)
        assert cost <= lp + max(w.price for w in chosen) and cost <= sum(w.price for w in greedy_by_rho(pool, floor))
        assert took < 1.0, f"floor {floor}: {took:.2f} s"
