"""Cost-aware activation: the cheapest set of rollout peers whose throughput meets the floor.

The problem is a covering knapsack: minimise Σ price_i over A subject to Σ_{i∈A} µ_i ≥ floor.
`choose_active` follows ECHO-2: take peers in order of cost per rollout ρ_i = price_i / (3600 µ_i)
until the floor is met, then improve, because plain ρ-greedy overshoots when the last peer it
adds is large and expensive:
  1. for every ρ-ordered prefix, close the remaining gap with the single cheapest peer that does;
  2. local search: drop peers that are not needed, then 1↔1, 2→1 and 1→2 swaps, while any lowers
     the cost (past SEARCH_ALL peers among SEARCH_WINDOW candidates a side, so a re-plan over
     10,000 peers takes milliseconds);
  3. branch and bound in ρ order, seeded with that set as the incumbent and pruned with the LP
     bound (fill the gap fractionally with the cheapest rollouts left). Within `max_nodes` it is
     exact (every pool of a few dozen peers); past it, the best set found so far is kept.
`timely` leaves out first the peers whose versions arrive too late for the staleness budget.
`brute_force` is the exact optimum for small pools (the unit tests' and benchmark's yardstick);
`ActivationController` adds the closed loop's hysteresis so that small changes in µ or price
do not make peers flap between active and standby.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

_EPS = 1e-9
SEARCH_ALL = 400  # pools up to this size: the local search tries every swap (and branch and bound follows)
SEARCH_WINDOW = 48  # larger pools: candidates a side for the swaps
DEFAULT_HYSTERESIS = 0.1  # activation.hysteresis: the share of the floor and of the cost tolerated


@dataclass(frozen=True)
class Worker:
    """One rollout peer as the planner sees it: measured rollouts/s, advertised USD per hour and, once
    it fetched a few versions, how long a version takes to reach it (its card's arrivals; None: unknown)."""

    peer_id: str
    mu: float
    price: float
    arrival_s: float | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.mu) and self.mu >= 0):
            raise ValueError(f"{self.peer_id}: rollouts_per_s must be a finite number >= 0, got {self.mu}")
        if not (math.isfinite(self.price) and self.price >= 0):
            raise ValueError(f"{self.peer_id}: price must be a finite number >= 0 (USD per hour), got {self.price}")
        if self.arrival_s is not None and not (math.isfinite(self.arrival_s) and self.arrival_s >= 0):
            raise ValueError(f"{self.peer_id}: arrival_s must be a finite number >= 0, got {self.arrival_s}")

    @property
    def rho(self) -> float:
        """USD per rollout."""
        return math.inf if self.mu <= 0 else self.price / (3600.0 * self.mu)


def total_mu(workers: Iterable[Worker]) -> float:
    return sum(w.mu for w in workers)


def total_price(workers: Iterable[Worker]) -> float:
    return sum(w.price for w in workers)


def timely(workers: Sequence[Worker], floor: float, budget: float) -> tuple[list[Worker], list[Worker]]:
    """(pool, late): the peers a plan should choose from, and those it leaves out as late. A peer whose
    versions arrive after `budget` seconds (CapacityInputs.arrival_budget) makes the learner wait for its
    rollouts whatever its price, so it is left out while the others (unknown arrivals included) still
    meet `floor`; when they do not, nobody is (a slow peer beats no peer)."""
    late = [w for w in workers if w.arrival_s is not None and w.arrival_s > budget]
    if not late:
        return list(workers), []
    out = {w.peer_id for w in late}
    pool = [w for w in workers if w.peer_id not in out]
    if total_mu(pool) < floor - _EPS:
        return list(workers), []
    return pool, late


def _order(workers: Iterable[Worker]) -> list[Worker]:
    return sorted((w for w in workers if w.mu > 0), key=lambda w: (w.rho, w.price, w.peer_id))


def greedy_by_rho(workers: Sequence[Worker], floor: float) -> list[Worker] | None:
    """ECHO-2's ρ-ordered greedy: cheapest rollouts first until the floor is met. None if all together fall short."""
    chosen: list[Worker] = []
    for w in _order(workers):
        if total_mu(chosen) >= floor - _EPS:
            break
        chosen.append(w)
    return chosen if total_mu(chosen) >= floor - _EPS else None


def random_active(workers: Sequence[Worker], floor: float, rng: random.Random) -> list[Worker] | None:
    """The cost-blind baseline: peers in random order until the floor is met."""
    pool = [w for w in workers if w.mu > 0]
    rng.shuffle(pool)
    chosen: list[Worker] = []
    for w in pool:
        if total_mu(chosen) >= floor - _EPS:
            break
        chosen.append(w)
    return chosen if total_mu(chosen) >= floor - _EPS else None


