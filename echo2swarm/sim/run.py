"""One simulated swarm, end to end: draw the peers, plan the active set, spread a version, count the
control plane's traffic; and the table and plots of several.

    draw_peers ─► activation: the cheapest set meeting the capacity floor (control/activation.py,
                  choose_active; the floor from control/capacity.py with T_bcast = the last spread's t99),
                  peers whose last arrival exceeds the staleness budget left out while the rest suffice (timely)
               ─► spread over every follower under the real broadcast plan (sim/broadcast.py)
               ─► t50/t90/t99 over the active peers, learner busy share and $ a step (capacity model)
               ─► control traffic per node for the design (sim/control.py)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from echo2swarm.control.activation import Worker, choose_active, timely
from echo2swarm.control.capacity import DEFAULT_GAMMA, DEFAULT_PUBLISH_EVERY, DEFAULT_STALENESS, CapacityInputs
from echo2swarm.sim.broadcast import spread
from echo2swarm.sim.control import control_traffic, record_sizes
from echo2swarm.sim.population import MBIT, draw_peers


@dataclass(frozen=True)
class Scenario:
    """What `echo2swarm simulate` is asked; defaults: an 8B policy in bf16 with delta versions at
    bench_delta's lr 1e-6 ratio, and the daemons' own config defaults."""

    peers: int
    design: str = "shards"
    nat_share: float = 0.3
    holepunch_share: float = 0.6
    churn_per_hour: float = 0.2
    params: float = 8e9
    dtype_bytes: int = 2
    delta_ratio: float = 103.5  # dense/delta bytes, bench_delta at lr 1e-6, 1x1 updates (docs/benchmarks.md)
    chunk_bytes: int = 64 * 1024  # publish.delta_chunk_size
    learner_uplink_mbps: float = 1000.0
    relay_mbps: float = 32.0
    seeds: int = 2  # publish.seeds
    rollouts_per_step: int = 512
    t_train_s: float = 30.0
    l_gen_s: float = 10.0
    staleness: int = DEFAULT_STALENESS
    publish_every: int = DEFAULT_PUBLISH_EVERY
    gamma: float = DEFAULT_GAMMA
    source_wait_s: float = 10.0  # fetch.source_wait_s
    plan_min_uplink_mbps: float = 0.0  # a what-if: only such peers in the plan, the rest leaves (0: as built)
    plan_shape: str | None = None  # make_plan's shape; None: the design's (today: chains, as before trees; shards: auto)
    seed: int = 0

    @property
    def shape(self) -> str:
        return self.plan_shape or ("chains" if self.design == "today" else "auto")

    @property
    def version_bytes(self) -> float:
        return self.params * self.dtype_bytes / self.delta_ratio


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] if ordered else math.nan


def simulate(s: Scenario) -> dict[str, Any]:
    """The figures `echo2swarm simulate --json` prints for one N."""
    started = time.monotonic()
    peers = draw_peers(s.peers, s.nat_share, s.holepunch_share, s.params, s.seed)
    t_bcast = 0.0
    arrival: dict[str, float] = {}
    active: list[Worker] = []
    late: list[Worker] = []
    for _ in range(3):  # the floor depends on T_bcast, and lateness on arrivals, which the spread gives
        inputs = CapacityInputs(rollouts_per_step=s.rollouts_per_step, t_train=s.t_train_s, t_bcast=t_bcast,
                                staleness=s.staleness, publish_every=s.publish_every, gamma=s.gamma, l_gen=s.l_gen_s)
        workers = [Worker(p.peer_id, mu=p.mu, price=p.price, arrival_s=arrival.get(p.peer_id)) for p in peers]
        pool, late = timely(workers, inputs.floor(), inputs.arrival_budget())  # as LearnerActivation.replan
        active = choose_active(pool, inputs.floor()) or pool  # out of reach: every peer works
        version = spread(peers, s.version_bytes, s.chunk_bytes, s.learner_uplink_mbps * MBIT, s.seeds,
                         s.relay_mbps * MBIT, s.source_wait_s, s.churn_per_hour, s.seed,
                         s.plan_min_uplink_mbps * MBIT, s.shape, proven={w.peer_id for w in active})
        arrival = version.arrival
        on_active = [arrival[w.peer_id] for w in active]
        t_bcast = _quantile(on_active, 0.99)
    inputs = CapacityInputs(rollouts_per_step=s.rollouts_per_step, t_train=s.t_train_s, t_bcast=t_bcast,
                            staleness=s.staleness, publish_every=s.publish_every, gamma=s.gamma, l_gen=s.l_gen_s)
    total_mu = sum(w.mu for w in active)
    step_s = inputs.step_time(total_mu)
    traffic = control_traffic(s.design, [p.peer_id for p in peers], {w.peer_id for w in active},
                              version.plan, version.arrival, step_s * s.publish_every,
                              record_sizes(len(active)), s.seed)
    return {
        "peers": s.peers, "design": s.design, "plan_min_uplink_mbps": s.plan_min_uplink_mbps,
        "plan": "trees" if version.plan is not None and version.plan.tree is not None else "chains",
        "fanout": version.plan.tree.fanout if version.plan is not None and version.plan.tree is not None else 1,
        "t50_s": round(_quantile(on_active, 0.5), 2), "t90_s": round(_quantile(on_active, 0.9), 2),
        "t99_s": round(t_bcast, 2), "t99_all_s": round(_quantile(list(version.arrival.values()), 0.99), 2),
        "learner_copies": round(version.learner_bytes / s.version_bytes, 3),
        "busy": round(1 - inputs.bubble_ratio(total_mu), 4), "step_s": round(step_s, 2),
        "usd_per_step": round(sum(w.price for w in active) * step_s / 3600, 4),
        "active": len(active), "late": len(late), "planned": version.planned, "stripes": version.stripes,
        "chain_length": version.chain_length, "version_bytes": round(s.version_bytes),
        **traffic.summary(), "wall_s": round(time.monotonic() - started, 1),
    }


__all__ = ["Scenario", "simulate"]
