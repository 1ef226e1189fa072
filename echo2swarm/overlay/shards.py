"""The swarm's card shard depth as one node knows it, and the depth the learner's head asks for.

Cards live in 2**depth shards (overlay/dht_keys.py); the learner chooses the depth from what its reads
of every shard find (overlay/cards.py) and signs it into its head; every other node takes it from the
head it trusts. This is that state and the learner's rule, apart from the reads that feed it.
"""

from __future__ import annotations

import time
from typing import Any

from echo2swarm.overlay.dht_keys import CARDS_PER_SHARD, MAX_SHARD_BITS

FULL_MEMORY_S = 3600.0  # a depth seen over-full is not gone back to for this long (the longest a record lives)


class ShardDepth:
    """The swarm's card shard depth as this node knows it (overlay/dht_keys.py), and the one before it for
    `hold_s` after a change: cards are stored and read at both until all have been re-announced.

    Followers take the depth from the newest trusted head (`set`); the learner chooses it (`wanted`)
    from what its whole reads found (`observe`): deeper at once when the shards hold more than
    CARDS_PER_SHARD on average, one level shallower when they held under a quarter of that for 2x
    `hold_s` (so a swarm that shrinks for a moment, or shards still filling after a change, do not flap)
    and that depth was not seen over-full for FULL_MEMORY_S (a flood left in the shallower shards
    lives until its records expire: going back would meet it again, and go deeper again).

    >>> depth = ShardDepth(hold_s=30.0)
    >>> depth.observe([(0, 700)])        # one shard, 700 cards
    >>> depth.wanted(max_bits=10)
    3
    """

    def __init__(self, hold_s: float, clock: Any = time.monotonic):
        self.hold_s = hold_s
        self.clock = clock
        self.bits = 0
        self.count = 0  # cards the last whole read found (the larger count of the depths it read)
        self._before: int | None = None
        self._until = float("-inf")  # clock() until which the depth before is still read and written
        self._sparse_since: float | None = None
        self._full: dict[int, float] = {}  # depth -> clock() when a whole read last found it over-full

    def set(self, bits: int) -> bool:
        """Take `bits` as the swarm's depth; True if it changed."""
        if not 0 <= bits <= MAX_SHARD_BITS or bits == self.bits:
            return False
        self._before, self._until, self.bits = self.bits, self.clock() + self.hold_s, bits
        self._sparse_since = None
        return True

    def depths(self) -> list[int]:
        """Where cards go and are looked for now: the depth, then the one before while it is held."""
        if self._before is not None and self.clock() < self._until:
            return [self.bits, self._before]
        return [self.bits]

    def observe(self, sizes: list[tuple[int, int]]) -> None:
        """A whole read's shards as (depth, cards found); cards move to a new depth as they are re-announced,
        so the count is the larger sum of the depths read."""
        sums: dict[int, int] = {}
        for bits, size in sizes:
            sums[bits] = sums.get(bits, 0) + size
        self.count = max(sums.values(), default=0)
        now = self.clock()
        for bits, total in sums.items():
            if total > CARDS_PER_SHARD << bits:
                self._full[bits] = now
        if self.count * 4 < CARDS_PER_SHARD << self.bits and len(sums) == 1:
            self._sparse_since = now if self._sparse_since is None else self._sparse_since
        else:
            self._sparse_since = None

    def wanted(self, max_bits: int) -> int:
        """The depth a head signed now should carry."""
        target = 0
        while target < MAX_SHARD_BITS and self.count > CARDS_PER_SHARD << target:
            target += 1
        if min(target, max_bits) > self.bits or max_bits < self.bits:
            return min(target, max_bits)
        now = self.clock()
        if self.bits > 0 and self._sparse_since is not None and now - self._sparse_since >= 2 * self.hold_s \
                and now - self._full.get(self.bits - 1, float("-inf")) >= FULL_MEMORY_S:
            return self.bits - 1
        return self.bits


__all__ = ["FULL_MEMORY_S", "ShardDepth"]
