"""Leases: which prompts each rollout peer is working on, and whether what it sends back is acceptable.

Pure logic (no I/O, no clocks of its own: callers pass `now`), so every rule is unit-tested:
- prompts are handed out in order from a cursor; prompts of expired leases are re-issued first,
  never to a peer whose group for that prompt was thrown away (`requeue(..., not_to=peer)`);
- a lease is either from the in-flight budget or from the newcomers' pool (`newcomer`), counted apart;
- a group is accepted only from the peer that holds the lease, for a prompt still open in it,
  generated with a version inside [current - S, current], with the group size, lengths, token
  ids and logprobs the lease allowed; each refusal has a reason that is counted.
"""

from __future__ import annotations

import math
import secrets
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from echo2swarm.wire.work import GroupSubmission


@dataclass
class OpenLease:
    lease_id: str
    peer_id: str
    prompts: dict[str, int]  # prompt_id -> prompt index, still open
    deadline: float
    min_version: int
    issued_at: float
    newcomer: bool = False  # leased from the pool peers on probation share, outside the in-flight budget


@dataclass(frozen=True)
class GroupLimits:
    group_size: int
    max_new_tokens: int
    vocab_size: int
    eos_token_ids: frozenset[int]  # every id the model's generation config treats as end of sequence


class LeaseManager:
    """Hands out prompt indices and tracks them until a group comes back or the lease expires.

    >>> leases = LeaseManager(timeout_s=60, max_prompts=8)
    >>> lease = leases.issue("12D3...", 4, budget=16, min_version=3, now=0.0)
    >>> leases.check("12D3...", lease.lease_id, next(iter(lease.prompts)))   # None: acceptable
    """

    def __init__(self, timeout_s: float, max_prompts: int, cursor: int = 0, requeue: Iterable[int] = ()):
        self.timeout_s = timeout_s
        self.max_prompts = max_prompts
        self.cursor = cursor
        self.requeue: deque[int] = deque(requeue)
        self.avoid: dict[int, set[str]] = {}  # requeued prompt index -> peers it must not go back to
        self.open: dict[str, OpenLease] = {}
        self.stats: Counter[str] = Counter()
        self._done: set[tuple[str, str]] = set()  # (lease_id, prompt_id) completed, to tell duplicates apart

    def open_prompts(self, newcomer: bool | None = None) -> int:
        """Prompts open in leases: all, or only the newcomers' pool's (True) or the budget's (False)."""
        return sum(len(lease.prompts) for lease in self.open.values() if newcomer is None or lease.newcomer == newcomer)

    def put_back(self, indices: Iterable[int], not_to: str | None = None) -> None:
        """Re-issue these prompts first, never to `not_to` (whose group for them was thrown away)."""
        for i in indices:
            self.requeue.append(i)
            if not_to:
                self.avoid.setdefault(i, set()).add(not_to)

    def issue(self, peer_id: str, want: int, *, budget: int, min_version: int, now: float,
              prompt_id_of: Callable[[int], str] = lambda i: f"train:{i}", newcomer: bool = False) -> OpenLease | None:
        n = min(want, self.max_prompts, budget)
        if n <= 0:
            return None
        indices, passed = [], []
        while len(indices) < n and self.requeue:
            i = self.requeue.popleft()
            if peer_id in self.avoid.get(i, ()):
                passed.append(i)  # someone else's, in its place in the queue
                continue
            self.avoid.pop(i, None)
            indices.append(i)
            self.stats["reissued"] += 1
        self.requeue.extendleft(reversed(passed))
        while len(indices) < n:
            indices.append(self.cursor)
            self.cursor += 1
        lease = OpenLease(
            lease_id=secrets.token_hex(8),
            peer_id=peer_id,
            prompts={prompt_id_of(i): i for i in indices},
            deadline=now + self.timeout_s,
            min_version=min_version,
            issued_at=now,
            newcomer=newcomer,
        )
        self.open[lease.lease_id] = lease
        self.stats["leases"] += 1
        self.stats["prompts_issued"] += n
        return lease

    def _revoke(self, lease_ids: list[str], counter: str) -> list[OpenLease]:
        revoked = []
        for lid in lease_ids:
            lease = self.open.pop(lid)
            self.requeue.extend(sorted(lease.prompts.values()))
            revoked.append(lease)
            self.stats[counter] += 1
        return revoked

    def expire(self, now: float) -> list[OpenLease]:
        """Re-queue the open prompts of every lease past its deadline. Returns those leases."""
        return self._revoke([lid for lid, lease in self.open.items() if lease.deadline <= now], "leases_expired")

    def drop_peer(self, peer_id: str) -> int:
        """Re-queue at once everything a peer was working on (it left the swarm, or was banned). Returns the prompts."""
        revoked = self._revoke([lid for lid, lease in self.open.items() if lease.peer_id == peer_id], "leases_revoked")
        return sum(len(lease.prompts) for lease in revoked)

    def open_leases_of(self, peer_id: str) -> int:
        return sum(1 for lease in self.open.values() if lease.peer_id == peer_id)

    def check(self, peer_id: str, lease_id: str, prompt_id: str) -> str | None:
        lease = self.open.get(lease_id)
        if lease is None:
            return "duplicate" if (lease_id, prompt_id) in self._done else "unknown_lease"
        if lease.peer_id != peer_id:
            return "foreign_lease"
        if prompt_id not in lease.prompts:
            return "duplicate" if (lease_id, prompt_id) in self._done else "unknown_prompt"
        return None

    def complete(self, lease_id: str, prompt_id: str) -> int:
        """Close one prompt of a lease; returns its prompt index."""
        lease = self.open[lease_id]
        index = lease.prompts.pop(prompt_id)
        self._done.add((lease_id, prompt_id))
        if len(self._done) > 100_000:  # bounded memory; very old duplicates then read as unknown_lease
            self._done.clear()
        if not lease.prompts:
            del self.open[lease_id]
        self.stats["prompts_completed"] += 1
        return index

    def snapshot(self) -> dict:
        """What a checkpoint keeps: open prompts are re-issued after a restart."""
        pending = list(self.requeue) + sorted(i for lease in self.open.values() for i in lease.prompts.values())
        return {"cursor": self.cursor, "requeue": pending}


def check_group(
    sub: GroupSubmission, limits: GroupLimits, *, current_version: int, staleness: int, newest_published: int | None = None
) -> str | None:
    """Content rules for one submitted group; returns the refusal reason or None."""
    newest = current_version if newest_published is None else min(current_version, newest_published)
    if sub.version > newest:  # no peer can hold a version that was never published
        return "future_version"
    if current_version - sub.version > staleness:
        return "stale_version"
    if len(sub.completions) != limits.group_size:
        return "bad_group_size"
    for completion in sub.completions:
        ids, logprobs = completion.token_ids, completion.logprobs
        if not ids or len(ids) != len(logprobs):
            return "bad_shape"
        if len(ids) > limits.max_new_tokens:
            return "too_long"
        if any(t >= limits.vocab_size for t in ids):
            return "bad_token"
        if any(not math.isfinite(lp) or lp > 1e-4 for lp in logprobs):
            return "bad_logprob"
        if limits.eos_token_ids:
            ends_with_eos = ids[-1] in limits.eos_token_ids
            if (completion.finish_reason == "stop") != ends_with_eos or any(t in limits.eos_token_ids for t in ids[:-1]):
                return "bad_finish"
    return None

