"""Which rollout peers the learner still deals with, and how much work each may hold.

    intake: lease request ─► ledger.allowance(peer) ─► at most that many prompts (0: banned or capped)
            group refused for a lie ─► ledger.strike(peer, reason)   ─┐
            lease lapsed undelivered ─► ledger.lapsed(peer)           ├─► banned for the run past a threshold
    trainer: group failed verification ─► ledger.strike(peer, ...)  ─┤
            a per-peer test crossed ─► ledger.strike(peer, ..., conclusive=True)  (learner/evidence.py) ─┘
            groups delivered ─► ledger.delivered(peer, n)  (resets the lapse count)
            groups trained and not refused ─► ledger.verified(peer, n)  (graduation ends probation)

Every peer-supplied claim is a claim until the peer delivers: a peer that never delivered gets
only `probation_prompts` in flight, and a peer stays on probation until `graduate_after_groups` of
its groups passed the trainer's verification; the intake leases to peers on probation only from a
pool all of them share, so no number of fresh identities takes work from graduated peers. Prompts a peer took in the last `window_s` and did not deliver
are capped too, so a client that polls for leases and never submits holds a bounded share of the
work, and is banned after `ban_after_lapsed_leases` leases in a row lapse. Memory is bounded: at
most `max_tracked_peers` peers are tracked (the least recently seen unbanned one is forgotten
first) and at most as many bans are kept.

Pure logic with the clock passed in, so every rule is unit-tested (tests/unit/learner/test_accountability.py).
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

from echo2swarm.config.rl import PeersConfig
from echo2swarm.runtime.logging import get_logger

logger = get_logger(__name__)

# Refusals that an honest peer running our protocol never causes: each one is a strike.
# Not here: stale_version, duplicate and unknown_lease (a slow honest peer's lease may have lapsed
# and been re-issued), which cost the peer nothing but the work.
VIOLATIONS = frozenset({
    "foreign_lease", "unknown_prompt", "future_version", "bad_group_size", "bad_shape", "too_long", "bad_token",
    "bad_logprob", "bad_finish", "undecodable", "malformed",
})


@dataclass
class PeerRecord:
    delivered_groups: int = 0
    verified_groups: int = 0  # delivered and passed the trainer's verification
    lapsed_in_a_row: int = 0
    strikes: Counter[str] = field(default_factory=Counter)
    taken: deque[tuple[float, int]] = field(default_factory=deque)  # (when, prompts) issued, within the window
    returned: deque[tuple[float, int]] = field(default_factory=deque)  # (when, groups) delivered, within the window


@dataclass(frozen=True)
class Ban:
    reason: str
    at: float


class PeerLedger:
    """
    >>> ledger = PeerLedger(PeersConfig())
    >>> ledger.allowance("12D3...", want=8, open_leases=0, now=0.0)     # a newcomer: probation
    2
    """

    def __init__(self, config: PeersConfig):
        self.config = config
        self.peers: OrderedDict[str, PeerRecord] = OrderedDict()
        self.bans: OrderedDict[str, Ban] = OrderedDict()
        self.stats: Counter[str] = Counter()

    # -- queries -------------------------------------------------------------------------------
    def banned(self, peer: str) -> Ban | None:
        return self.bans.get(peer)

    def on_probation(self, peer: str) -> bool:
        """Not yet graduated: fewer than `graduate_after_groups` verified groups (always False when off)."""
        if not self.config.enabled:
            return False
        record = self.peers.get(peer)
        return record is None or record.verified_groups < self.config.graduate_after_groups

    def allowance(self, peer: str, want: int, open_leases: int, now: float) -> int:
        """How many of the `want` prompts `peer` may take now (0: none), given its `open_leases`."""
        if not self.config.enabled:
            return want
        if peer in self.bans:
            return 0
        record = self._record(peer)
        if open_leases >= self.config.max_open_leases:
            self.stats["capped_open_leases"] += 1
            return 0
        self._trim(record, now)
        undelivered = sum(n for _, n in record.taken) - sum(n for _, n in record.returned)
        room = self.config.max_undelivered_prompts - undelivered
        if record.delivered_groups == 0:
            room = min(room, self.config.probation_prompts - undelivered)
        if room <= 0:
            self.stats["capped_undelivered" if record.delivered_groups else "capped_probation"] += 1
            return 0
        return min(want, room)

    # -- events --------------------------------------------------------------------------------
    def issued(self, peer: str, prompts: int, now: float) -> None:
        self._record(peer).taken.append((now, prompts))

    def delivered(self, peer: str, groups: int, now: float) -> None:
        record = self._record(peer)
        record.delivered_groups += groups
        record.lapsed_in_a_row = 0
        record.returned.append((now, groups))

    def verified(self, peer: str, groups: int) -> None:
        """`groups` of `peer` passed verification and trained: what graduation counts."""
        if peer in self.bans:
            return
        record = self._record(peer)
        was = record.verified_groups < self.config.graduate_after_groups
        record.verified_groups += groups
        if was and record.verified_groups >= self.config.graduate_after_groups:
            self.stats["graduated"] += 1

    def lapsed(self, peer: str, now: float) -> Ban | None:
        """A lease of `peer` expired with prompts still open."""
        if peer in self.bans or not self.config.enabled:
            return None
        record = self._record(peer)
        record.lapsed_in_a_row += 1
        self.stats["lapsed_leases"] += 1
        if record.lapsed_in_a_row >= self.config.ban_after_lapsed_leases:
            return self._ban(peer, f"{record.lapsed_in_a_row} leases in a row lapsed undelivered", now)
        return None

    def strike(self, peer: str, reason: str, now: float, *, conclusive: bool = False) -> Ban | None:
        """`peer` sent something an honest peer never sends; returns the ban if this strike tipped it.
        ``conclusive``: the strike bans at once (a per-peer test that already weighed many groups)."""
        if peer in self.bans or not self.config.enabled:
            return None
        record = self._record(peer)
        record.strikes[reason] += 1
        self.stats[f"strike_{reason}"] += 1
        verification = reason.startswith("verify_")  # found by the trainer, not a protocol violation
        count = sum(n for r, n in record.strikes.items() if r.startswith("verify_") == verification)
        limit = self.config.ban_after_verify_failures if verification else self.config.ban_after_violations
        if conclusive:
            return self._ban(peer, f"{reason} ({record.strikes[reason]}x)", now)
        if count >= limit:
            return self._ban(peer, f"{reason} ({count}x)", now)
        return None

    # -- internals -----------------------------------------------------------------------------
    def _ban(self, peer: str, reason: str, now: float) -> Ban:
        ban = Ban(reason=reason[:120], at=now)
        self.bans[peer] = ban
        self.peers.pop(peer, None)
        self.stats["bans"] += 1
        while len(self.bans) > self.config.max_tracked_peers:
            self.bans.popitem(last=False)
            self.stats["bans_forgotten"] += 1
        logger.warning("banned peer %s for the run: %s", peer, ban.reason)
        return ban

    def _record(self, peer: str) -> PeerRecord:
        record = self.peers.get(peer)
        if record is None:
            record = self.peers[peer] = PeerRecord()
            while len(self.peers) > self.config.max_tracked_peers:
                self.peers.popitem(last=False)
                self.stats["peers_forgotten"] += 1
        else:
            self.peers.move_to_end(peer)
        return record

    def _trim(self, record: PeerRecord, now: float) -> None:
        horizon = now - self.config.window_s
        for events in (record.taken, record.returned):
            while events and events[0][0] < horizon:
                events.popleft()

    def snapshot(self) -> dict[str, object]:
        return {
            "tracked": len(self.peers),
            "probation": sum(1 for r in self.peers.values() if r.verified_groups < self.config.graduate_after_groups),
            "banned": {peer: ban.reason for peer, ban in list(self.bans.items())[-64:]},
            **dict(self.stats),
        }
