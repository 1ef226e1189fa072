"""make_plan: the report `echo2swarm plan` prints."""

from __future__ import annotations

import json

import pytest

from echo2swarm.control.activation import Worker
from echo2swarm.control.capacity import CapacityInputs
from echo2swarm.control.planner import make_plan


def test_feasible_plan_reports_active_set_cost_and_bubble():
    inputs = CapacityInputs(rollouts_per_step=64, t_train=1.0, t_bcast=0.2, staleness=1, gamma=1.1)
    pool = [Worker("cheap", 40, 0.2), Worker("mid", 40, 0.5), Worker("dear", 80, 3.0)]
    report = make_plan(inputs, pool)
    assert report.feasible and report.active == ["cheap", "mid"] and report.standby == ["dear"]
    assert report.active_mu == 80 and report.floor == pytest.approx(70.4)
    assert report.bubble_ratio == 0.0 and report.step_s == pytest.approx(1.0)
    assert report.cost_per_step == pytest.approx(0.7 / 3600)
    json.dumps(report.as_dict())


def test_infeasible_plan_uses_everyone_and_says_what_to_change():
    inputs = CapacityInputs(rollouts_per_step=64, t_train=1.0, staleness=1)
    report = make_plan(inputs, [Worker("a", 20, 0.2), Worker("b", 12, 0.3)])
    assert not report.feasible and report.active == ["a", "b"]
    assert report.bubble_ratio == pytest.approx(0.5)
    assert report.needed["missing_mu"] == pytest.approx(70.4 - 32)
    assert any("add peers" in f for f in report.fixes)


def test_sequential_infinite_floor_is_json_safe():
    inputs = CapacityInputs(rollouts_per_step=64, t_train=1.0, t_bcast=3.0, staleness=1, regime="sequential")
    report = make_plan(inputs, [Worker("a", 20, 0.2)])
    out = report.as_dict()
    assert not report.feasible and out["floor"] is None
    json.dumps(out, allow_nan=False)


def test_duplicate_peer_ids_are_refused():
    with pytest.raises(ValueError, match="unique"):
        make_plan(CapacityInputs(rollouts_per_step=1, t_train=1), [Worker("a", 1, 1), Worker("a", 2, 1)])
