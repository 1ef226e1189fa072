"""The publish rule (train/rounding.py) against hand-computed bf16/fp16 values."""

from __future__ import annotations

import pytest
import torch

from echo2swarm.train.rounding import held_cast

BF16 = torch.bfloat16
UP = 2.0**-7  # bf16's ulp on [1, 2)
DOWN = 2.0**-8  # ... and on [0.5, 1)
TINY = 2.0**-133  # bf16's smallest subnormal


def publish(master: float, previous: float, hold: float = 1.0, dtype: torch.dtype = BF16) -> float:
    out = held_cast(torch.tensor([master], dtype=torch.float32), torch.tensor([previous], dtype=dtype), dtype, hold)
    assert out.dtype == dtype
    return float(out[0])


@pytest.mark.parametrize(("master", "previous", "expected"), [
    (1 + 0.9 * UP, 1.0, 1.0),                   # within one ulp above: held (round-to-nearest says 1 + UP)
    (1 + 1.1 * UP, 1.0, 1 + UP),                # beyond: the master rounded to nearest
    (1 + 2.7 * UP, 1.0, 1 + 3 * UP),
    (1 - 0.9 * DOWN, 1.0, 1.0),                 # below 1.0 the ulp is half as wide: measured in it
    (1 - 1.2 * DOWN, 1.0, 1 - DOWN),
    (-1 - 0.9 * UP, -1.0, -1.0),                # negative values: the same, mirrored
    (-1 - 1.3 * UP, -1.0, -1 - UP),
    (-1 + 0.9 * DOWN, -1.0, -1.0),
    (-1 + 1.2 * DOWN, -1.0, -(1 - DOWN)),
    (0.9 * TINY, 0.0, 0.0),                     # zero: its neighbours are the smallest subnormals
    (-0.9 * TINY, 0.0, 0.0),
    (2 * TINY, 0.0, 2 * TINY),
    (-1.6 * TINY, TINY, -2 * TINY),             # across zero: more than one ulp from TINY
    (1.0, 1.0, 1.0),
])
def test_held_cast_keeps_a_value_until_the_master_is_more_than_hold_ulps_away(
        master: float, previous: float, expected: float) -> None:
    assert publish(master, previous) == expected


def test_hold_one_and_a_half_ulps_and_float16() -> None:
    assert publish(1 + 1.4 * UP, 1.0, hold=1.5) == 1.0
    assert publish(1 + 1.6 * UP, 1.0, hold=1.5) == 1 + 2 * UP
    fp16_ulp = 2.0**-10  # float16's ulp on [1, 2)
    assert publish(1 + 0.9 * fp16_ulp, 1.0, dtype=torch.float16) == 1.0
    assert publish(1 + 1.2 * fp16_ulp, 1.0, dtype=torch.float16) == 1 + fp16_ulp


def test_an_overflowing_cast_is_not_held_so_the_finiteness_check_sees_it() -> None:
    assert publish(70000.0, 65504.0, dtype=torch.float16) == float("inf")


def test_half_an_ulp_is_round_to_nearest_and_hold_bounds_the_lag() -> None:
    g = torch.Generator().manual_seed(0)
    masters = torch.randn(200_000, generator=g) * 0.02
    previous = (masters + torch.randn(200_000, generator=g) * 2e-4).to(BF16)  # a few ulps around the masters
    assert torch.equal(held_cast(masters, previous, BF16, 0.5), masters.to(BF16))
    held = held_cast(masters, previous, BF16, 1.0)
    kept = held == previous
    moved = ~kept
    assert 0.2 < float(kept.float().mean()) < 0.9  # both branches are exercised
    assert torch.equal(held[moved], masters.to(BF16)[moved])
    # a kept value is within one of its own ulps of the master (the neighbour on the master's side)
    gap = (previous.float().abs() * 2.0**-7).clamp(min=TINY)  # at most one ulp; >= half of one
    assert bool(((masters[kept] - previous.float()[kept]).abs() <= gap[kept] + 1e-12).all())
    # and fewer values change than with round-to-nearest
    assert int((held != previous).sum()) < int((masters.to(BF16) != previous).sum())


def test_plain_cast_when_there_is_nothing_to_hold() -> None:
    masters = torch.randn(64) * 0.02
    assert torch.equal(held_cast(masters, None, BF16, 1.0), masters.to(BF16))
    assert torch.equal(held_cast(masters, masters.to(BF16)[:32], BF16, 1.0), masters.to(BF16))  # other shape
    assert torch.equal(held_cast(masters, masters.to(torch.float16), BF16, 1.0), masters.to(BF16))  # other dtype
    assert held_cast(masters, masters.clone(), torch.float32, 1.0) is not None  # float32: nothing to hold
    assert torch.equal(held_cast(masters, (masters + 1).clone(), torch.float32, 1.0), masters)


def test_the_trainer_publishes_by_the_rule_and_refuses_what_overflows(tiny_model_dir) -> None:
    from echo2swarm.config.rl import TrainConfig, VerifyConfig
    from echo2swarm.train.trainer import GRPOTrainer
    from echo2swarm.train.verify import NonFiniteWeightsError

    trainer = GRPOTrainer(tiny_model_dir, TrainConfig(device="cpu"), verify=VerifyConfig(enabled=False))
    first = trainer.weights_state(BF16)
    name, param = next((n, p) for n, p in trainer.model.named_parameters() if p.dim() == 2)
    fp16 = trainer.weights_state(torch.float16)
    with torch.no_grad():  # every master moves 0.9 of its own ulp away from zero, off its bf16 value
        base = first[name].float()
        away = (first[name].view(torch.int16) + 1).view(BF16).float()  # the magnitude's next step
        param.copy_(base + 0.9 * (away - base))
    held = trainer.weights_state(BF16, first, 1.0)
    rounded = trainer.weights_state(BF16)
    assert torch.equal(held[name], first[name])  # within one ulp: every value kept
    assert int((rounded[name] != first[name]).sum()) > 0.8 * param.numel()  # round-to-nearest moved them
    assert all(torch.equal(held[k], rounded[k]) for k in held if k != name)  # nothing moved elsewhere
    with torch.no_grad():
        param.fill_(1e6)  # beyond float16's range: the cast is inf and is never held
    with pytest.raises(NonFiniteWeightsError):
        trainer.weights_state(torch.float16, {**fp16, name: torch.full_like(fp16[name], 60000)}, 2.0)
