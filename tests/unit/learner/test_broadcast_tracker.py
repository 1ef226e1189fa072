"""T_bcast ignores planned receivers that never report: pure logic, a fake clock, no network."""

from __future__ import annotations

from echo2swarm.learner.broadcast_tracker import (
    KEEP_PLANS,
    REPORT_WAIT_FACTOR,
    REPORT_WAIT_MAX_S,
    REPORT_WAIT_S,
    BroadcastTracker,
)
from echo2swarm.wire.records import PeerCard
from echo2swarm.wire.signing import PolicyKey

LEARNER = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
HONEST = "12D3KooWAaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
SLOW = "12D3KooWBbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"
SILENT = "12D3KooWCccccccccccccccccccccccccccccccccccccccccccc"


class FakeOverlay:  # what plan() reads: the swarm name, our peer id, the peers seen working
    class config:
        swarm = "s"

    peer_id = LEARNER

    def worked(self) -> set[str]:
        return {HONEST, SLOW}


class Clock:
    def __init__(self) -> None:
        self.now = 500.0

    def __call__(self) -> float:
        return self.now


def card(peer: str, arrivals: dict[int, float], fetching: int | None = None, role: str = "rollout",
         upload_bps: int | None = None) -> PeerCard:
    return PeerCard(peer_id=peer, role=role, price=0.0, state="ready", software="0", updated_ms=1, fetching=fetching,
                    arrivals=[{"version": v, "seconds": t} for v, t in arrivals.items()], upload_bps=upload_bps)


def tracker() -> tuple[BroadcastTracker, Clock]:
    clock = Clock()
    t = BroadcastTracker(FakeOverlay(), PolicyKey.generate(), seeds=2, refresh_s=1.0, ewma_alpha=0.3, clock=clock)  # type: ignore[arg-type]
    t.observe([card(HONEST, {}), card(SLOW, {}), card(SILENT, {}, role="relay")])
    return t, clock


def test_a_receiver_that_never_reports_is_left_out_once_the_bound_has_passed():
    t, clock = tracker()
    t.plan(5)
    clock.now += 2.0
    t.observe([card(HONEST, {5: 1.5}), card(SLOW, {}), card(SILENT, {}, role="relay")])
    clock.now += 2.0
    t.observe([card(HONEST, {5: 1.5}), card(SLOW, {5: 3.0}), card(SILENT, {}, role="relay")])
    assert t.t_bcast_s is None  # within the bound: still waiting for SILENT
    clock.now = 500.0 + REPORT_WAIT_S - 1
    t.observe([card(HONEST, {5: 1.5}), card(SLOW, {5: 3.0}), card(SILENT, {}, role="relay")])
    assert t.t_bcast_s is None
    clock.now = 500.0 + REPORT_WAIT_S + 1
    t.observe([card(HONEST, {5: 1.5}), card(SLOW, {5: 3.0}), card(SILENT, {}, role="relay")])
    assert t.t_bcast == {5: 3.0} and t.t_bcast_s == 3.0  # measured over those that reported
    assert t.unreported == {5: 1} and t.unreported_total == 1
    # Settled: a late report changes nothing, and nothing is counted twice.
    t.observe([card(HONEST, {5: 1.5}), card(SLOW, {5: 3.0}), card(SILENT, {5: 99.0}, role="relay")])
    assert t.t_bcast == {5: 3.0} and t.unreported_total == 1


def test_the_bound_grows_with_the_slowest_report_so_slow_honest_peers_are_still_waited_for():
    t, clock = tracker()
    t.plan(7)
    clock.now += 100.0
    t.observe([card(HONEST, {7: 40.0}), card(SLOW, {}), card(SILENT, {}, role="relay")])
    assert t.t_bcast_s is None  # 100 s < 3 x 40 s
    clock.now = 500.0 + REPORT_WAIT_FACTOR * 40.0 + 1
    t.observe([card(HONEST, {7: 40.0}), card(SLOW, {}), card(SILENT, {}, role="relay")])
    assert t.t_bcast == {7: 40.0} and t.unreported == {7: 2}


