"""One plan: the active set for given learner numbers and peers, what it costs, or why none works.

`make_plan` is what `echo2swarm plan` prints and what the learner's closed loop starts from.

>>> from echo2swarm.control.capacity import CapacityInputs
>>> report = make_plan(CapacityInputs(rollouts_per_step=64, t_train=1.0), [Worker("a", 40, 0.4), Worker("b", 40, 0.5)])
>>> report.feasible, report.active
(True, ['a', 'b'])
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from echo2swarm.control.activation import Worker, choose_active, total_mu, total_price
from echo2swarm.control.capacity import CapacityInputs, diagnose


@dataclass
class PlanReport:
    feasible: bool
    regime: str
    floor: float                 # Σµ needed, rollouts/s (with gamma)
    bare_floor: float            # at gamma = 1
    sequential_mu_min: float     # ECHO-2's κR / (κ·T_train − T_bcast), for reference
    freshness_ok: bool
    active: list[str]
    standby: list[str]
    active_mu: float
    available_mu: float
    price_per_hour: float        # Σ price of the active set, USD/h
    step_s: float                # predicted seconds per learner step
    bubble_ratio: float          # predicted
    cost_per_step: float         # USD per learner step
    problems: list[str] = field(default_factory=list)
    fixes: list[str] = field(default_factory=list)
    needed: dict[str, float] = field(default_factory=dict)
    inputs: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key, value in out.items():  # JSON has no infinity
            if isinstance(value, float) and not math.isfinite(value):
                out[key] = None
        return out


def make_plan(inputs: CapacityInputs, workers: list[Worker]) -> PlanReport:
    ids = [w.peer_id for w in workers]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise ValueError(f"peer ids must be unique; repeated: {', '.join(dup[:5])}")
    available = total_mu(workers)
    diagnosis = diagnose(inputs, available)
    chosen = choose_active(workers, inputs.floor()) if math.isfinite(inputs.floor()) else None
    if chosen is None:  # best effort: everything helps
        chosen = [w for w in workers if w.mu > 0]
    active_ids = {w.peer_id for w in chosen}
    mu = total_mu(chosen)
    step = inputs.step_time(mu)
    price = total_price(chosen)
    return PlanReport(
        feasible=diagnosis.feasible,
        regime=inputs.regime,
        floor=inputs.floor(),
        bare_floor=inputs.bare_floor(),
        sequential_mu_min=inputs.sequential_mu_min(),
        freshness_ok=inputs.freshness_ok(),
        active=[w.peer_id for w in chosen],
        standby=[w.peer_id for w in workers if w.peer_id not in active_ids],
        active_mu=mu,
        available_mu=available,
        price_per_hour=price,
        step_s=step,
        bubble_ratio=inputs.bubble_ratio(mu),
        cost_per_step=price * step / 3600.0 if math.isfinite(step) else math.inf,
        problems=diagnosis.problems,
        fixes=diagnosis.fixes,
        needed=diagnosis.needed,
        inputs=asdict(inputs),
    )
