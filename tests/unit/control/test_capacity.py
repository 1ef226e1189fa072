"""The capacity model's arithmetic: floor, freshness, ECHO-2's sequential form, bubble, diagnosis."""

from __future__ import annotations

import math

import pytest

from echo2swarm.control.capacity import CapacityInputs, diagnose, min_staleness


def test_floor_is_gamma_r_over_t_train_in_the_overlapped_regime():
    inputs = CapacityInputs(rollouts_per_step=128, t_train=2.0, gamma=1.1)
    assert inputs.bare_floor() == pytest.approx(64.0)
    assert inputs.floor() == pytest.approx(70.4)


def test_sequential_form_matches_echo2_mu_min():
    inputs = CapacityInputs(rollouts_per_step=100, t_train=2.0, t_bcast=1.0, staleness=2, publish_every=3,
                            gamma=1.0, regime="sequential")
    assert inputs.sequential_mu_min() == pytest.approx(3 * 100 / (3 * 2.0 - 1.0))
    assert inputs.floor() == pytest.approx(60.0)
    # More steps per version amortise the broadcast: µ_min falls toward R / T_train.
    wide = CapacityInputs(rollouts_per_step=100, t_train=2.0, t_bcast=1.0, staleness=9, publish_every=10,
                          regime="sequential")
    assert 50.0 < wide.sequential_mu_min() < inputs.sequential_mu_min()
    stuck = CapacityInputs(rollouts_per_step=100, t_train=1.0, t_bcast=2.0, regime="sequential")
    assert math.isinf(stuck.sequential_mu_min())


@pytest.mark.parametrize(
    ("t_bcast", "l_gen", "staleness", "kappa", "ok"),
    [(0.5, 0.4, 1, 1, True), (0.7, 0.4, 1, 1, False), (1.5, 0.4, 2, 1, True), (1.5, 0.4, 2, 2, False),
     (0.0, 0.0, 0, 1, False), (0.0, 0.0, 1, 2, False)],
)
def test_freshness(t_bcast, l_gen, staleness, kappa, ok):
    inputs = CapacityInputs(rollouts_per_step=10, t_train=1.0, t_bcast=t_bcast, l_gen=l_gen, staleness=staleness,
                            publish_every=kappa)
    assert inputs.freshness_ok() is ok


def test_bubble_falls_linearly_to_zero_at_the_bare_floor_when_fresh():
    inputs = CapacityInputs(rollouts_per_step=64, t_train=1.0, t_bcast=0.2, l_gen=0.2, staleness=1)
    assert inputs.bubble_ratio(32.0) == pytest.approx(0.5)
    assert inputs.bubble_ratio(48.0) == pytest.approx(0.25)
    assert inputs.bubble_ratio(64.0) == pytest.approx(0.0)
    assert inputs.bubble_ratio(200.0) == 0.0
    assert inputs.bubble_ratio(0.0) == 1.0
    previous = 1.0
    for mu in range(1, 100):
        bubble = inputs.bubble_ratio(float(mu))
        assert bubble <= previous + 1e-12
        previous = bubble


def test_synchronous_on_policy_always_has_a_bubble():
    sync = CapacityInputs(rollouts_per_step=64, t_train=1.0, t_bcast=0.3, staleness=0)
    # Every step pays broadcast + generation of R: T_step = T_train + T_bcast + R/M.
    assert sync.step_time(128.0) == pytest.approx(1.0 + 0.3 + 0.5)
    assert sync.bubble_ratio(1e9) == pytest.approx(1 - 1.0 / 1.3)


def test_stale_broadcast_stretches_the_step_whatever_the_throughput():
    inputs = CapacityInputs(rollouts_per_step=64, t_train=1.0, t_bcast=2.5, l_gen=0.5, staleness=1)
    assert inputs.step_time(1e9) == pytest.approx(3.0)
    assert inputs.bubble_ratio(1e9) == pytest.approx(2 / 3)


def test_diagnosis_names_staleness_kappa_and_bandwidth_for_freshness():
    inputs = CapacityInputs(rollouts_per_step=64, t_train=1.0, t_bcast=2.5, l_gen=0.25, staleness=2, publish_every=2)
    d = diagnose(inputs, available_mu=1e6)
    assert not d.feasible and "freshness" in d.problems[0]
    assert d.needed["min_staleness"] == min_staleness(inputs) == 4
    fixed = CapacityInputs(rollouts_per_step=64, t_train=1.0, t_bcast=2.5, l_gen=0.25, staleness=4, publish_every=2)
    assert fixed.freshness_ok() and not CapacityInputs(
        rollouts_per_step=64, t_train=1.0, t_bcast=2.5, l_gen=0.25, staleness=3, publish_every=2).freshness_ok()
    assert d.needed["max_t_bcast_s"] == pytest.approx(0.75)
    fast = CapacityInputs(rollouts_per_step=64, t_train=1.0, t_bcast=0.75, l_gen=0.25, staleness=2, publish_every=2)
    assert fast.freshness_ok()
    assert any("staleness" in f for f in d.fixes) and any("broadcast" in f for f in d.fixes)


def test_diagnosis_of_kappa_that_would_restore_freshness():
    inputs = CapacityInputs(rollouts_per_step=64, t_train=1.0, t_bcast=1.5, staleness=3, publish_every=3)
    d = diagnose(inputs, 1e6)
    assert d.needed["max_publish_every"] == 2
    assert CapacityInputs(rollouts_per_step=64, t_train=1.0, t_bcast=1.5, staleness=3, publish_every=2).freshness_ok()


def test_diagnosis_of_missing_throughput():
    inputs = CapacityInputs(rollouts_per_step=100, t_train=1.0, gamma=1.1)
    d = diagnose(inputs, available_mu=55.0)
    assert not d.feasible and d.needed["missing_mu"] == pytest.approx(55.0)
    assert d.needed["max_rollouts_per_step"] == 50
    assert diagnose(inputs, available_mu=110.0).feasible


def test_diagnosis_of_a_broadcast_longer_than_a_period_in_the_sequential_regime():
    inputs = CapacityInputs(rollouts_per_step=100, t_train=1.0, t_bcast=2.5, staleness=3, publish_every=1,
                            regime="sequential")
    d = diagnose(inputs, 1e6)
    assert d.needed["min_publish_every"] == 3
    assert math.isfinite(CapacityInputs(rollouts_per_step=100, t_train=1.0, t_bcast=2.5, staleness=3, publish_every=3,
                                        regime="sequential").sequential_mu_min())


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("t_train", 0.0, "t_train"), ("rollouts_per_step", -1.0, "rollouts_per_step"), ("gamma", math.nan, "gamma"),
     ("t_bcast", -0.1, "t_bcast"), ("publish_every", 0, "publish_every"), ("staleness", -1, "staleness")],
)
def test_inputs_are_validated_naming_the_field(field, value, message):
    kwargs = {"rollouts_per_step": 10.0, "t_train": 1.0, field: value}
    with pytest.raises(ValueError, match=message):
        CapacityInputs(**kwargs)