def test_a_receiver_still_fetching_is_waited_for_up_to_the_longest_bound():
    t, clock = tracker()
    t.plan(3)
    clock.now += REPORT_WAIT_S + 5
    t.observe([card(HONEST, {3: 1.0}), card(SLOW, {}, fetching=3), card(SILENT, {}, role="relay")])
    assert t.t_bcast_s is None  # SLOW says it is on its way
    clock.now += 10
    t.observe([card(HONEST, {3: 1.0}), card(SLOW, {4: 12.0}), card(SILENT, {}, role="relay")])
    assert t.t_bcast == {3: 12.0} and t.unreported == {3: 1}  # SLOW skipped to v4: counted with it

    t.plan(9)
    clock.now += REPORT_WAIT_MAX_S + 1  # a card that claims a fetch forever is not waited for forever
    t.observe([card(HONEST, {9: 1.0}), card(SLOW, {}, fetching=9), card(SILENT, {}, role="relay")])
    assert t.t_bcast[9] == 1.0 and t.unreported[9] == 2


def test_nobody_reporting_is_no_measurement_and_a_version_leaving_the_window_is_settled():
    t, clock = tracker()
    t.plan(1)
    clock.now += REPORT_WAIT_S + 1
    t.observe([card(HONEST, {}), card(SLOW, {}), card(SILENT, {}, role="relay")])
    assert t.t_bcast_s is None and not t.unreported  # no report at all yet: keep waiting
    t.observe([card(HONEST, {1: 2.0}), card(SLOW, {}, fetching=1), card(SILENT, {}, role="relay")])
    for v in range(2, 2 + KEEP_PLANS):  # v1 leaves the window of kept plans: settled with what it has
        t.plan(v)
    assert t.t_bcast[1] == 2.0 and t.unreported[1] == 2 and t.t_bcast_s == 2.0


def test_every_receiver_reporting_completes_at_once_as_before():
    t, clock = tracker()
    t.plan(2)
    clock.now += 1
    t.observe([card(HONEST, {2: 1.0}), card(SLOW, {2: 2.5}), card(SILENT, {3: 0.5}, role="relay")])
    assert t.t_bcast == {2: 2.5} and not t.unreported and t.unreported_total == 0


def test_a_banned_peer_is_never_planned_as_a_receiver_or_a_parent() -> None:
    banned: set[str] = set()
    tracker = BroadcastTracker(FakeOverlay(), PolicyKey.generate(), seeds=1, refresh_s=1.0, ewma_alpha=0.3, clock=Clock(),
                               excluded=lambda: banned)
    tracker.observe([card(HONEST, {}), card(SLOW, {})])
    assert {peer for peer, _ in tracker.receivers()} == {HONEST, SLOW}
    banned.add(SLOW)
    assert {peer for peer, _ in tracker.receivers()} == {HONEST}
    tracker.plan(7)
    assert tracker._receivers[7] == {HONEST}


def test_plans_order_peers_by_measured_uplink_within_their_caps() -> None:
    from echo2swarm.learner.broadcast_tracker import planned_upload

    def up(cap: int | None, measured: int | None) -> PeerCard:
        return card(HONEST, {}).model_copy(update={"upload_bps": cap, "uplink_bps": measured})

    assert planned_upload(up(None, None)) is None              # unmeasured, uncapped: planned as fastest
    assert planned_upload(up(8_000_000, None)) == 8_000_000    # unmeasured: its cap
    assert planned_upload(up(None, 2_500_000)) == 2_500_000    # an uncapped home line measured at 20 Mbit/s
    assert planned_upload(up(1_000_000, 2_500_000)) == 1_000_000  # never above the cap it set

    tracker = BroadcastTracker(FakeOverlay(), PolicyKey.generate(), seeds=1, refresh_s=1.0, ewma_alpha=0.3, clock=Clock())  # type: ignore[arg-type]
    # Neither capped; the card that says HONEST's uplink carried 4x SLOW's puts HONEST first in the chain.
    tracker.observe([card(SLOW, {}).model_copy(update={"uplink_bps": 1_000_000}),
                     card(HONEST, {}).model_copy(update={"uplink_bps": 4_000_000})])
    assert dict(tracker.receivers()) == {HONEST: 4_000_000, SLOW: 1_000_000}
    plan = tracker.plan(3)
    assert plan is not None
    import json

    chains = json.loads(plan)
    assert HONEST in json.dumps(chains)


