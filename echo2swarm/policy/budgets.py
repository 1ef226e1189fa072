"""Budgets of the chunk service: how many of each kind of work it holds at once, in all and per client.

A refusal is explicit: `Busy` (503, the whole server is at its cap: try another holder) or
`TooMany` (429, this client holds its whole share). Both transports (HTTP and libp2p) share them.
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
        self.text = _TEXTS[budget][per_client]
        super().__init__(self.text)


class Busy(Refused):
    """The server-wide budget is full (503): the requester should try another holder."""


class TooMany(Refused):
    """This client holds its whole share of a budget (429)."""

    status = 429


class Budget:
    """Concurrent holders of one kind of work: at most `total` in all and `per_client` per client.

    >>> uploads = Budget("uploads", 16, 8, stats)
    >>> uploads.acquire("ip:203.0.113.5")   # None: taken; TooMany past 8 for that client, Busy past 16 in all
    >>> uploads.release("ip:203.0.113.5")

    `stats` gets the gauge `open_<name>`. `ChunkService.hold` takes a unit for a block and raises
    the refusal, counted by `ChunkService.count`.
    """

    def __init__(self, name: str, total: int, per_client: int, stats: Counter[str]):
        self.name = name
        self.total = total
        self.per_client = per_client
        self.used = 0
        self.by_client: Counter[str] = Counter()
        self._stats = stats

    def refusal(self, client: str | None) -> Refused | None:
        """What `acquire` would refuse with now, or None. A client of None has no per-client cap."""
        if client is not None and self.by_client[client] >= self.per_client:
            return TooMany(self.name)
        if self.used >= self.total:
            return Busy(self.name)
        return None

    def acquire(self, client: str | None) -> Refused | None:
        """Take one unit for `client`; the refusal, untaken, if a cap is reached."""
        refusal = self.refusal(client)
        if refusal is None:
            self.used += 1
            if client is not None:
                self.by_client[client] += 1
            self._stats[f"open_{self.name}"] = self.used
        return refusal

    def release(self, client: str | None) -> None:
        self.used -= 1
        if client is not None:
            self.by_client[client] -= 1
            if self.by_client[client] <= 0:
                del self.by_client[client]
        self._stats[f"open_{self.name}"] = self.used
