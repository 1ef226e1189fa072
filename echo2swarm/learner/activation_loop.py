"""The learner's closed loop over rollout capacity: measure, plan, gate leases.

    every step ─► T_train (EWMA of learner busy time)        ┐
    every submit ─► delivered µ per peer, L_gen (EWMAs)       ├─► every replan_period_s:
    broadcast tracker ─► T_bcast (or activation.t_bcast_s)    │   live rollout cards (µ, price) ─► floor
    peer cards ─► membership, self-measured µ, price          ┘   ─► ActivationController (hysteresis)
                                                                  ─► active set; the rest get LeaseWait(standby)

Until `min_steps` steps have measured T_train, or while no plan meets the floor, every peer is
active: an idle learner costs more than an extra peer. Only peers that asked this learner for
work are planned, so peers of another learner in the same swarm never count.

Trust is earned by sustained, verified delivery, never by a claim or a burst: a peer is planned
only once `plan_after_groups` of its groups passed the trainer's verification, and a planned peer
that goes quiet (no delivery and no request, or a lease held past its own lease time, for
`quiet_after_s` or three times its lease time) loses its measured rate and that count, so it is
replaced at the next re-plan and must deliver again before it can displace anyone.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from echo2swarm.config.rl import ActivationConfig, TrainConfig
from echo2swarm.control.activation import ActivationController, Worker, timely
from echo2swarm.control.capacity import CapacityInputs, diagnose
from echo2swarm.control.telemetry import Ewma
from echo2swarm.runtime.logging import get_logger

logger = get_logger(__name__)
QUIET_LEASE_TIMES = 3.0  # a planned peer silent for this many of its own lease times is quiet
MAX_MEASURED_PEERS = 10_000  # peers with a measured rate kept at most (the least recent delivery goes first)


@dataclass(frozen=True)
class Activity:
    """What the intake saw a peer do lately (clock of `time.monotonic`)."""

    last_request: float  # its last lease request
    oldest_open: float | None  # when its oldest open lease was issued; None: it holds none



ARRIVALS_TYPICAL = 5  # a peer's newest version arrivals whose median is its typical arrival


def typical_arrival(card: Any) -> float | None:
    """The median seconds of the newest ARRIVALS_TYPICAL versions' arrivals its card reports (None: none
    yet): a keyframe among them, larger than the deltas around it, does not make a peer late."""
    seconds = sorted(a.seconds for a in sorted(card.arrivals, key=lambda a: a.version)[-ARRIVALS_TYPICAL:])
    return seconds[len(seconds) // 2] if seconds else None

class LearnerActivation:
    """>>> act = LearnerActivation(ActivationConfig(), TrainConfig()); act.gate("12D3...") is None   # no plan yet: all active"""

    def __init__(self, config: ActivationConfig, train: TrainConfig, t_bcast: Callable[[], float | None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.train = train
        self.clock = clock
        self._t_bcast_source = t_bcast
        self.t_train = Ewma(config.ewma_alpha)
        self.l_gen = Ewma(config.ewma_alpha)
        self.l_work = Ewma(config.ewma_alpha)  # seconds a peer worked on one lease (no queueing)
        self.delivered: dict[str, Ewma] = {}
        self.work_s: dict[str, Ewma] = {}  # per peer: seconds it works on one lease
        self.last_delivery: dict[str, float] = {}
        self.verified: Counter[str] = Counter()  # verified groups per peer (since it last went quiet)
        self.quiet_events = 0  # planned peers dropped for going quiet
        self.controller = ActivationController(config.hysteresis)
        self.planned = False  # a plan is in force (else every peer may work)
        self.workers: dict[str, Worker] = {}  # last census of planned peers
        self.log: list[dict[str, Any]] = []
        self.last_plan: dict[str, Any] = {}
        self._task: asyncio.Task[None] | None = None

    @property
    def standby_retry_s(self) -> float:
        return self.config.standby_retry_s

    # -- measurements --------------------------------------------------------------------------
    @property
    def rollouts_per_step(self) -> int:
        return self.train.prompts_per_step * self.train.group_size

    def t_bcast(self) -> float:
        if self.config.t_bcast_s is not None:
            return self.config.t_bcast_s
        measured = self._t_bcast_source()
        return float(measured) if measured is not None else 0.0

    def on_step(self, busy_s: float) -> None:
        self.t_train.add(busy_s)

    def on_delivery(self, peer: str, rollouts: int, seconds: float, latency: float | None = None) -> None:
        """`rollouts` took the peer `seconds` of work; `latency` (default: `seconds`) from lease issue to delivery."""
        if rollouts <= 0 or seconds <= 0:
            return
        if peer not in self.delivered and len(self.delivered) >= MAX_MEASURED_PEERS:
            self._forget(min(self.last_delivery, key=self.last_delivery.__getitem__))
        self.delivered.setdefault(peer, Ewma(self.config.ewma_alpha)).add(rollouts / seconds)
        self.work_s.setdefault(peer, Ewma(self.config.ewma_alpha)).add(seconds)
        self.last_delivery[peer] = self.clock()
        self.l_gen.add(seconds if latency is None else latency)
        self.l_work.add(seconds)

    def on_verified(self, peers: Iterable[str]) -> None:
        """One entry per group that passed the trainer's verification, naming its peer."""
        self.verified.update(p for p in peers if p in self.delivered)  # only peers with a measured rate

    def _quiet(self, peer: str, activity: Activity | None, now: float) -> bool:
        """A planned peer that neither delivers nor asks for work (or sits on a lease) is quiet."""
        if activity is None:
            return False
        work = self.work_s.get(peer)
        limit = max(self.config.quiet_after_s, QUIET_LEASE_TIMES * (work.value or 0.0 if work else 0.0))
        delivered = self.last_delivery.get(peer, -math.inf)
        if activity.oldest_open is not None:  # it holds work: only delivering it counts
            return now - max(delivered, activity.oldest_open) > limit
        return now - max(delivered, activity.last_request) > limit

    def _forget(self, peer: str) -> None:
        """Back to unproven: no measured rate, no verified work to plan it by."""
        for table in (self.delivered, self.work_s, self.last_delivery, self.verified):
            table.pop(peer, None)

    def on_lapse(self, peer: str) -> None:
        """A lease of `peer` lapsed undelivered: its delivered rate takes a zero sample. A peer that
        never delivered has no rate to lower (and gets no entry: fresh ids must not grow this)."""
        if peer in self.delivered:
            self.delivered[peer].add(0.0)

    def inflight_target(self, groups_per_step: int, headroom: float) -> int | None:
        """R for the next step plus, with `headroom`, the groups the learner trains while one lease is
        being generated (Little's law: R / T_train groups a second for the seconds a peer works on a
        lease). The work time, not the latency from issue to delivery: that includes the time a lease
        waits behind the peer's others, which grows with what is in flight and would feed back into
        the target until it reached the staleness bound. None until measured."""
        t_train, work = self.t_train.value, self.l_work.value
        if t_train is None or work is None:
            return None
        return groups_per_step + math.ceil(headroom * groups_per_step * work / max(t_train, 1e-3))

    def inputs(self) -> CapacityInputs | None:
        if self.t_train.value is None or self.t_train.samples < self.config.min_steps:
            return None
        return CapacityInputs(
            rollouts_per_step=self.rollouts_per_step, t_train=max(self.t_train.value, 1e-6), t_bcast=self.t_bcast(),
            staleness=self.train.staleness, publish_every=self.train.publish_every, gamma=self.config.gamma,
            l_gen=self.l_gen.value or 0.0,
        )

    # -- gate ----------------------------------------------------------------------------------
    def gate(self, peer: str) -> str | None:
        """None if `peer` may get work now; else why it is on standby."""
        if not self.config.enabled or not self.planned or peer in self.controller.active or peer not in self.workers:
            return None  # peers outside the plan (newcomers on probation) may earn a measured rate
        floor = self.last_plan.get("floor")
        return f"the active set meets the floor ({floor:.3g} rollouts/s) more cheaply" if floor else "not planned yet"

    def active_price(self) -> float:
        """USD per hour of the peers working now (every planned peer before the first plan)."""
        ids = self.controller.active if self.planned else set(self.workers)
        return sum(self.workers[p].price for p in ids if p in self.workers)

    def active_count(self) -> int:
        return len(self.controller.active) if self.planned else len(self.workers)

    # -- loop ----------------------------------------------------------------------------------
    def replan(self, cards: list[Any], seen: Collection[str], activity: Mapping[str, Activity] | None = None) -> None:
        """One re-plan from the live cards; `seen` are the peers that asked this learner for work, and
        `activity` what the intake saw them do (None: no liveness known, nobody is judged quiet)."""
        now = self.clock()
        # A planned peer is quiet when it alone falls silent. When nobody was heard from lately, the learner
        # itself (a starved loop, its network) is the likelier cause, and dropping peers would only undo the plan.
        heard = max((max(a.last_request, self.last_delivery.get(p, -math.inf)) for p, a in (activity or {}).items()),
                    default=-math.inf)
        if self.planned and activity is not None and now - heard <= self.config.quiet_after_s:
            for peer in sorted(self.controller.active):
                if peer in self.delivered and self._quiet(peer, activity.get(peer), now):
                    logger.warning("activation: planned peer %s went quiet; out of the plan until it delivers %d "
                                   "verified groups again", peer[-8:], self.config.plan_after_groups)
                    self._forget(peer)
                    self.quiet_events += 1
        workers = {}
        for card in cards:
            if card.role != "rollout" or card.state == "stopping" or card.peer_id not in seen:
                continue
            # The card's rollouts_per_s is a claim; only what the peer delivered here counts (a lapsed
            # lease as zero), and only once enough of it passed verification. A peer not planned is
            # never gated, so it can earn a rate and never puts peers that deliver on standby.
            ewma = self.delivered.get(card.peer_id)
            mu = ewma.value if ewma is not None else None
            if mu is not None and mu > 0 and self.verified[card.peer_id] >= self.config.plan_after_groups:
                workers[card.peer_id] = Worker(card.peer_id, mu=float(mu), price=card.price,
                                               arrival_s=typical_arrival(card))
        self.workers = workers
        inputs = self.inputs()
        if not self.config.enabled or inputs is None:
            return
        floor = inputs.floor()
        # Peers whose versions arrive after the staleness budget keep the learner waiting: planned last.
        pool, late = timely(list(workers.values()), floor, inputs.arrival_budget())
        decision = self.controller.update(pool, floor)
        active = [workers[p] for p in decision.active]
        total = sum(w.mu for w in active)
        self.planned = decision.feasible
        if not decision.feasible:
            self.controller.active = set(workers)  # everyone works while the floor is out of reach
        d = diagnose(inputs, sum(w.mu for w in workers.values()))
        self.last_plan = {
            "at": round(time.time(), 3), "floor": round(floor, 4), "active_mu": round(total, 4),
            "active": decision.active, "standby": sorted(set(workers) - set(decision.active)),
            "feasible": decision.feasible, "reason": decision.reason, "bubble_predicted": round(inputs.bubble_ratio(total), 4),
            "late": sorted(w.peer_id for w in late), "arrival_budget_s": round(min(inputs.arrival_budget(), 1e9), 3),
            "problems": d.problems, "fixes": d.fixes,
        }
        if decision.activated or decision.deactivated:
            entry = {"at": self.last_plan["at"], "activated": decision.activated, "deactivated": decision.deactivated,
                     "reason": decision.reason}
            self.log = [*self.log[-49:], entry]
            logger.info("activation: +%s -%s (%s); %d active give %.1f rollouts/s for a floor of %.1f",
                        [p[-8:] for p in decision.activated], [p[-8:] for p in decision.deactivated], decision.reason,
                        len(active), total, floor)

    async def run(self, stop: asyncio.Event, get_cards: Callable[[], Any],
                  activity: Callable[[], Mapping[str, Activity]]) -> None:
        while not stop.is_set():
            try:
                cards, _ = await get_cards()
                seen = activity()
                self.replan(cards, seen, seen)
            except Exception:  # a failed DHT read keeps the previous plan
                logger.warning("re-plan failed; keeping the current active set", exc_info=True)
            try:
                await asyncio.wait_for(stop.wait(), self.config.replan_period_s)
            except asyncio.TimeoutError:
                pass

    def ensure_running(self, stop: asyncio.Event, get_cards: Callable[[], Any],
                       activity: Callable[[], Mapping[str, Activity]]) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self.run(stop, get_cards, activity))

    # -- reporting -----------------------------------------------------------------------------
    def step_metrics(self, step_s: float) -> dict[str, Any]:
        return {
            "cost_usd": round(self.active_price() * step_s / 3600.0, 8),
            "active_peers": self.active_count(),
            "active_price_per_h": round(self.active_price(), 4),
            "t_train_s": None if self.t_train.value is None else round(self.t_train.value, 4),
        }

    def snapshot(self) -> dict[str, Any]:
        """What `/v1/info` shows under stats.capacity and `echo2swarm plan --initial-peers` plans from."""
        return {
            "enabled": self.config.enabled,
            "planned": self.planned,
            "rollouts_per_step": self.rollouts_per_step,
            "t_train": None if self.t_train.value is None else round(self.t_train.value, 4),
            "t_bcast": round(self.t_bcast(), 4),
            "l_gen": None if self.l_gen.value is None else round(self.l_gen.value, 4),
            "staleness": self.train.staleness,
            "publish_every": self.train.publish_every,
            "gamma": self.config.gamma,
            "delivered_mu": {p: round(e.value, 3) for p, e in self.delivered.items() if e.value is not None},
            "quiet_events": self.quiet_events,
            "active": sorted(self.controller.active) if self.planned else sorted(self.workers),
            "plan": self.last_plan,
            "log": self.log[-20:],
        }
