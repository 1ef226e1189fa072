"""Who a node saw doing work (overlay/roster.py WorkLog): evidence only, bounded, newest first."""

from __future__ import annotations

from collections import defaultdict

import pytest

from echo2swarm.overlay.roster import ASKED, WorkLog
from echo2swarm.wire.peer_keys import PeerKey

ID: defaultdict[str, str] = defaultdict(lambda: PeerKey.generate().peer_id)  # a peer id per name


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_asking_for_work_is_noted_apart_and_never_counts_as_work() -> None:
    clock = Clock()
    log = WorkLog(capacity=8, horizon_s=60.0, clock=clock)
    log.saw(ID["asker"], ASKED)
    clock.t = 1
    log.saw(ID["worker"], "delivered")
    clock.t = 2
    log.saw(ID["both"], ASKED)
    log.saw(ID["both"], "served")
    assert log.worked() == [ID["both"], ID["worker"]]  # newest first
    assert log.asked() == [ID["asker"]]  # a peer with evidence is not listed again as asking
    assert [(e.peer_id, e.work) for e in log.entries()] == [(ID["worker"], ["delivered"]), (ID["both"], ["served"])]
    with pytest.raises(ValueError):
        log.saw("x", "answered")


def test_a_flood_of_askers_evicts_no_worker_and_everything_ages_out() -> None:
    clock = Clock()
    log = WorkLog(capacity=4, horizon_s=30.0, clock=clock)
    log.saw("worker", "delivered")
    for i in range(100):
        log.saw(f"fresh{i}", ASKED)
    assert log.worked() == ["worker"] and log.asked() == [f"fresh{i}" for i in (99, 98, 97, 96)]
    for i in range(6):
        log.saw(f"w{i}", "delivered")
    assert log.worked() == ["w5", "w4", "w3", "w2"]  # the oldest evidence goes first
    clock.t = 31
    assert log.worked() == [] and log.asked() == []


def test_roster_entries_put_deliverers_first_and_leave_out_the_excluded() -> None:
    clock = Clock()
    log = WorkLog(capacity=16, horizon_s=60.0, clock=clock)
    for t, (peer, kind) in enumerate([("relay", "served"), ("old", "delivered"), ("new", "delivered"), ("banned", "delivered")]):
        clock.t = t
        log.saw(ID[peer], kind)
    clock.t = 10
    rows = log.entries(exclude={ID["banned"]}, now_ms=100_000)
    assert [e.peer_id for e in rows] == [ID["new"], ID["old"], ID["relay"]]
    assert rows[0].seen_ms == 100_000 - 8_000  # seen 8 s ago by the log's clock
    log.forget(ID["new"])
    assert ID["new"] not in [e.peer_id for e in log.entries()]