def _prefix_fill(order: list[Worker], floor: float) -> list[Worker]:
    """Best over ρ-prefixes of: prefix + the single cheapest outside peer that closes the gap."""
    best: list[Worker] | None = None
    best_cost = math.inf
    prefix_mu = prefix_cost = 0.0
    for i in range(len(order) + 1):
        gap = floor - prefix_mu
        if gap <= _EPS:
            if prefix_cost < best_cost:
                best, best_cost = order[:i], prefix_cost
            break
        closers = [w for w in order[i:] if w.mu >= gap - _EPS]
        if closers:
            closer = min(closers, key=lambda w: (w.price, -w.mu))
            if prefix_cost + closer.price < best_cost:
                best, best_cost = [*order[:i], closer], prefix_cost + closer.price
        if i < len(order):
            prefix_mu += order[i].mu
            prefix_cost += order[i].price
    assert best is not None
    return best


def _local_search(chosen: list[Worker], pool: list[Worker], floor: float) -> list[Worker]:
    """Drops, then the best 1↔1, 2→1 or 1→2 swap, until none lowers the cost. `pool` in ρ order. Past
    SEARCH_ALL peers the swaps look at SEARCH_WINDOW candidates a side (the outside peers first in ρ
    order and the cheapest, the dearest chosen ones): the 1→2 swaps over every pair of a pool of 3,000
    took 94 s a re-plan, and a large pool's greedy set is within one peer's price of the optimum anyway."""
    chosen = list(chosen)
    bounded = len(pool) > SEARCH_ALL
    improved = True
    while improved:
        improved = False
        # Drop what is not needed, most expensive first.
        for w in sorted(chosen, key=lambda w: -w.price):
            if total_mu(chosen) - w.mu >= floor - _EPS:
                chosen.remove(w)
                improved = True
        inside = set(w.peer_id for w in chosen)
        outside = [w for w in pool if w.peer_id not in inside]
        pairs_of = chosen
        if bounded:
            cheapest = sorted(outside, key=lambda w: (w.price, -w.mu))[:SEARCH_WINDOW]
            outside = list({w.peer_id: w for w in [*outside[:SEARCH_WINDOW], *cheapest]}.values())
            pairs_of = sorted(chosen, key=lambda w: -w.price)[:SEARCH_WINDOW]
        mu, cost = total_mu(chosen), total_price(chosen)
        best_delta, best_move = -_EPS, None
        for a in chosen:  # 1 <-> 1
            for b in outside:
                if mu - a.mu + b.mu >= floor - _EPS and b.price - a.price < best_delta:
                    best_delta, best_move = b.price - a.price, ([a], [b])
        for a1, a2 in itertools.combinations(pairs_of, 2):  # 2 -> 1
            for b in outside:
                d = b.price - a1.price - a2.price
                if d < best_delta and mu - a1.mu - a2.mu + b.mu >= floor - _EPS:
                    best_delta, best_move = d, ([a1, a2], [b])
        for a in pairs_of:  # 1 -> 2
            for b1, b2 in itertools.combinations(outside, 2):
                d = b1.price + b2.price - a.price
                if d < best_delta and mu - a.mu + b1.mu + b2.mu >= floor - _EPS:
                    best_delta, best_move = d, ([a], [b1, b2])
        if best_move is not None and cost + best_delta < cost:
            out, into = best_move
            chosen = [w for w in chosen if w not in out] + into
            improved = True
    return chosen


def _branch_and_bound(order: list[Worker], floor: float, incumbent: list[Worker], max_nodes: int) -> list[Worker]:
    n = len(order)
    mus = [w.mu for w in order]
    prices = [w.price for w in order]
    suffix_mu = [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):
        suffix_mu[i] = suffix_mu[i + 1] + mus[i]
    best_cost = total_price(incumbent)
    best: list[int] | None = None
    nodes = 0

    def bound(i: int, gap: float) -> float:
        # LP relaxation: the cheapest rollouts left (ρ order), the last one fractionally.
        extra = 0.0
        for j in range(i, n):
            if gap <= _EPS:
                break
            take = min(1.0, gap / mus[j])
            extra += take * prices[j]
            gap -= take * mus[j]
        return extra if gap <= _EPS else math.inf

    chosen: list[int] = []

    def visit(i: int, gap: float, cost: float) -> None:
        nonlocal best_cost, best, nodes
        nodes += 1
        if gap <= _EPS:
            if cost < best_cost - _EPS:
                best_cost, best = cost, list(chosen)
            return
        if i >= n or nodes > max_nodes or suffix_mu[i] < gap - _EPS:
            return
        if cost + bound(i, gap) >= best_cost - _EPS:
            return
        chosen.append(i)
        visit(i + 1, gap - mus[i], cost + prices[i])
        chosen.pop()
        visit(i + 1, gap, cost)

    visit(0, floor, 0.0)
    return incumbent if best is None else [order[i] for i in best]


