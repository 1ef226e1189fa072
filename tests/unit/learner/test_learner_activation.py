"""The learner's activation loop on fake cards: measure, plan, gate, report."""

from __future__ import annotations

from dataclasses import dataclass, field

from echo2swarm.config.rl import ActivationConfig, TrainConfig
from echo2swarm.learner.activation_loop import Activity, LearnerActivation


@dataclass
class Card:
    peer_id: str
    price: float
    rollouts_per_s: float | None
    role: str = "rollout"
    state: str = "ready"
    arrivals: list = field(default_factory=list)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _loop(clock: Clock | None = None, **activation) -> LearnerActivation:
    train = TrainConfig(prompts_per_step=8, group_size=4)  # R = 32
    return LearnerActivation(ActivationConfig(min_steps=2, **activation), train, clock=clock or Clock())


def _delivered(act: LearnerActivation, cards: list[Card], verified: int = 4) -> None:
    """Each peer delivered what its card claims and `verified` of its groups passed verification:
    only delivered, verified work counts in the plan."""
    for card in cards:
        act.on_delivery(card.peer_id, int(card.rollouts_per_s or 0), 1.0)
        act.on_verified([card.peer_id] * verified)


def test_everyone_works_until_t_train_is_measured():
    act = _loop()
    cards = [Card("a", 0.2, 40), Card("b", 0.3, 40), Card("c", 0.9, 40)]
    _delivered(act, cards)
    act.replan(cards, {"a", "b", "c"})
    assert all(act.gate(p) is None for p in "abc") and act.active_count() == 3
    act.on_step(0.5)
    act.replan(cards, {"a", "b", "c"})
    assert act.gate("c") is None  # one step measured, min_steps is 2


def test_plan_keeps_the_cheapest_peers_meeting_the_floor_and_standby_the_rest():
    act = _loop()
    cards = [Card("a", 0.2, 40), Card("b", 0.3, 40), Card("c", 0.9, 40)]
    for _ in range(3):
        act.on_step(0.5)  # floor = 1.1 * 32 / 0.5 = 70.4
    _delivered(act, cards)
    act.replan(cards, {"a", "b", "c"})
    assert act.gate("a") is None and act.gate("b") is None
    assert "floor" in act.gate("c")
    assert act.step_metrics(1.0)["active_peers"] == 2
    assert act.step_metrics(3600.0)["cost_usd"] == 0.5
    snap = act.snapshot()
    assert snap["active"] == ["a", "b"] and snap["plan"]["standby"] == ["c"] and snap["t_train"] == 0.5
    # An active peer's card lapses (it died): the standby one is activated at the next re-plan.
    act.replan([c for c in cards if c.peer_id != "a"], {"a", "b", "c"})
    assert act.gate("c") is None and act.snapshot()["active"] == ["b", "c"]
    assert act.log[-1]["activated"] == ["c"] and act.log[-1]["deactivated"] == ["a"]


def test_only_peers_that_asked_for_work_are_planned_and_delivered_mu_wins():
    act = _loop()
    for _ in range(2):
        act.on_step(0.5)
    cards = [Card("a", 0.2, 40), Card("b", 0.3, 40), Card("other", 0.0, 400), Card("new", 0.1, None)]
    act.on_delivery("a", 32, 1.0)  # a really delivers 32/s, less than its card says
    act.on_delivery("b", 40, 1.0)
    act.on_verified(["a", "b"] * 4)
    act.replan(cards, {"a", "b", "new"})
    assert "other" not in act.workers and "new" not in act.workers  # never asked us / delivered nothing yet
    assert act.workers["a"].mu == 32
    assert act.gate("a") is None and act.gate("b") is None  # 72 >= 70.4
    assert act.gate("new") is None  # on probation: may take work, to earn a measured rate


def test_a_claimed_rate_puts_nobody_on_standby_until_it_is_delivered():
    # A free card claiming a huge rate, which takes leases and never delivers: it is never planned, so
    # the peers that deliver stay active; once it has lapsed, its measured rate is zero.
    act = _loop()
    for _ in range(3):
        act.on_step(0.5)  # floor 70.4
    honest = [Card("a", 0.2, 40), Card("b", 0.3, 40)]
    _delivered(act, honest)
    liar = Card("liar", 0.0, 1e6)
    act.replan([*honest, liar], {"a", "b", "liar"})
    assert act.snapshot()["active"] == ["a", "b"] and act.gate("a") is None and act.gate("b") is None
    act.on_lapse("liar")
    act.replan([*honest, liar], {"a", "b", "liar"})
    assert "liar" not in act.workers and act.snapshot()["active"] == ["a", "b"]


