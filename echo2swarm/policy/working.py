"""Peers seen working for this daemon lately: the ones a chunk server keeps its reserves for.

    learner's intake (accepted groups per peer: `watch`) ──────────┐
    chunk server (bytes an authenticated peer fetched: `fetched`) ─┴─► saw(peer) ─► peer in working, for ttl_s

An identity costs nothing, so a defence per identity (or per IP address) is no defence: whoever is
not seen doing work shares one budget, and the peers below hold the reserve. Seen working means
something this daemon checked itself, never a claim: the learner accepted groups the peer
delivered, or the peer (its requests signed by its libp2p key, policy/peer_auth.py) fetched from
here at least one whole version's worth of chunk bytes, which a follower that re-serves versions
does every few versions (a plan child gets 1/stripes of each version from each parent). A peer
stays working `ttl_s` after it was last seen at it; at most `max_peers` are remembered (the least
recently seen are forgotten first).

>>> working = WorkingPeers(ttl_s=300.0)
>>> working.watch(lambda: intake.delivered)     # learner: a peer whose count grew is seen working
>>> working.fetched("12D3...", 1 << 20, whole=8 << 20)
>>> "12D3..." in working
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping

MAX_PEERS = 4096
WATCH_EVERY_S = 1.0  # the watched counts are read at most this often (on a lookup)


class WorkingPeers:
    def __init__(self, ttl_s: float, stats: Counter[str] | None = None, clock: Callable[[], float] = time.monotonic,
                 max_peers: int = MAX_PEERS):
        self.ttl_s = ttl_s
        self.clock = clock
        self.max_peers = max_peers
        self._seen: OrderedDict[str, float] = OrderedDict()  # peer -> last seen working (clock), newest last
        self._fetched: OrderedDict[str, int] = OrderedDict()  # peer -> bytes fetched since last seen working
        self._watched: list[tuple[Callable[[], Mapping[str, int]], dict[str, int]]] = []
        self._watched_at = float("-inf")
        self.stats: Counter[str] = stats if stats is not None else Counter()  # working_seen_<how>

    def saw(self, peer_id: str, why: str = "work") -> None:
        """`peer_id` did work this daemon checked: it counts as working for `ttl_s` from now."""
        self._seen[peer_id] = self.clock()
        self._seen.move_to_end(peer_id)
        self.stats[f"working_seen_{why}"] += 1
        while len(self._seen) > self.max_peers:
            self._seen.popitem(last=False)

    def watch(self, counts: Callable[[], Mapping[str, int]]) -> None:
        """Counts of checked work per peer (the learner's accepted groups): a peer whose count grew is seen working."""
        self._watched.append((counts, {}))

    def fetched(self, peer_id: str, nbytes: int, whole: int) -> None:
        """An authenticated `peer_id` fetched `nbytes` of chunks from us; `whole`: one whole version's bytes
        (0: none held). Once its bytes since it was last seen working reach `whole`, it is seen working."""
        total = self._fetched.pop(peer_id, 0) + nbytes
        if whole > 0 and total >= whole:
            self.saw(peer_id, "fetch")
            total = 0
        self._fetched[peer_id] = total
        while len(self._fetched) > self.max_peers:
            self._fetched.popitem(last=False)

    def _read_watched(self) -> None:
        now = self.clock()
        if not self._watched or now - self._watched_at < WATCH_EVERY_S:
            return
        self._watched_at = now
        for counts, last in self._watched:
            for peer, n in list(counts().items()):
                if n > last.get(peer, 0):
                    self.saw(peer, "delivery")
                last[peer] = n  # as many peers as the counts hold (the intake's, one per delivering peer)

    def __contains__(self, peer_id: object) -> bool:
        self._read_watched()
        at = self._seen.get(peer_id) if isinstance(peer_id, str) else None
        return at is not None and self.clock() - at < self.ttl_s

    def __len__(self) -> int:
        self._read_watched()
        now = self.clock()
        return sum(1 for at in self._seen.values() if now - at < self.ttl_s)
