"""The seeded per-pass order both the math and the poker task serve their train split in."""

from __future__ import annotations

import random

from echo2swarm.tasks.base import EpochShuffle


def test_each_pass_is_a_seeded_permutation_and_passes_differ() -> None:
    items = list(range(50))
    order = EpochShuffle(items, key="7:train")
    first, second = [order[i] for i in range(50)], [order[i] for i in range(50, 100)]
    assert sorted(first) == sorted(second) == items
    assert first != second
    expected = list(items)
    random.Random("7:train:1").shuffle(expected)
    assert second == expected  # the key the tasks have always seeded with: same prompts after a restart


def test_the_order_depends_only_on_the_key_not_on_what_was_read_before() -> None:
    items = [f"spot{i}" for i in range(20)]
    a, b = EpochShuffle(items, key="0:poker:train"), EpochShuffle(items, key="0:poker:train")
    for epoch in range(9):  # past the passes kept in memory: evicted passes come back the same
        a[epoch * 20]
    assert [a[i] for i in range(0, 200, 7)] == [b[i] for i in range(0, 200, 7)]
    assert [EpochShuffle(items, key="1:poker:train")[i] for i in range(20)] != [b[i] for i in range(20)]
