"""Capacity model: how much rollout throughput keeps the learner busy, and when none can.

Notation (docs/architecture.md §2, §8): R rollouts per step, T_train learner seconds per step,
T_bcast seconds until a version reaches the active peers, L_gen one group's generation latency,
S staleness, κ publish period, M = Σµ of the active set, γ the safety margin.

Two regimes, depending on what the peers do while a new version downloads:

- overlapped (our rollout daemon: it double-buffers and keeps generating with the version it
  holds). The learner never waits when both hold:
      throughput floor   M ≥ γ · R / T_train
      freshness          T_bcast + L_gen ≤ (S − κ + 1) · T_train
  Freshness is about versions, not peers: if it fails, no number of workers helps; only a larger
  S, a smaller κ or a faster broadcast does.
- sequential (ECHO-2's own form, for peers that generate only once dissemination completed):
      M ≥ γ · κR / (κ·T_train − T_bcast)        (needs κ·T_train > T_bcast)

Predicted bubble ratio: the steady-state learner step takes the longest of its own compute, the
time the peers need to produce R rollouts, and the time freshness forces it to stretch to;
bubble = 1 − T_train / T_step. Everything here is pure arithmetic, unit-tested in
tests/unit/control/.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Literal

Regime = Literal["overlapped", "sequential"]

# The defaults and the one hard rule of S and κ, used by the config, the learner and `plan` alike.
DEFAULT_STALENESS = 1       # S
DEFAULT_PUBLISH_EVERY = 1   # κ
DEFAULT_GAMMA = 1.1         # margin over the bare throughput floor


def staleness_problem(staleness: int, publish_every: int) -> str | None:
    """Why S and κ cannot work together, or None. A version is published every κ steps, so a rollout
    is at least κ − 1 versions old by the step that trains it: S below that leaves nothing to train on."""
    if staleness < publish_every - 1:
        return (f"staleness S={staleness} is below publish_every-1={publish_every - 1}: rollouts would always be "
                "too stale to train on; raise staleness or lower publish_every")
    return None


@dataclass(frozen=True)
class CapacityInputs:
    """What the model needs about the learner and the broadcast.

    >>> round(CapacityInputs(rollouts_per_step=128, t_train=2.0, t_bcast=0.5, staleness=1).floor(), 2)
    70.4
    """

    rollouts_per_step: float            # R
    t_train: float                      # seconds of learner compute per step
    t_bcast: float = 0.0                # seconds until a published version reaches the active peers
    staleness: int = DEFAULT_STALENESS
    publish_every: int = DEFAULT_PUBLISH_EVERY
    gamma: float = DEFAULT_GAMMA
    l_gen: float = 0.0                  # seconds to generate one group (lease) on a peer
    regime: Regime = "overlapped"

    def __post_init__(self) -> None:
        for name in ("rollouts_per_step", "t_train", "gamma"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value}")
        for name in ("t_bcast", "l_gen"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if self.publish_every < 1:
            raise ValueError(f"publish_every (κ) must be >= 1, got {self.publish_every}")
        problem = staleness_problem(self.staleness, self.publish_every)
        if problem is not None:
            raise ValueError(problem)
        if self.regime not in ("overlapped", "sequential"):
            raise ValueError(f"regime must be overlapped or sequential, got {self.regime!r}")

    # -- conditions ----------------------------------------------------------------------------
    @property
    def slack_steps(self) -> int:
        """S − κ + 1: steps between a version's publication and the last step that may use it, minus κ − 1."""
        return self.staleness - self.publish_every + 1

    def arrival_budget(self) -> float:
        """Seconds a version may take to reach an active peer without the learner waiting for its rollouts:
        (S − κ + 1)·T_train − L_gen (the `fresh` term of `step_time`); inf while T_train is unknown (0)."""
        if self.t_train <= 0:
            return math.inf
        return max(0.0, self.slack_steps * self.t_train - self.l_gen)

    def freshness_ok(self) -> bool:
        # At S = κ − 1 (no slack) a version's rollouts exist only after the learner needs them.
        return self.slack_steps >= 1 and self.t_bcast + self.l_gen <= self.slack_steps * self.t_train

    def sequential_mu_min(self) -> float:
        """ECHO-2's bare µ_min = κR / (κ·T_train − T_bcast); inf when the broadcast outlasts κ steps."""
        denom = self.publish_every * self.t_train - self.t_bcast
        return math.inf if denom <= 0 else self.publish_every * self.rollouts_per_step / denom

    def bare_floor(self) -> float:
        """Σµ the learner needs at γ = 1 in this regime (rollouts/s)."""
        if self.regime == "sequential":
            return self.sequential_mu_min()
        return self.rollouts_per_step / self.t_train

    def floor(self) -> float:
        """Σµ the active set must reach: γ times the bare floor."""
        return self.gamma * self.bare_floor()

    # -- prediction ----------------------------------------------------------------------------
    def step_time(self, total_mu: float) -> float:
        """Predicted steady-state seconds per learner step with Σµ = total_mu."""
        if total_mu <= 0:
            return math.inf
        k, r, tt, tb = self.publish_every, self.rollouts_per_step, self.t_train, self.t_bcast
        gen = max(r / total_mu, self.l_gen)
        if self.slack_steps == 0:
            # S = κ − 1: a period's first step can only use the version published just before it,
            # so every period pays the broadcast and the first batch before training resumes.
            produce_rest = (k - 1) * r / total_mu + tt
            return (tb + gen + max(k * tt, produce_rest)) / k
        throughput = (tb + k * r / total_mu) / k if self.regime == "sequential" else r / total_mu
        fresh = (tb + self.l_gen) / self.slack_steps
        return max(tt, throughput, fresh)

    def bubble_ratio(self, total_mu: float) -> float:
        """Predicted fraction of learner wall time spent waiting for rollouts."""
        step = self.step_time(total_mu)
        return 1.0 if math.isinf(step) else max(0.0, 1.0 - self.t_train / step)