def choose_active(workers: Sequence[Worker], floor: float, max_nodes: int = 200_000) -> list[Worker] | None:
    """The cheapest set found whose Σµ ≥ floor (ρ-greedy, then improved); None if all together fall short.

    >>> pool = [Worker("a", mu=10, price=1.0), Worker("b", mu=4, price=0.2), Worker("c", mu=4, price=0.25)]
    >>> [w.peer_id for w in choose_active(pool, floor=7)]
    ['b', 'c']
    """
    if floor <= 0:
        return []
    order = _order(workers)
    if total_mu(order) < floor - _EPS:
        return None
    start = _prefix_fill(order, floor)
    greedy = greedy_by_rho(order, floor) or order
    if total_price(greedy) < total_price(start):
        start = greedy
    improved = _local_search(start, order, floor)
    if len(order) > SEARCH_ALL:  # recursion depth; such pools keep the local-search result
        return _order(improved)
    return _order(_branch_and_bound(order, floor, improved, max_nodes))


def brute_force(workers: Sequence[Worker], floor: float, max_pool: int = 20) -> list[Worker] | None:
    """The exact optimum by enumeration (2^n subsets); for pools of at most `max_pool` peers."""
    pool = [w for w in workers if w.mu > 0]
    if len(pool) > max_pool:
        raise ValueError(f"brute force over {len(pool)} peers is too slow; at most {max_pool}")
    best, best_cost = None, math.inf
    mus = [w.mu for w in pool]
    prices = [w.price for w in pool]
    for mask in range(1 << len(pool)):
        mu = cost = 0.0
        for i in range(len(pool)):
            if mask >> i & 1:
                mu += mus[i]
                cost += prices[i]
        if mu >= floor - _EPS and cost < best_cost - _EPS:
            best, best_cost = mask, cost
    if best is None:
        return None
    return [w for i, w in enumerate(pool) if best >> i & 1]


@dataclass
class Decision:
    active: list[str]
    activated: list[str] = field(default_factory=list)
    deactivated: list[str] = field(default_factory=list)
    feasible: bool = True
    reason: str = ""


class ActivationController:
    """The closed loop's memory: re-plan with hysteresis so peers don't flap.

    The current active set is kept while it still gives at least (1 − hysteresis) · floor and no
    new plan is cheaper by more than `hysteresis` (a fraction of its cost). When the current set
    falls short (a peer left, µ dropped, the floor rose), standby peers are added to it; a fresh
    plan replaces it only if that is clearly cheaper than the patched set.

    >>> ctl = ActivationController(hysteresis=0.1)
    >>> ctl.update([Worker("a", 5, 0.2), Worker("b", 5, 0.3), Worker("c", 5, 0.9)], floor=9).active
    ['a', 'b']
    """

    def __init__(self, hysteresis: float = DEFAULT_HYSTERESIS):
        if not 0 <= hysteresis < 1:
            raise ValueError(f"hysteresis must be in [0, 1), got {hysteresis}")
        self.hysteresis = hysteresis
        self.active: set[str] = set()

    def update(self, workers: Sequence[Worker], floor: float) -> Decision:
        by_id = {w.peer_id: w for w in workers if w.mu > 0}
        current = [by_id[p] for p in sorted(self.active) if p in by_id]
        h = self.hysteresis
        plan = choose_active(list(by_id.values()), floor)
        if plan is None:
            target, feasible = list(by_id.values()), False
            reason = "the floor is out of reach: every peer is active"
        elif not current:
            target, feasible, reason = plan, True, "initial plan"
        elif total_mu(current) >= (1 - h) * floor - _EPS:
            if total_price(plan) < (1 - h) * total_price(current) - _EPS:
                target, feasible, reason = plan, True, "a cheaper set"
            else:
                target, feasible, reason = current, True, "kept"
        else:
            inside = {w.peer_id for w in current}
            extra = choose_active([w for w in by_id.values() if w.peer_id not in inside], floor - total_mu(current))
            patched = current + (extra or [])
            if extra is not None and total_price(patched) <= total_price(plan) / (1 - h) + _EPS:
                target, feasible, reason = patched, True, "short of the floor: standby peers added"
            else:
                target, feasible, reason = plan, True, "short of the floor: re-planned"
        new = {w.peer_id for w in target}
        decision = Decision(
            active=sorted(new), activated=sorted(new - self.active), deactivated=sorted(self.active - new),
            feasible=feasible, reason=reason,
        )
        self.active = new
        return decision
