"""Budgets of the chunk service: how many of each kind of work it holds at once, in all and per client.

A refusal is explicit: `Busy` (503, the whole server is at its cap: try another holder) or
`TooMany` (429, this client holds its whole share). Both transports (HTTP and libp2p) share them.

A budget may keep a `reserve` for peers seen working (policy/working.py): everyone else together
holds at most `total - reserve` units, whatever the number of addresses or identities they come
from, so the last `reserve` units are always there for the peers the swarm needs.
"""

from __future__ import annotations

from collections import Counter

# What a refusal says, by budget: (server-wide, per client).
_TEXTS = {
    "connections": ("busy: too many connections", "too many connections from this client"),
    "streams": ("busy: too many requests", "too many requests from this peer"),
    "control": ("busy: too many requests", "too many requests from this client"),
    "waiting": ("busy: too many held requests", "too many held requests from this client"),
    "uploads": ("upload slots full", "too many chunk transfers to this client"),
}


class Refused(Exception):
    """A budget is full: 429 when the client's own share is, 503 when the whole server's is."""

    status = 503

    def __init__(self, budget: str):
        self.budget = budget
        per_client = self.status == 429
        self.reason = f"{budget}_per_client" if per_client else budget  # the stats key is refused_<reason>
        self.text = _TEXTS[budget.removesuffix("_reserve")][per_client]  # `<name>_reserve` reads as `<name>`
        super().__init__(self.text)


class Busy(Refused):
    """The server-wide budget is full (503): the requester should try another holder."""


class TooMany(Refused):
    """This client holds its whole share of a budget (429)."""

    status = 429


class Budget:
    """Concurrent holders of one kind of work: at most `total` in all and `per_client` per client, and of
    those not `working`, at most `total - reserve` together.

    >>> waiting = Budget("waiting", 32, 8, stats, reserve=8)
    >>> waiting.acquire("ip:203.0.113.5")   # None: taken; TooMany past 8 for that client, Busy past 24 not working
    >>> waiting.acquire("peer:12D3...", working=True)   # Busy only past 32 in all
    >>> waiting.release("ip:203.0.113.5")
    >>> waiting.release("peer:12D3...", working=True)

    `stats` gets the gauges `open_<name>` (all units) and `working_open_<name>` (units of working peers).
    A working peer refused because even the reserve is full is refused as `<name>_reserve` (as `<name>`
    where the budget keeps no reserve).
    `ChunkService.hold` takes a unit for a block and raises the refusal, counted by `ChunkService.count`.
    """

    def __init__(self, name: str, total: int, per_client: int, stats: Counter[str], reserve: int = 0):
        if not 0 <= reserve < total:
            raise ValueError(f"the {name} reserve ({reserve}) must be below its total ({total})")
        self.name = name
        self.total = total
        self.per_client = per_client
        self.reserve = reserve
        self.used = 0
        self.working = 0  # units held by working peers (any of them may come from the reserve)
        self.by_client: Counter[str] = Counter()
        self._stats = stats

    def refusal(self, client: str | None, working: bool = False) -> Refused | None:
        """What `acquire` would refuse with now, or None. A client of None has no per-client cap."""
        if client is not None and self.by_client[client] >= self.per_client:
            return TooMany(self.name)
        if working:
            if self.used < self.total:
                return None
            return Busy(f"{self.name}_reserve" if self.reserve else self.name)
        if self.used - self.working >= self.total - self.reserve or self.used >= self.total:
            return Busy(self.name)
        return None

    def acquire(self, client: str | None, working: bool = False) -> Refused | None:
        """Take one unit for `client` (`working`: a peer seen working, who may take the reserve); the
        refusal, untaken, if a cap is reached."""
        refusal = self.refusal(client, working)
        if refusal is None:
            self.used += 1
            self.working += working
            if client is not None:
                self.by_client[client] += 1
            self._gauges()
        return refusal

    def release(self, client: str | None, working: bool = False) -> None:
        self.used -= 1
        self.working -= working
        if client is not None:
            self.by_client[client] -= 1
            if self.by_client[client] <= 0:
                del self.by_client[client]
        self._gauges()

    def _gauges(self) -> None:
        self._stats[f"open_{self.name}"] = self.used
        if self.reserve:
            self._stats[f"working_open_{self.name}"] = self.working
