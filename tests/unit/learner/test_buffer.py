"""RolloutBuffer: the staleness window, ordering, conservation and telemetry counters."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from echo2swarm.learner.buffer import RolloutBuffer
from echo2swarm.train.group import Group

_ids = itertools.count()


def make_group(version: int, prompt_id: str | None = None, g: int = 2) -> Group:
    return Group(
        prompt_id=prompt_id if prompt_id is not None else f"p{next(_ids)}",
        version=version,
        prompt_ids=[5, 6, 7],
        completions=[[8, 2]] * g,
        behaviour_logprobs=[[-0.1, -0.2]] * g,
        rewards=[1.0] + [0.0] * (g - 1),
        finish_reasons=["stop"] * g,
    )


def conserved(buffer: RolloutBuffer) -> bool:
    return buffer.added == buffer.taken + sum(buffer.dropped.values()) + len(buffer)


def test_s0_takes_only_the_current_version() -> None:
    buffer = RolloutBuffer(staleness=0)
    old, now, future = make_group(4), make_group(5), make_group(6)
    for group in (old, now, future):
        buffer.add(group)

    assert buffer.count_usable(5) == 1
    assert not buffer.ready(5, 2)
    assert buffer.take(5, 1) == [now]
    assert buffer.dropped["stale"] == 1  # version 4 is out of the window at step 5
    assert len(buffer) == 1  # the future group waits
    assert buffer.take(6, 1) == [future]
    assert buffer.staleness_histogram == Counter({0: 2})
    assert conserved(buffer)


def test_window_is_inclusive_and_oldest_version_first() -> None:
    buffer = RolloutBuffer(staleness=3, order="oldest")
    groups = [make_group(v) for v in (9, 7, 10, 7, 8, 6, 11)]  # window [7, 10]: 6 is stale, 11 future
    for group in groups:
        buffer.add(group)

    assert buffer.count_usable(10) == 5
    assert buffer.ready(10, 5) and not buffer.ready(10, 6)
    taken = buffer.take(10, 4)

    # oldest version first, ties by arrival: 7 (2nd added), 7 (4th added), 8, 9
    assert taken == [groups[1], groups[3], groups[4], groups[0]]
    assert buffer.dropped == Counter({"stale": 1})
    assert buffer.staleness_histogram == Counter({3: 2, 2: 1, 1: 1})
    assert buffer.versions() == {10: 1, 11: 1}
    assert conserved(buffer)


def test_freshest_first_is_the_default() -> None:
    buffer = RolloutBuffer(staleness=3)
    groups = [make_group(v) for v in (9, 7, 10, 7, 8, 6, 11)]
    for group in groups:
        buffer.add(group)
    # newest version first, ties by arrival: 10, 9, 8, 7 (2nd added); 6 stale, 11 from the future
    assert buffer.take(10, 4) == [groups[2], groups[0], groups[4], groups[1]]
    assert buffer.staleness_histogram == Counter({0: 1, 1: 1, 2: 1, 3: 1})
    assert buffer.versions() == {7: 1, 11: 1}
    assert buffer.take(11, 1) == [groups[6]]
    assert buffer.take(11, 0) == [] and buffer.dropped == Counter({"stale": 2})  # the second 7 aged out
    assert conserved(buffer)


def test_unknown_order_refused() -> None:
    with pytest.raises(ValueError, match="order"):
        RolloutBuffer(staleness=1, order="hold")  # type: ignore[arg-type]


def test_take_raises_when_not_ready_and_zero_is_fine() -> None:
    buffer = RolloutBuffer(staleness=1)
    buffer.add(make_group(3))
    buffer.add(make_group(1))
    with pytest.raises(ValueError, match=r"only 1 groups usable at step 3 \(S=1, order freshest\), 2 needed"):
        buffer.take(3, 2)
    assert buffer.dropped["stale"] == 1  # a step never goes back, so stale ones go even on failure
    assert buffer.take(3, 0) == []
    assert len(buffer) == 1
    with pytest.raises(ValueError):
        buffer.take(3, -1)
    assert conserved(buffer)


def test_overflow_drops_oldest_and_counts() -> None:
    buffer = RolloutBuffer(staleness=5, max_groups=3, order="oldest")
    a, b, c, d = make_group(2), make_group(1), make_group(2), make_group(3)
    for group in (a, b, c, d):
        buffer.add(group)
    assert len(buffer) == 3
    assert buffer.dropped == Counter({"overflow": 1})
    buffer.add(make_group(3))
    assert buffer.dropped == Counter({"overflow": 2})
    assert buffer.take(3, 1) == [c]  # b (v1) then a (v2, first arrival) were evicted
    assert conserved(buffer)


def test_discard_stale_and_invalid_arguments() -> None:
    buffer = RolloutBuffer(staleness=2)
    for v in (0, 1, 2, 3):
        buffer.add(make_group(v))
    assert buffer.discard_stale(4) == 2
    assert buffer.dropped["stale"] == 2 and len(buffer) == 2
    with pytest.raises(ValueError):
        RolloutBuffer(staleness=-1)
    with pytest.raises(ValueError):
        RolloutBuffer(staleness=0, max_groups=0)


def test_add_rejects_inconsistent_groups() -> None:
    buffer = RolloutBuffer(staleness=1)
    bad = make_group(0)
    bad.rewards = [1.0]
    with pytest.raises(ValueError, match="rewards"):
        buffer.add(bad)
    bad = make_group(0)
    bad.behaviour_logprobs = [[-0.1], [-0.1, -0.2]]
    with pytest.raises(ValueError, match="1 logprobs"):
        buffer.add(bad)
    with pytest.raises(ValueError, match="no completions"):
        buffer.add(make_group(0, g=0))
    with pytest.raises(ValueError, match="negative"):
        buffer.add(make_group(-1))
    assert len(buffer) == 0 and buffer.added == 0


class ReferenceBuffer:
    """The spec, written as plainly as possible, to check the real buffer against."""

    def __init__(self, staleness: int, max_groups: int, order: str) -> None:
        self.s, self.max, self.order = staleness, max_groups, order
        self.items: list[tuple[int, int, Group]] = []  # (version, arrival, group)
        self.arrival = 0
        self.dropped: Counter[str] = Counter()

    def add(self, group: Group) -> None:
        self.items.append((group.version, self.arrival, group))
        self.arrival += 1
        if len(self.items) > self.max:
            self.items.remove(min(self.items, key=lambda x: x[:2]))
            self.dropped["overflow"] += 1

    def usable(self, step: int) -> list[tuple[int, int, Group]]:
        return [x for x in self.items if 0 <= step - x[0] <= self.s]

    def trainable(self, step: int) -> list[tuple[int, int, Group]]:
        newest = self.order == "freshest"
        return sorted(self.usable(step), key=lambda x: (-x[0] if newest else x[0], x[1]))

    def take(self, step: int, n: int) -> list[Group] | None:
        stale = [x for x in self.items if step - x[0] > self.s]
        self.dropped["stale"] += len(stale)
        self.items = [x for x in self.items if step - x[0] <= self.s]
        usable = self.trainable(step)
        if len(usable) < n:
            return None
        chosen = usable[:n]
        for x in chosen:
            self.items.remove(x)
        return [x[2] for x in chosen]


@pytest.mark.parametrize("order", ["freshest", "oldest"])
@pytest.mark.parametrize("staleness", [0, 1, 3])
@pytest.mark.parametrize("seed", range(8))
def test_randomised_add_take_invariants(staleness: int, seed: int, order: str) -> None:
    rng = random.Random(seed * 100 + staleness)
    max_groups = rng.choice([5, 12, 100_000])
    buffer = RolloutBuffer(staleness=staleness, max_groups=max_groups, order=order)  # type: ignore[arg-type]
    reference = ReferenceBuffer(staleness, max_groups, order)
    step = 0
    added: list[Group] = []
    returned: list[Group] = []
    histogram: Counter[int] = Counter()

    for _ in range(400):
        op = rng.random()
        if op < 0.55:
            # versions around the window, including stale and future ones
            version = max(0, step + rng.randint(-staleness - 2, 2))
            group = make_group(version)
            buffer.add(group)
            reference.add(group)
            added.append(group)
        elif op < 0.9:
            n = rng.randint(0, 4)
            usable = buffer.count_usable(step)
            assert usable == len(reference.trainable(step)) == len(reference.usable(step))
            assert buffer.ready(step, n) == (usable >= n)
            expected = reference.take(step, n)
            if expected is None:
                with pytest.raises(ValueError):
                    buffer.take(step, n)
                continue
            got = buffer.take(step, n)
            assert got == expected  # same groups, same (version, arrival) order
            assert len(got) == n
            for group in got:
                assert 0 <= step - group.version <= staleness  # never stale, never from the future
                histogram[step - group.version] += 1
            assert [g.version for g in got] == sorted((g.version for g in got), reverse=order == "freshest")
            returned += got
            if rng.random() < 0.7:
                step += 1  # the learner trained a step
        else:
            step += 1  # time passes without a take
        assert conserved(buffer)
        assert buffer.dropped == reference.dropped
        assert len(buffer) == len(reference.items) <= max_groups

    # every added group was returned exactly once, or dropped, or is still held
    ids = [g.prompt_id for g in returned]
    assert len(ids) == len(set(ids))
    assert len(added) == buffer.added
    assert buffer.taken == len(returned)
    assert buffer.added == len(returned) + sum(buffer.dropped.values()) + len(buffer)
    assert buffer.staleness_histogram == histogram
    assert all(0 <= k <= staleness for k in buffer.staleness_histogram)
    held = {x[2].prompt_id for x in reference.items}
    assert set(ids).isdisjoint(held)