def test_only_delivered_groups_make_a_peer_proven_and_the_rest_plan_after_it_whatever_they_claim() -> None:
    """A fresh key claiming an uncapped uplink (or merely answered when it asked for work) never heads a
    chain ahead of a peer that delivered; the tracker tells the overlay who delivered, and its roster says so."""
    import asyncio
    import json

    from echo2swarm.overlay.roster import ASKED, WorkLog

    class Overlay(FakeOverlay):
        def __init__(self) -> None:
            self.work = WorkLog(capacity=64, horizon_s=90.0)
            self.stored: list[set[str]] = []

        def worked(self) -> set[str]:
            return set(self.work.worked())

        def saw_work(self, peer: str, kind: str) -> None:
            self.work.saw(peer, kind)

        async def store_roster(self, exclude: set[str]) -> object:
            self.stored.append(exclude)
            return type("Roster", (), {"peers": self.work.entries(exclude)})()

    overlay = Overlay()
    delivered = {HONEST: 0}
    tracker = BroadcastTracker(overlay, PolicyKey.generate(), seeds=2, refresh_s=1.0, ewma_alpha=0.3, clock=Clock(),  # type: ignore[arg-type]
                               excluded=lambda: {SILENT}, delivered=lambda: delivered)
    rogue = card(SLOW, {}).model_copy(update={"uplink_bps": None, "upload_bps": None})  # claims uncapped
    tracker.observe([rogue, card(HONEST, {}).model_copy(update={"uplink_bps": 1_000_000})])
    overlay.work.saw(SLOW, ASKED)
    tracker.note_deliveries()
    assert overlay.worked() == set()  # nobody delivered yet: the claims order the plan
    assert json.loads(tracker.plan(1))["stripes"][0][0] == SLOW
    delivered[HONEST] = 3
    tracker.note_deliveries()
    assert overlay.worked() == {HONEST}
    stripes = json.loads(tracker.plan(2))["stripes"]
    assert stripes == [[HONEST, SLOW]]  # (two peers: one stripe, so the tail heads none)
    asyncio.run(tracker.publish_roster())
    assert overlay.stored == [{SILENT}]  # the banned are left off the roster


def test_a_planned_peer_that_never_reported_a_version_forwards_nothing_in_the_next_plans():
    from echo2swarm.learner.broadcast_tracker import DEMOTE_VERSIONS
    from echo2swarm.policy.broadcast_plan import BroadcastPlan

    clock = Clock()
    t = BroadcastTracker(FakeOverlay(), PolicyKey.generate(), seeds=2, refresh_s=1.0, ewma_alpha=0.3, clock=clock,
                         shape="trees")  # type: ignore[arg-type]

    def cards(v: int | None) -> list[PeerCard]:
        done = {v: 1.0} if v is not None else {}
        return [card(HONEST, done, upload_bps=10**7), card(SLOW, done, upload_bps=10**7),
                card(SILENT, done if v != 5 else {}, role="relay", upload_bps=10**9)]  # the fastest claim

    def forwards(version: int) -> set[str]:
        plan = BroadcastPlan.model_validate_json(t.plan(version))
        return {up for rows in plan.edges() for _, up in rows if up is not None}

    t.observe(cards(None))
    assert SILENT in forwards(5)  # a quarter of its claim still beats the others' uplinks
    clock.now = 500.0 + REPORT_WAIT_S + 1
    t.observe(cards(5))  # it never reported v5
    assert t.demoted() == {SILENT} and t.unreported == {5: 1}
    for v in range(6, 6 + DEMOTE_VERSIONS):  # planned without an uplink until v5 leaves the window
        assert SILENT not in forwards(v)
        clock.now += 1.0
        t.observe(cards(v))
    assert t.demoted() == set() and SILENT in forwards(99)
