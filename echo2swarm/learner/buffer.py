"""The version-tagged rollout buffer that feeds the GRPO trainer.

    rpc_submit ─► learner checks lease/version, computes rewards ─► RolloutBuffer.add(group)
    trainer loop: poll ready(step, n) ─► take(step, n) ─► one GRPO step ─► step + 1

Staleness rule (docs/architecture.md §2): a group generated with version ``x`` may train step ``t``
only if ``0 <= t - x <= S``. S is a bound, not a target: by default (``order="freshest"``) a step
trains the newest groups first, so staleness stays as low as the rollouts in flight allow; the
learner's intake keeps only as many in flight as keep it busy. ``order="oldest"`` trains the oldest
first (fewest stale drops, staleness near S). ``take`` discards every group that has fallen out of that window
(counted in ``dropped["stale"]``) and never returns one from the future (``x > t``: kept for a
later step). The only other way a group leaves without being trained on is the size bound
(``dropped["overflow"]``). So, at all times, ``added == taken + sum(dropped.values()) + len(buffer)``.

Back-pressure: none here; the bound only protects memory. The learner applies back-pressure by
not handing out leases faster than it trains. Not thread-safe: use it from one asyncio loop.
"""

from __future__ import annotations

import collections
from collections import Counter
from typing import Literal

from echo2swarm.train.group import Group

__all__ = ["RolloutBuffer"]


Order = Literal["freshest", "oldest"]


class RolloutBuffer:
    """Groups waiting for a GRPO step, bucketed by version.

    ``take`` serves versions in ``order`` (ties by arrival); the overflow bound evicts the oldest.

    Example::

        buffer = RolloutBuffer(staleness=1)
        buffer.add(group_v3)                 # version 3
        buffer.ready(step=4, groups_needed=1)  # True: 4 - 3 <= 1
        batch = buffer.take(step=4, groups_needed=1)
        buffer.staleness_histogram            # Counter({1: 1})
    """

    def __init__(self, staleness: int, max_groups: int = 100_000, order: Order = "freshest") -> None:
        if order not in ("freshest", "oldest"):
            raise ValueError(f"order must be freshest or oldest, got {order!r}")
        if staleness < 0:
            raise ValueError(f"staleness S must be >= 0, got {staleness}")
        if max_groups < 1:
            raise ValueError(f"max_groups must be >= 1, got {max_groups}")
        self.staleness = staleness
        self.max_groups = max_groups
        self.order = order
        self._by_version: dict[int, collections.deque[Group]] = {}
        self._size = 0
        self.added = 0
        self.taken = 0
        self.dropped: Counter[str] = Counter()
        self.staleness_histogram: Counter[int] = Counter()

    def __len__(self) -> int:
        return self._size

    def _window(self, step: int) -> tuple[int, int]:
        return step - self.staleness, step

    def add(self, group: Group) -> None:
        """Store an accepted group; beyond ``max_groups`` evict the oldest (counted as overflow)."""
        group.check()
        self._by_version.setdefault(group.version, collections.deque()).append(group)
        self._size += 1
        self.added += 1
        while self._size > self.max_groups:
            oldest = min(self._by_version)
            self._pop_left(oldest)
            self.dropped["overflow"] += 1

    def _pop_left(self, version: int) -> Group:
        bucket = self._by_version[version]
        group = bucket.popleft()
        if not bucket:
            del self._by_version[version]
        self._size -= 1
        return group

    def count_usable(self, step: int) -> int:
        """Groups that ``take(step, ...)`` could return: ``step - S <= version <= step``."""
        low, high = self._window(step)
        return sum(len(bucket) for version, bucket in self._by_version.items() if low <= version <= high)

    def ready(self, step: int, groups_needed: int) -> bool:
        return self.count_usable(step) >= groups_needed

    def discard_stale(self, step: int) -> int:
        """Drop every group with ``step - version > S`` (counted as stale); return how many."""
        low, _ = self._window(step)
        discarded = 0
        for version in [v for v in self._by_version if v < low]:
            n = len(self._by_version.pop(version))
            self._size -= n
            discarded += n
        self.dropped["stale"] += discarded
        return discarded

    def take(self, step: int, groups_needed: int) -> list[Group]:
        """Discard stale groups, then remove and return ``groups_needed`` usable groups, versions
        in ``order`` (ties by arrival). Groups from the future (``version > step``) stay.

        Raises ValueError if fewer than ``groups_needed`` are usable; stale groups are discarded
        even then, since a step never goes back.
        """
        if groups_needed < 0:
            raise ValueError(f"groups_needed must be >= 0, got {groups_needed}")
        self.discard_stale(step)
        usable = self.count_usable(step)
        if usable < groups_needed:
            raise ValueError(
                f"only {usable} groups usable at step {step} (S={self.staleness}, order {self.order}), "
                f"{groups_needed} needed"
            )
        low, high = self._window(step)
        out: list[Group] = []
        for version in sorted((v for v in self._by_version if low <= v <= high), reverse=self.order == "freshest"):
            while len(out) < groups_needed and version in self._by_version:
                out.append(self._pop_left(version))
            if len(out) == groups_needed:
                break
        for group in out:
            self.staleness_histogram[step - group.version] += 1
        self.taken += len(out)
        return out

    def drop_peer(self, peer_id: str) -> list[Group]:
        """Remove every buffered group of `peer_id` (it was banned), counted as `banned`; returns them."""
        dropped: list[Group] = []
        for version in list(self._by_version):
            bucket = self._by_version[version]
            kept = collections.deque(g for g in bucket if g.peer_id != peer_id)
            dropped += [g for g in bucket if g.peer_id == peer_id]
            if kept:
                self._by_version[version] = kept
            else:
                del self._by_version[version]
        self._size -= len(dropped)
        self.dropped["banned"] += len(dropped)
        return dropped

    def versions(self) -> dict[int, int]:
        """Groups held per version, for telemetry."""
        return {version: len(bucket) for version, bucket in sorted(self._by_version.items())}
