"""The learner's broadcast plan: which peer each peer fetches each chunk from (stripe, then chain).

    learner ──stripe 0──► p0 ─► p2 ─► p3 ─► p1        chunk i belongs to stripe i mod s;
            ──stripe 1──► p2 ─► p0 ─► p3 ─► p1        each peer fetches it from its predecessor

The learner uploads every chunk once, to the head of its stripe's chain (`publish.seeds` stripes);
each peer forwards what it has verified to the next one while still fetching the rest, so the
learner's uplink stays near one model's worth per version however many peers there are, and a
version reaches the last peer about (M + depth·chunk)/B after publication instead of N·M/B.

Behind NAT (the cards' `reachability` and `holepunch`): a fetcher dials its parent, so an edge is direct
when the parent is public, or when both ends hole-punch (a NAT'd parent that punches also reaches a
public child directly); any other edge into a NAT'd parent runs through its circuit relay, and the
relay uploads that share too. Chains therefore run public peers, then NAT'd peers that hole-punch,
then the others (whose outgoing edges are the relayed ones); public peers are ranked by their uplink
shared with the relayed edges they carry (`relay_load`), so a busy relay is not also an early parent.
A `private` peer (no relay slot yet) is nobody's parent: nobody can reach it.

Chains are ordered by advertised upload bandwidth, fastest first: every peer but the last uploads
the stripe once, so the slowest uplinks go to the tail where they upload nothing. Peers without a
cap (`upload_bps` null) count as fastest. Uplinks are claims, and identities are free: given the
peers the learner saw doing work (`proven`), every other peer comes after them (within its NAT
tier), so no fresh key claiming an uncapped uplink heads a chain ahead of a delivering peer. A plan covers at most MAX_PLAN_ENTRIES / seeds peers (the fastest),
which keeps it far below MAX_PLAN_BYTES; the rest fetch from holders. The plan is a hint, signed by the policy key so that nobody
else can steer the swarm's traffic; fetchers keep asking a parent that has not begun the version yet
(`fetcher.ParentPatience`, up to fetch.source_wait_s: it saw the head a moment after its child), fall
back to any holder (learner last) when their parent is slow, gone or lying, and peers that joined
after publication use holders only.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from echo2swarm.wire.records import MAX_VERSION, PeerCard
from echo2swarm.wire.signing import DOMAIN_PLAN, PolicyKey, PublicKey, canonical_bytes

MAX_PLAN_BYTES = 256 * 1024
MAX_PLAN_ENTRIES = 4096  # stripes x peers; at ~55 bytes per peer id this stays under MAX_PLAN_BYTES
_PEER_ID = r"^[1-9A-HJ-NP-Za-km-z]{20,128}$"


class PlanError(ValueError):
    pass


class BroadcastPlan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    format: Literal["echo2swarm-plan/1"] = "echo2swarm-plan/1"
    swarm: str = Field(max_length=64)
    version: int = Field(ge=1, le=MAX_VERSION)
    publisher: str = Field(pattern=_PEER_ID)
    stripes: list[list[Annotated[str, Field(pattern=_PEER_ID)]]] = Field(max_length=16)
    public_key: str = Field(max_length=80)
    signature: str = Field("", pattern=r"^([0-9a-f]{128})?$")

    def _payload(self) -> bytes:
        return canonical_bytes(self.model_dump(mode="json", exclude={"signature"}))

    def parent(self, peer_id: str, chunk_index: int) -> str | None:
        """Whom `peer_id` should fetch chunk `chunk_index` from: a peer, the publisher, or None (not in the plan)."""
        if not self.stripes:
            return None
        chain = self.stripes[chunk_index % len(self.stripes)]
        try:
            position = chain.index(peer_id)
        except ValueError:
            return None
        return self.publisher if position == 0 else chain[position - 1]

    def upstream(self, peer_id: str, depth: int) -> list[str]:
        """The peers before `peer_id` in its chains, at most `depth` a chain, nearest first, the publisher
        left out: its parents, and those it falls back on when a parent fails (they hold the version
        before it does). Empty when `peer_id` is not in the plan."""
        placed = [(chain, chain.index(peer_id)) for chain in self.stripes if peer_id in chain]
        out: dict[str, None] = {}
        for hop in range(1, depth + 1):
            for chain, position in placed:
                if position >= hop:
                    out.setdefault(chain[position - hop])
        return list(out)

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()


@dataclass(frozen=True)
class NatPeer:
    """A receiver behind NAT as its card tells it: the relays its /p2p-circuit addresses go through (the
    first one listed is the one a fetcher's p2pd dials) and whether it holds hole-punched connections."""

    relays: tuple[str, ...] = ()
    holepunch: bool = False


def nat_peers(cards: Iterable[PeerCard]) -> dict[str, NatPeer]:
    """The receivers behind NAT among `cards` (relayed or private). Cards are peer-signed claims: a peer
    can only mislabel itself, and the worst a false `holepunch` buys it is being planned as a parent
    its children then reach through its relay (as before), or fall back from to holders."""
    out: dict[str, NatPeer] = {}
    for card in cards:
        if card.reachability not in ("relayed", "private"):
            continue
        relays = [m.split("/p2p/")[1].split("/", 1)[0] for m in card.maddrs
                  if "/p2p-circuit" in m and m.count("/p2p/") >= 1]
        out[card.peer_id] = NatPeer(relays=tuple(dict.fromkeys(relays))[:8], holepunch=bool(card.holepunch))
    return out


def direct_edge(parent: str, child: str, nat: Mapping[str, NatPeer]) -> bool:
    """Whether `child` fetching from `parent` gets a direct connection (else: through `parent`'s relay)."""
    up = nat.get(parent)
    if up is None:
        return True
    down = nat.get(child)
    return up.holepunch and (down is None or down.holepunch)


def relay_load(chains: Sequence[Sequence[str]], nat: Mapping[str, NatPeer]) -> dict[str, int]:
    """Stripes each peer uploads under `chains`: one per child it parents, plus one per relayed edge it
    carries as the parent's relay (peers that are not receivers, e.g. the bootstrap, appear too)."""
    load: dict[str, int] = {}
    for chain in chains:
        for parent, child in zip(chain, chain[1:]):
            load[parent] = load.get(parent, 0) + 1
            if not direct_edge(parent, child, nat):
                relay = nat[parent].relays[0] if nat[parent].relays else None
                if relay is not None:
                    load[relay] = load.get(relay, 0) + 1
    return load


def plan_chains(receivers: Sequence[tuple[str, int | None]], seeds: int,
                undialable: Collection[str] = (), nat: Mapping[str, NatPeer] | None = None,
                proven: Collection[str] | None = None) -> list[list[str]]:
    """Stripe chains over `receivers` (peer id, upload bytes/s or None), `seeds` heads at most;
    with `proven`, the receivers not in it after those in it (same NAT tier), each group by uplink.

    Every peer of a chain but the last is its successor's parent, and a parent must be dialable: a
    peer in `undialable` (behind NAT without a relay slot yet: its card says `private`) is
    therefore left out of the plan; it fetches from holders and the learner, as late joiners do.
    Relayed peers stay in: the chain's next peer dials them through their relay.

    >>> plan_chains([("a", 10), ("b", 30), ("c", None)], seeds=2)
    [['c', 'b', 'a'], ['b', 'c', 'a']]
    >>> plan_chains([("a", 10), ("b", 30), ("c", None)], seeds=2, undialable={"c"})
    [['b', 'a']]
    >>> plan_chains([("a", 10), ("b", 30), ("c", None)], seeds=2, proven={"a"})
    [['a', 'c', 'b'], ['c', 'a', 'b']]
    """
    nat = dict(nat or {})
    undialable = set(undialable) | {p for p, n in nat.items() if not n.relays and not n.holepunch}
    receivers = [r for r in receivers if r[0] not in undialable]
    # Public peers, then NAT'd peers that hole-punch, then the rest: the relayed edges come last.
    tier = {p: 0 if p not in nat else 1 if nat[p].holepunch else 2 for p, _ in receivers}
    if proven is not None:  # within a NAT tier, the peers seen working first
        tier = {p: 2 * t + (p not in proven) for p, t in tier.items()}
    chains = _chains(receivers, seeds, tier, {})
    if nat and chains:  # rank again with each uplink shared among what it relays under the first plan
        load = relay_load(chains, nat)
        relayed = {p: load.get(p, 0) - sum(1 for c in chains for a in c[:-1] if a == p) for p in load}
        chains = _chains(receivers, seeds, tier, {p: 1 + max(0, k) / len(chains) for p, k in relayed.items()})
    return chains


def _chains(receivers: Sequence[tuple[str, int | None]], seeds: int, tier: Mapping[str, int],
            share: Mapping[str, float]) -> list[list[str]]:
    # None is an uncapped uplink (the card's meaning): those peers go first, then capped ones, fastest first
    # (an uplink divided by `share`, the parts of it relayed edges take).
    def rank(r: tuple[str, int | None]) -> tuple[int, int, float, str]:
        peer, bps = r
        uncapped = bps is None and share.get(peer, 1.0) <= 1.0
        return (tier.get(peer, 0), 0 if uncapped else 1, -(bps if bps is not None else 1e18) / share.get(peer, 1.0), peer)

    order = [peer for peer, _ in sorted(receivers, key=rank)][: MAX_PLAN_ENTRIES // max(1, seeds)]
    if not order:
        return []
    # The tail uploads nothing; with as many stripes as peers it would also head one, so keep it out.
    heads = order[: max(1, min(seeds, len(order) - 1 if len(order) > 1 else 1))]
    return [[head] + [p for p in order if p != head] for head in heads]


def make_plan(
    key: PolicyKey, swarm: str, version: int, publisher: str,
    receivers: Sequence[tuple[str, int | None]], seeds: int, undialable: Collection[str] = (),
    nat: Mapping[str, NatPeer] | None = None, proven: Collection[str] | None = None,
) -> BroadcastPlan:
    plan = BroadcastPlan(
        swarm=swarm, version=version, publisher=publisher,
        stripes=plan_chains(receivers, seeds, undialable, nat, proven), public_key=key.public.text,
    )
    return plan.model_copy(update={"signature": key.sign(DOMAIN_PLAN, plan._payload()).hex()})


def verify_plan(data: bytes, *, trusted: PublicKey, swarm: str, version: int, publisher: str) -> BroadcastPlan:
    """Parse and check a plan's size, schema, signature and identity; PlanError says what is wrong."""
    if len(data) > MAX_PLAN_BYTES:
        raise PlanError(f"plan of {len(data)} bytes exceeds {MAX_PLAN_BYTES}")
    try:
        plan = BroadcastPlan.model_validate(json.loads(data))
    except (ValueError, ValidationError) as e:
        raise PlanError(f"malformed plan: {str(e)[:200]}") from None
    if plan.public_key != trusted.text:
        raise PlanError("plan is not signed by the trusted learner key")
    try:
        ok = trusted.verify(DOMAIN_PLAN, plan._payload(), bytes.fromhex(plan.signature))
    except ValueError:
        ok = False
    if not ok:
        raise PlanError("bad plan signature")
    if plan.swarm != swarm or plan.version != version or plan.publisher != publisher:
        raise PlanError(f"plan is for {plan.swarm}/v{plan.version} by {plan.publisher[-8:]}, not the head being fetched")
    for chain in plan.stripes:
        if len(chain) > 4096 or len(set(chain)) != len(chain):
            raise PlanError("a plan chain is too long or lists a peer twice")
    return plan
