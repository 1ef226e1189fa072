"""The learner's activation loop on fake cards: measure, plan, gate, report."""

from __future__ import annotations

from dataclasses import dataclass

from echo2swarm.config.rl import ActivationConfig, TrainConfig
from echo2swarm.learner.activation_loop import LearnerActivation


@dataclass
class Card:
    peer_id: str
    price: float
    rollouts_per_s: float | None
    role: str = "rollout"
    state: str = "ready"


def _loop(**activation) -> LearnerActivation:
    train = TrainConfig(prompts_per_step=8, group_size=4)  # R = 32
    return LearnerActivation(ActivationConfig(min_steps=2, **activation), train)


def _delivered(act: LearnerActivation, cards: list[Card]) -> None:
    """Each peer delivered what its card claims: only delivered work counts in the plan."""
    for card in cards:
        act.on_delivery(card.peer_id, int(card.rollouts_per_s or 0), 1.0)


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