def test_out_of_reach_floor_makes_everyone_active_and_disabled_plans_nothing():
    act = _loop()
    for _ in range(2):
        act.on_step(0.1)  # floor 352: out of reach
    _delivered(act, [Card("a", 0.2, 40), Card("b", 0.3, 40)])
    act.replan([Card("a", 0.2, 40), Card("b", 0.3, 40)], {"a", "b"})
    assert act.gate("a") is None and act.gate("b") is None and not act.snapshot()["plan"]["feasible"]
    assert act.snapshot()["plan"]["fixes"]
    off = _loop(enabled=False)
    for _ in range(2):
        off.on_step(0.5)
    off.replan([Card("a", 0.2, 40), Card("b", 0.3, 40), Card("c", 0.9, 40)], {"a", "b", "c"})
    assert all(off.gate(p) is None for p in "abc")


def test_configured_t_bcast_overrides_the_measurement():
    act = LearnerActivation(ActivationConfig(t_bcast_s=0.7), TrainConfig(), t_bcast=lambda: 0.2)
    assert act.t_bcast() == 0.7
    assert LearnerActivation(ActivationConfig(), TrainConfig(), t_bcast=lambda: 0.2).t_bcast() == 0.2
    assert LearnerActivation(ActivationConfig(), TrainConfig()).t_bcast() == 0.0


def test_inflight_target_from_measured_latency_and_step_time():
    act = _loop()  # R = 8 prompts per step
    assert act.inflight_target(8, 1.5) is None
    act.on_step(0.5)
    assert act.inflight_target(8, 1.5) is None  # no lease delivered yet
    act.on_delivery("a", 32, 1.0, latency=3.0)  # worked 1 s; waited 2 s behind its other leases
    # 8 for the next step + 1.5 x 8 groups/step x (1.0 s of work / 0.5 s per step) = 8 + 24
    assert act.inflight_target(8, 1.5) == 32
    assert act.inflight_target(8, 1.0) == 24


def test_a_burst_of_unverified_or_little_work_displaces_nobody():
    """Five fresh keys at price 0 each deliver one fast group: not enough verified work to be planned,
    so the peers that deliver stay active."""
    act = _loop(plan_after_groups=4)
    for _ in range(3):
        act.on_step(0.5)  # floor 70.4
    honest = [Card("a", 0.2, 40), Card("b", 0.3, 40)]
    _delivered(act, honest)
    rogues = [Card(f"rogue{i}", 0.0, 1e6) for i in range(5)]
    for rogue in rogues:
        act.on_delivery(rogue.peer_id, 8, 0.025)  # 320 rollouts/s for one group
        act.on_verified([rogue.peer_id])
    seen = {c.peer_id for c in [*honest, *rogues]}
    act.replan([*honest, *rogues], seen)
    assert act.snapshot()["active"] == ["a", "b"] and all(act.gate(c.peer_id) is None for c in honest)


def test_a_planned_peer_that_goes_quiet_is_replaced_at_the_next_replan_and_must_earn_its_place_again():
    clock = Clock()
    act = _loop(clock, quiet_after_s=5.0)
    for _ in range(3):
        act.on_step(0.5)  # floor 70.4
    cards = [Card("fast", 0.0, 100), Card("a", 0.2, 40), Card("b", 0.3, 40)]
    _delivered(act, cards)
    busy = {c.peer_id: Activity(last_request=clock.now, oldest_open=None) for c in cards}
    act.replan(cards, set(busy), busy)
    assert act.snapshot()["active"] == ["fast"] and act.gate("a") and act.gate("b")  # a, b on standby
    clock.now += 4.0  # "fast" went silent; a and b keep asking (standby retries)
    asking = {**busy, "a": Activity(clock.now, None), "b": Activity(clock.now, None)}
    act.replan(cards, set(asking), asking)
    assert act.snapshot()["active"] == ["fast"]  # 4 s: not quiet yet
    clock.now += 2.0
    asking = {**busy, "a": Activity(clock.now, None), "b": Activity(clock.now, None)}
    act.replan(cards, set(asking), asking)
    assert act.snapshot()["active"] == ["a", "b"] and act.gate("a") is None and act.gate("fast") is None
    assert act.quiet_events == 1 and "fast" not in act.workers
    # Back again with one fast delivery: not planned until it has delivered enough verified work.
    act.on_delivery("fast", 100, 1.0)
    act.on_verified(["fast"] * 3)
    asking = {p: Activity(clock.now, None) for p in ("fast", "a", "b")}
    act.replan(cards, set(asking), asking)
    assert act.snapshot()["active"] == ["a", "b"]


