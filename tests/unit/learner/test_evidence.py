"""Per-peer sequential tests over verified groups (learner/evidence.py): pure logic.

The figures an honest peer and the attackers give are measured in scripts/bench_verify.py; here, that
each test drifts down on what honest engines give, crosses on a steady excess, and is two-sided.
"""

from __future__ import annotations

import math
import random

from echo2swarm.config.rl import VerifyConfig
from echo2swarm.learner.evidence import Z_CLIP, PeerStatistics
from echo2swarm.train.verify import GroupEvidence


def group(peer: str = "p", *, positions: int = 28, choice: float | None = 0.0, z: float | None = 0.0) -> GroupEvidence:
    return GroupEvidence(peer, "train:1", positions, choice, z)


def test_honest_figures_never_cross_and_a_steady_excess_does() -> None:
    config = VerifyConfig()
    stats = PeerStatistics(config, max_peers=16)
    rng = random.Random(0)
    for _ in range(100_000):  # exact choices, z ~ N(0, 0.9): an honest fp32 engine for a long time
        assert stats.observe(group(z=rng.gauss(0.0, 0.9))) is None
    # A bf16 engine's noise: a small gap now and then, far below the allowance a position.
    for _ in range(20_000):
        assert stats.observe(group("bf16", choice=0.04 if rng.random() < 0.1 else 0.0, z=rng.gauss(0, 0.9))) is None
    # A sampler at another temperature: a steady 1.2 evidence a group (28 positions), above the allowance.
    net = 1.2 - config.peer_choice_allowance * 28
    assert net > 0
    crossed = None
    for n in range(1, 200):
        crossed = stats.observe(group("hot", choice=1.2, z=0.0))
        if crossed:
            break
    expected = math.ceil(config.peer_choice_threshold / net - 1e-9)
    assert crossed is not None and crossed.test == "choices" and n == expected, (n, expected, crossed)
    assert crossed.groups == expected and "choices CUSUM" in crossed.describe()
    assert stats.snapshot("hot") is None  # judged: its sums are gone


def test_typicality_is_two_sided_and_one_group_cannot_carry_a_peer() -> None:
    config = VerifyConfig()  # allowance 0.75, threshold 20
    stats = PeerStatistics(config, max_peers=16)
    # One absurd group (z 500) adds at most Z_CLIP - allowance.
    assert stats.observe(group("odd", choice=None, z=500.0)) is None
    assert stats.snapshot("odd")["typicality_high"] == Z_CLIP - config.peer_z_allowance
    # Colder than sampling (greedy-like, z -1.9 a group): the lower sum crosses, after 20 / 1.15 groups.
    cold = [stats.observe(group("cold", choice=None, z=-1.9)) for _ in range(18)]
    assert [c is not None for c in cold].index(True) == 17 and cold[17].test == "typicality_low"
    hot = [stats.observe(group("hot", choice=None, z=+1.9)) for _ in range(18)]
    assert hot[17] is not None and hot[17].test == "typicality_high"
    # Groups measured without typicality (z None) or without choices (choice None) add nothing there.
    assert stats.observe(group("none", choice=None, z=None)) is None
    assert stats.snapshot("none") == {"choice": 0.0, "typicality_high": 0.0, "typicality_low": 0.0, "groups": 1,
                                      "choice_groups": 0}


def test_tests_turned_off_and_memory_bounded() -> None:
    off = PeerStatistics(VerifyConfig(peer_choice_threshold=None, peer_z_threshold=None), max_peers=16)
    assert all(off.observe(group(choice=1.0, z=-4.0)) is None for _ in range(1000))
    stats = PeerStatistics(VerifyConfig(), max_peers=16)
    for i in range(100):
        stats.observe(group(f"peer-{i}", choice=0.5))
    assert len(stats) == 16 and stats.snapshot("peer-0") is None and stats.snapshot("peer-99") is not None