@dataclass
class Diagnosis:
    """Why a target cannot be met and what would meet it; empty `problems` means feasible."""

    problems: list[str] = field(default_factory=list)
    fixes: list[str] = field(default_factory=list)
    needed: dict[str, float] = field(default_factory=dict)  # machine-readable: min_staleness, max_t_bcast_s, ...

    @property
    def feasible(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict:
        return asdict(self)


def min_staleness(inputs: CapacityInputs) -> int:
    """Smallest S for which freshness holds with this κ, T_train, T_bcast and L_gen."""
    return inputs.publish_every - 1 + max(1, math.ceil((inputs.t_bcast + inputs.l_gen) / inputs.t_train - 1e-12))


def diagnose(inputs: CapacityInputs, available_mu: float) -> Diagnosis:
    """Check freshness and the floor against the throughput of every available peer; name the fixes."""
    d = Diagnosis()
    k, s = inputs.publish_every, inputs.staleness
    if inputs.regime == "overlapped" and not inputs.freshness_ok():
        need_s = min_staleness(inputs)
        budget = inputs.slack_steps * inputs.t_train - inputs.l_gen
        d.problems.append(
            f"freshness: T_bcast + L_gen = {inputs.t_bcast + inputs.l_gen:.3g} s exceeds (S - kappa + 1) * T_train = "
            f"{max(0, inputs.slack_steps) * inputs.t_train:.3g} s, so rollouts go stale whatever the worker count"
        )
        d.fixes.append(f"raise staleness S to >= {need_s} (now {s})")
        d.needed["min_staleness"] = need_s
        max_k = s + 1 - max(1, math.ceil((inputs.t_bcast + inputs.l_gen) / inputs.t_train - 1e-12))
        if 1 <= max_k < k:
            d.fixes.append(f"lower publish_every kappa to <= {max_k} (now {k})")
            d.needed["max_publish_every"] = max_k
        if budget > 0:
            d.fixes.append(f"make the broadcast reach the peers within {budget:.3g} s "
                           f"(now {inputs.t_bcast:.3g} s: {inputs.t_bcast / budget:.2g}x faster)")
            d.needed["max_t_bcast_s"] = budget
        else:
            d.fixes.append(f"shorten generation: one group takes L_gen = {inputs.l_gen:.3g} s, "
                           f"more than the {inputs.slack_steps * inputs.t_train:.3g} s window")
    floor = inputs.floor()
    if math.isinf(floor):
        d.problems.append(
            f"sequential: the broadcast (T_bcast = {inputs.t_bcast:.3g} s) outlasts kappa * T_train = "
            f"{k * inputs.t_train:.3g} s, so no throughput keeps the learner busy"
        )
        need_k = math.floor(inputs.t_bcast / inputs.t_train) + 1
        d.fixes.append(f"raise publish_every kappa to >= {need_k} (and staleness S to >= {need_k - 1})")
        d.fixes.append(f"make the broadcast finish within {k * inputs.t_train:.3g} s")
        d.needed["min_publish_every"] = need_k
        d.needed["max_t_bcast_s"] = k * inputs.t_train
    elif available_mu < floor - 1e-9:
        d.problems.append(f"throughput: all peers together give {available_mu:.4g} rollouts/s, below the floor {floor:.4g}")
        d.fixes.append(f"add peers worth >= {floor - available_mu:.4g} rollouts/s")
        if available_mu > 0:
            max_r = inputs.rollouts_per_step * available_mu / floor
            d.fixes.append(f"or lower rollouts per step to <= {math.floor(max_r + 1e-9)}")
            d.needed["max_rollouts_per_step"] = math.floor(max_r + 1e-9)
        d.needed["missing_mu"] = floor - available_mu
        if inputs.regime == "sequential":
            d.fixes.append("or let peers keep generating while they fetch (overlapped regime: floor R/T_train, "
                           f"{inputs.gamma * inputs.rollouts_per_step / inputs.t_train:.4g} rollouts/s with gamma)")
    return d