def test_a_planned_peer_sitting_on_a_lease_is_quiet_but_a_slow_one_within_its_lease_time_is_not():
    clock = Clock()
    act = _loop(clock, quiet_after_s=5.0)
    for _ in range(3):
        act.on_step(0.5)
    act.on_delivery("slow", 80, 8.0)  # 10 rollouts/s, 8 s a lease
    act.on_delivery("hoarder", 80, 1.0)
    act.on_verified(["slow", "hoarder"] * 4)
    cards = [Card("slow", 0.1, 10), Card("hoarder", 0.1, 80)]
    issued = clock.now
    clock.now += 20.0  # both hold a lease issued 20 s ago and asked for more since
    activity = {"slow": Activity(clock.now, issued), "hoarder": Activity(clock.now, issued)}
    act.planned, act.controller.active = True, {"slow", "hoarder"}
    act.replan(cards, set(activity), activity)
    assert "hoarder" not in act.workers and act.quiet_events == 1  # 20 s > max(5, 3 x 1 s)
    assert "slow" in act.workers  # 20 s < 3 x its 8 s lease time


def test_nobody_is_judged_quiet_while_the_learner_hears_from_no_peer_at_all():
    """A learner whose own loop or network stalled hears from nobody: the plan stays as it was, and the
    peer that alone stays silent once the others are heard again is dropped."""
    clock = Clock()
    act = _loop(clock, quiet_after_s=5.0)
    for _ in range(3):
        act.on_step(0.5)
    cards = [Card("fast", 0.0, 100), Card("a", 0.2, 40), Card("b", 0.3, 40)]
    _delivered(act, cards)
    heard = {c.peer_id: Activity(last_request=clock.now, oldest_open=None) for c in cards}
    act.replan(cards, set(heard), heard)
    assert act.snapshot()["active"] == ["fast"]
    clock.now += 30.0  # nothing from anyone for 30 s
    act.replan(cards, set(heard), heard)
    assert act.snapshot()["active"] == ["fast"] and act.quiet_events == 0
    asking = {**heard, "a": Activity(clock.now, None), "b": Activity(clock.now, None)}  # a and b are back
    act.replan(cards, set(asking), asking)
    assert act.quiet_events == 1 and "fast" not in act.workers


@dataclass
class Arrival:
    version: int
    seconds: float


def test_peers_whose_versions_arrive_after_the_staleness_budget_are_planned_only_when_needed():
    from echo2swarm.learner.activation_loop import typical_arrival

    act = _loop()
    slow = [Arrival(v, s) for v, s in ((1, 30.0), (2, 31.0), (3, 90.0), (4, 29.0), (5, 33.0))]  # v3: a keyframe
    cards = [Card("a", 0.2, 40, arrivals=slow), Card("b", 0.3, 40, arrivals=slow[:2]),
             Card("c", 0.9, 40, arrivals=[Arrival(5, 2.0)]), Card("d", 1.0, 40)]  # d: no arrival known yet
    assert typical_arrival(cards[0]) == 31.0 and typical_arrival(cards[3]) is None
    for _ in range(3):
        act.on_step(20.0)  # T_train 20 s, S = 1, kappa = 1: floor 1.1 * 32 / 20 = 1.76 rollouts/s
    _delivered(act, cards)  # L_gen 1 s: a version may take 20 - 1 = 19 s to arrive
    act.replan(cards, set("abcd"))
    plan = act.snapshot()["plan"]
    assert plan["arrival_budget_s"] == 19.0 and plan["late"] == ["a", "b"]
    assert plan["active"] == ["c"] and act.gate("a") and act.gate("b")  # the cheapest timely peer
    # When the timely peers cannot meet the floor, a late peer is better than none.
    act.replan(cards[:2], set("ab"))
    assert act.snapshot()["plan"]["late"] == [] and act.snapshot()["plan"]["active"] == ["a"]
