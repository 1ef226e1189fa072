"""Who this node saw doing work, and the roster a daemon signs of it (wire/records.py `RosterRecord`).

    evidence ── Overlay.saw_work(peer, kind) ──► WorkLog (newest per peer; 4·max_cards peers, 3 TTLs)
        "delivered": groups the learner's intake accepted from that peer (learner/broadcast_tracker.py)
        "served":    chunks from that peer that verified against a signed manifest
        "asked":     it asked for work (an RPC we answered): noted apart, never counted as work
    WorkLog.entries() ──► signed_roster(): delivered first, newest first, ≤ MAX_ROSTER_PEERS and
        MAX_RECORD_BYTES ──► stored under <swarm>/roster/<our peer id> (Overlay.store_roster)
    Overlay.get_cards ──► reads, by their own keys and before anyone else's, the cards of the peers
        it saw working and of the peers on the rosters of the peers it trusts (head publishers)

Identities are free, so nothing a peer says of itself makes it "working": only what this node (or
the learner whose roster it reads) observed. A flood of fresh keys that ask for work fills the
"asked" list, which is bounded apart and read after every working peer, so it evicts none.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Collection

from hivemind.utils.serializer import MSGPackSerializer

from echo2swarm.wire.peer_keys import PeerKey
from echo2swarm.wire.records import MAX_RECORD_BYTES, MAX_ROSTER_PEERS, RosterEntry, RosterRecord

WORK_KINDS = ("delivered", "served")  # evidence of work, strongest first
ASKED = "asked"


class WorkLog:
    """Peers seen doing work here lately, newest evidence last; bounded in count and age.

    >>> log = WorkLog(capacity=1024, horizon_s=90.0)
    >>> log.saw("12D3KooW...", "delivered")
    >>> log.worked()                     # newest first
    ['12D3KooW...']
    """

    def __init__(self, capacity: int, horizon_s: float, clock: Callable[[], float] = time.monotonic):
        self.capacity = capacity
        self.horizon_s = horizon_s
        self.clock = clock
        self._work: OrderedDict[str, dict[str, float]] = OrderedDict()  # peer -> kind -> clock() last seen
        self._asked: OrderedDict[str, float] = OrderedDict()

    def saw(self, peer_id: str, kind: str) -> None:
        now = self.clock()
        if kind == ASKED:
            self._asked[peer_id] = now
            self._asked.move_to_end(peer_id)
        elif kind in WORK_KINDS:
            self._work.setdefault(peer_id, {})[kind] = now
            self._work.move_to_end(peer_id)
        else:
            raise ValueError(f"unknown kind of work {kind!r}")
        self._trim(now)

    def forget(self, peer_id: str) -> None:
        self._work.pop(peer_id, None)
        self._asked.pop(peer_id, None)

    def _trim(self, now: float) -> None:
        horizon = now - self.horizon_s
        while self._work and (len(self._work) > self.capacity or max(next(iter(self._work.values())).values()) < horizon):
            self._work.popitem(last=False)
        while self._asked and (len(self._asked) > self.capacity or next(iter(self._asked.values())) < horizon):
            self._asked.popitem(last=False)

    def worked(self) -> list[str]:
        """Peers with evidence of work within the horizon, newest first."""
        self._trim(self.clock())
        return list(reversed(self._work))

    def asked(self) -> list[str]:
        """Peers that only asked for work within the horizon, newest first."""
        self._trim(self.clock())
        return [p for p in reversed(self._asked) if p not in self._work]

    def kinds(self, peer_id: str) -> list[str]:
        return [k for k in WORK_KINDS if k in self._work.get(peer_id, {})]

    def entries(self, exclude: Collection[str] = (), now_ms: int | None = None) -> list[RosterEntry]:
        """What a roster lists: peers that delivered, then the others, each newest first, at most MAX_ROSTER_PEERS."""
        now, now_ms = self.clock(), int(time.time() * 1000) if now_ms is None else now_ms
        self._trim(now)
        rows = [(peer, seen) for peer, seen in self._work.items() if peer not in exclude]
        rows.sort(key=lambda r: ("delivered" not in r[1], -max(r[1].values())))
        return [RosterEntry(peer_id=peer, work=[k for k in WORK_KINDS if k in seen],
                            seen_ms=max(0, now_ms - int((now - max(seen.values())) * 1000)))
                for peer, seen in rows[:MAX_ROSTER_PEERS]]


def signed_roster(key: PeerKey, swarm: str, entries: list[RosterEntry], ttl_s: float) -> RosterRecord:
    """`entries` as a roster signed by `key`, alive `ttl_s`; the last entries are dropped until it fits
    MAX_RECORD_BYTES (long peer ids or an RSA signer's key could overflow it at MAX_ROSTER_PEERS)."""
    while True:
        roster = RosterRecord(peer_id=key.peer_id, peers=entries, updated_ms=int(time.time() * 1000)).signed(
            key, swarm, ttl_s)
        if len(MSGPackSerializer.dumps(roster.model_dump(mode="json"))) <= MAX_RECORD_BYTES or not entries:
            return roster
        entries = entries[: len(entries) * 7 // 8]


__all__ = ["ASKED", "WORK_KINDS", "WorkLog", "signed_roster"]
