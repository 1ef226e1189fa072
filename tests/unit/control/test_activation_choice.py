"""Activation: ρ-greedy then improved, against the brute-force optimum and the random baseline."""

from __future__ import annotations

import random
import statistics

import pytest

from echo2swarm.control.activation import (
    ActivationController,
    Worker,
    brute_force,
    choose_active,
    greedy_by_rho,
    random_active,
    total_mu,
    total_price,
)
from echo2swarm.control.pools import gpu_pool


def _pools(count: int, sizes: range, seed: int = 0):
    rng = random.Random(seed)
    for i in range(count):
        pool = gpu_pool(rng.choice(sizes), seed=seed * 100_000 + i)
        yield pool, rng.uniform(0.2, 0.8) * total_mu(pool)


def test_improvement_fixes_greedy_overshoot():
    # ρ order: b (cheapest per rollout), then big expensive a; c alone closes the gap for less.
    pool = [Worker("a", mu=20, price=0.7), Worker("b", mu=6, price=0.2), Worker("c", mu=3, price=0.12)]
    greedy = greedy_by_rho(pool, floor=8)
    assert [w.peer_id for w in greedy] == ["b", "a"]
    best = choose_active(pool, floor=8)
    assert sorted(w.peer_id for w in best) == ["b", "c"]
    assert total_price(best) == pytest.approx(total_price(brute_force(pool, 8)))


def test_within_two_percent_of_optimum_on_many_seeded_pools():
    gaps = []
    for pool, floor in _pools(300, range(3, 13)):
        best = brute_force(pool, floor)
        ours = choose_active(pool, floor)
        assert (best is None) == (ours is None)
        if best is None:
            continue
        assert total_mu(ours) >= floor - 1e-9
        gap = total_price(ours) / total_price(best) - 1
        assert gap <= 0.02, f"{gap:.1%} above optimum: pool {pool}, floor {floor}"
        gaps.append(gap)
    assert len(gaps) >= 290


def test_cost_aware_is_at_least_13_percent_cheaper_than_random():
    ratios = []
    for i, (pool, floor) in enumerate(_pools(200, range(6, 40), seed=1)):
        ours = choose_active(pool, floor)
        rand = random_active(pool, floor, random.Random(i))
        assert ours is not None and rand is not None
        assert total_mu(rand) >= floor - 1e-9 and total_mu(ours) >= floor - 1e-9  # same floor met: equal bubble
        ratios.append(total_price(ours) / total_price(rand))
    saving = 1 - statistics.mean(ratios)
    assert saving >= 0.13, f"only {saving:.1%} cheaper than random"
    assert max(ratios) <= 1 + 1e-9, "a random set was cheaper than the planner's"


def test_never_worse_than_plain_greedy():
    for pool, floor in _pools(200, range(3, 30), seed=2):
        ours, greedy = choose_active(pool, floor), greedy_by_rho(pool, floor)
        assert total_price(ours) <= total_price(greedy) + 1e-9


def test_infeasible_and_trivial_floors():
    pool = [Worker("a", 2, 0.1), Worker("b", 3, 0.2)]
    assert choose_active(pool, 6) is None and brute_force(pool, 6) is None
    assert choose_active(pool, 0) == []
    assert choose_active([Worker("z", 0, 0.0)], 1) is None


def test_free_peers_come_first():
    pool = [Worker("paid", 10, 0.5), Worker("free", 3, 0.0)]
    assert [w.peer_id for w in choose_active(pool, 2)] == ["free"]


@pytest.mark.parametrize(("mu", "price"), [(-1.0, 0.1), (float("nan"), 0.1), (1.0, -0.5), (1.0, float("inf"))])
def test_worker_is_validated(mu, price):
    with pytest.raises(ValueError, match="rollouts_per_s|price"):
        Worker("x", mu, price)


def test_controller_keeps_a_feasible_set_within_the_band():
    ctl = ActivationController(hysteresis=0.1)
    pool = [Worker("a", 5, 0.2), Worker("b", 5, 0.3), Worker("c", 5, 0.9)]
    assert ctl.update(pool, 9).active == ["a", "b"]
    # µ jitters a little below the floor: no change (no flapping).
    jittered = [Worker("a", 4.6, 0.2), Worker("b", 4.5, 0.3), Worker("c", 5, 0.9)]
    d = ctl.update(jittered, 9)
    assert d.active == ["a", "b"] and not d.activated and not d.deactivated
    # A slightly cheaper alternative appears: not worth a switch.
    d = ctl.update([*pool, Worker("d", 5, 0.28)], 9)
    assert d.active == ["a", "b"]
    # A much cheaper one: switch.
    d = ctl.update([*pool, Worker("d", 5, 0.05)], 9)
    assert d.active == ["a", "d"] and d.activated == ["d"] and d.deactivated == ["b"]


def test_controller_activates_a_standby_peer_when_an_active_one_leaves():
    ctl = ActivationController(hysteresis=0.1)
    pool = [Worker("a", 5, 0.2), Worker("b", 5, 0.3), Worker("c", 5, 0.9), Worker("d", 5, 1.2)]
    assert ctl.update(pool, 9).active == ["a", "b"]
    d = ctl.update([w for w in pool if w.peer_id != "a"], 9)
    assert d.active == ["b", "c"] and d.activated == ["c"] and d.deactivated == ["a"]
    assert "short of the floor" in d.reason


def test_controller_makes_everyone_active_when_the_floor_is_out_of_reach():
    ctl = ActivationController()
    d = ctl.update([Worker("a", 1, 0.2), Worker("b", 1, 0.3)], 9)
    assert not d.feasible and d.active == ["a", "b"]


def test_controller_does_not_flap_under_noise():
    base = gpu_pool(10, seed=3)
    floor = 0.5 * total_mu(base)

    def switches(hysteresis: float) -> int:
        """Peers switched on or off over 200 re-plans of the same pool under ±3 % noise in µ."""
        rng = random.Random(7)
        ctl = ActivationController(hysteresis=hysteresis)
        ctl.update(base, floor)
        changes = 0
        for _ in range(200):
            noisy = [Worker(w.peer_id, w.mu * rng.uniform(0.97, 1.03), w.price) for w in base]
            d = ctl.update(noisy, floor)
            changes += len(d.activated) + len(d.deactivated)
        return changes

    changes = switches(0.1)
    assert changes <= 2
    flaps = switches(0.0)
    assert flaps > changes, "the test pool must be one where hysteresis matters"


def test_a_small_search_budget_still_returns_a_feasible_improved_set():
    for pool, floor in _pools(50, range(20, 60), seed=4):
        cheap = choose_active(pool, floor, max_nodes=10)
        assert total_mu(cheap) >= floor - 1e-9
        assert total_price(cheap) <= total_price(greedy_by_rho(pool, floor)) + 1e-9
        assert total_price(choose_active(pool, floor)) <= total_price(cheap) + 1e-9
