"""The learner's broadcast plan: which peer each peer fetches each chunk from (stripe, then chain or tree).

    learner ──stripe 0──► p0 ─► p2 ─► p3 ─► p1        chunk i belongs to stripe i mod s;
            ──stripe 1──► p2 ─► p0 ─► p3 ─► p1        each peer fetches it from its predecessor

Chains suit small swarms: every peer uploads one copy, but a chunk crosses every hop, so the last of N
peers waits N chunk times, and the chain runs at its slowest uplink. Past `TREE_FROM` receivers the
plan is a tree per stripe (`TreeLayout`): one ranked list of the peers, stripe i a rotation of it read
as a heap of fan-out f (position p's parent is position (p - 1) // f, position 0's the learner). The
first ceil((n - 1) / f) positions of each rotation are the stripe's interior, f children each; the
rotations make the s interior sets disjoint (f >= s), so each interior peer forwards one stripe f times
(f / s copies of the version) and every other peer only receives: a version crosses log_f(n) hops, and
the peers with the fastest claimed uplinks, proven ones first, carry it.

    ranked a b c d e ..., s = 2, f = 4: order a c b d e ...; stripe 0: a ─► c b d e, c ─► ...; stripe 1: b ─► d e ...

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
tier), so no fresh key claiming an uncapped uplink heads a chain ahead of a delivering peer. A plan
covers at most MAX_PLAN_ENTRIES / seeds peers (far below MAX_PLAN_BYTES); the followers it leaves out
(those, newcomers past MAX_UNPROVEN, late joiners) fetch from two planned peers, their `fosters`. The plan is a hint, signed by the policy key so that nobody
else can steer the swarm's traffic; fetchers keep asking a parent that has not begun the version yet
(`fetcher.ParentPatience`, up to fetch.source_wait_s: it saw the head a moment after its child), fall
back to any holder (learner last) when their parent is slow, gone or lying.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel, ConfigDict, Field, PrivateAttr, SerializerFunctionWrapHandler, ValidationError, model_serializer,
    model_validator,
)

from echo2swarm.wire.records import MAX_VERSION, PeerCard
from echo2swarm.wire.signing import DOMAIN_PLAN, PolicyKey, PublicKey, canonical_bytes

MAX_PLAN_BYTES = 256 * 1024
MAX_PLAN_ENTRIES = 4096  # peer ids in a plan (stripes x peers for chains); at ~55 bytes each under MAX_PLAN_BYTES
MAX_FANOUT = 64
TREE_FROM = 64  # receivers from which `make_plan(shape="auto")` plans trees instead of chains
UNCAPPED_BPS = 1.25e9  # what a card without an upload cap counts for when interior peers are chosen (10 Gbit/s)
UNPROVEN_SHARE = 0.25  # the share of its claimed uplink a peer not seen working counts for there
MAX_UNPROVEN = 32  # followers never seen doing work that a plan covers (relays, newcomers, fakes)
FOSTERS = 2  # planned peers a follower the plan does not place fetches from (`BroadcastPlan.fosters`)
_PEER_ID = r"^[1-9A-HJ-NP-Za-km-z]{20,128}$"


class PlanError(ValueError):
    pass


class TreeLayout(BaseModel):
    """Stripe trees over one ranked list (module docstring): stripe i is `order` rotated by i x the
    interior size, read as a heap of fan-out `fanout`."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    order: list[Annotated[str, Field(pattern=_PEER_ID)]] = Field(min_length=1, max_length=MAX_PLAN_ENTRIES)
    stripes: int = Field(ge=1, le=16)
    fanout: int = Field(ge=2, le=MAX_FANOUT)

    @property
    def interior(self) -> int:
        """Positions with children in each stripe's heap."""
        return max(1, math.ceil((len(self.order) - 1) / self.fanout))

    def offset(self, stripe: int) -> int:
        return stripe * self.interior % len(self.order)


class BroadcastPlan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    format: Literal["echo2swarm-plan/1"] = "echo2swarm-plan/1"
    swarm: str = Field(max_length=64)
    version: int = Field(ge=1, le=MAX_VERSION)
    publisher: str = Field(pattern=_PEER_ID)
    stripes: list[list[Annotated[str, Field(pattern=_PEER_ID)]]] = Field(max_length=16)
    # Trees instead of chains (then `stripes` is empty). Absent from the record and the signed bytes when
    # null: a chain plan is the record daemons before trees existed sign and read.
    tree: TreeLayout | None = None
    public_key: str = Field(max_length=80)
    signature: str = Field("", pattern=r"^([0-9a-f]{128})?$")
    _index: dict[str, int] | None = PrivateAttr(None)
    _placed: frozenset[str] | None = PrivateAttr(None)  # every chain's peers, for `places`
    _fostered: dict[tuple[str, int], list[str]] = PrivateAttr(default_factory=dict)  # `fosters`, asked per chunk

    @model_validator(mode="after")
    def _one_shape(self) -> "BroadcastPlan":
        if self.tree is not None and self.stripes:
            raise ValueError("a plan has chains (stripes) or a tree, not both")
        return self

    @model_serializer(mode="wrap")
    def _without_tree(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out = handler(self)
        if out.get("tree") is None:
            out.pop("tree", None)
        return out

    def _payload(self) -> bytes:
        return canonical_bytes(self.model_dump(mode="json", exclude={"signature"}))

    @property
    def stripe_count(self) -> int:
        return self.tree.stripes if self.tree is not None else len(self.stripes)

    def places(self, peer_id: str) -> bool:
        """Whether the plan names `peer_id` (a fetcher it does not place uses its `fosters`, then holders)."""
        if self.tree is not None:
            return peer_id in self._positions()
        if self._placed is None:
            self._placed = frozenset(p for chain in self.stripes for p in chain)
        return peer_id in self._placed

    def _positions(self) -> dict[str, int]:
        if self._index is None:
            assert self.tree is not None
            self._index = {peer: i for i, peer in enumerate(self.tree.order)}
        return self._index

    def _tree_parent(self, index: int, stripe: int) -> int | None:
        """The `order` index of the tree parent of the peer at `order` index `index` (None: the publisher)."""
        tree = self.tree
        assert tree is not None
        n, base = len(tree.order), tree.offset(stripe)
        position = (index - base) % n
        return None if position == 0 else (base + (position - 1) // tree.fanout) % n

    def parent(self, peer_id: str, chunk_index: int) -> str | None:
        """Whom `peer_id` should fetch chunk `chunk_index` from: a peer, the publisher, or None (not in the plan)."""
        if self.tree is not None:
            index = self._positions().get(peer_id)
            if index is None:
                return None
            up = self._tree_parent(index, chunk_index % self.tree.stripes)
            return self.publisher if up is None else self.tree.order[up]
        if not self.stripes:
            return None
        chain = self.stripes[chunk_index % len(self.stripes)]
        try:
            position = chain.index(peer_id)
        except ValueError:
            return None
        return self.publisher if position == 0 else chain[position - 1]

    def fosters(self, peer_id: str, count: int = FOSTERS) -> list[str]:
        """The planned peers a follower the plan does not place fetches from before any other source (its
        foster parents): `count` of them, drawn by a hash of its peer id and the version (so the followers
        left out spread over the plan, and over time), from the peers with no planned upload when there
        are any (a tree's leaves), else from all. Empty for a peer the plan places, or an empty plan.

        Left out are followers past the plan's bounds: never seen working beyond MAX_UNPROVEN, past
        MAX_PLAN_ENTRIES, or joined after the plan was made. Without foster parents they took the version
        from the learner whenever no follower held all of it yet, one upload more of its scarce uplink each."""
        known = self._fostered.get((peer_id, count))
        if known is not None:
            return list(known)
        if self.tree is not None:
            order, interior = self.tree.order, self.tree.stripes * self.tree.interior
            spare = order[interior:] or order
        else:
            spare = self.stripes[0] if self.stripes else []
        out: list[str] = []
        if spare and not self.places(peer_id):
            seed = int.from_bytes(hashlib.sha256(f"{peer_id}/{self.version}".encode()).digest()[:8], "big")
            step = max(1, len(spare) // max(1, count))
            out = list(dict.fromkeys(spare[(seed + k * step) % len(spare)] for k in range(min(count, len(spare)))))
        if len(self._fostered) < 64:  # a follower asks for itself; the simulator for thousands, once each
            self._fostered[(peer_id, count)] = out
        return list(out)

    def edges(self) -> list[list[tuple[str, str | None]]]:
        """Per stripe, (peer, its parent or None for the publisher), every parent before its children."""
        if self.tree is None:
            return [[(peer, chain[k - 1] if k else None) for k, peer in enumerate(chain)] for chain in self.stripes]
        tree, out = self.tree, []
        n = len(tree.order)
        for stripe in range(tree.stripes):
            base = tree.offset(stripe)
            rows = []
            for position in range(n):
                index = (base + position) % n
                up = self._tree_parent(index, stripe)
                rows.append((tree.order[index], None if up is None else tree.order[up]))
            out.append(rows)
        return out

    def upstream(self, peer_id: str, depth: int) -> list[str]:
        """The peers before `peer_id` in its chains, at most `depth` a chain, nearest first, the publisher
        left out: its parents, and those it falls back on when a parent fails (they hold the version
        before it does). Empty when `peer_id` is not in the plan."""
        if self.tree is not None:
            return self._tree_upstream(peer_id, depth)
        placed = [(chain, chain.index(peer_id)) for chain in self.stripes if peer_id in chain]
        out: dict[str, None] = {}
        for hop in range(1, depth + 1):
            for chain, position in placed:
                if position >= hop:
                    out.setdefault(chain[position - hop])
        return list(out)

    def _tree_upstream(self, peer_id: str, depth: int) -> list[str]:
        assert self.tree is not None
        index = self._positions().get(peer_id)
        if index is None:
            return []
        out: dict[str, None] = {}
        cursors: list[int | None] = [index] * self.tree.stripes
        for _ in range(depth):
            for stripe, at in enumerate(cursors):
                up = None if at is None else self._tree_parent(at, stripe)
                cursors[stripe] = up
                if up is not None and self.tree.order[up] != peer_id:
                    out.setdefault(self.tree.order[up])
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
    therefore left out of the plan; it fetches from its foster parents (`fosters`), holders and the learner,
    as late joiners do.
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


def plan_tree(receivers: Sequence[tuple[str, int | None]], seeds: int, undialable: Collection[str] = (),
              nat: Mapping[str, NatPeer] | None = None, proven: Collection[str] | None = None) -> TreeLayout | None:
    """Stripe trees over `receivers` (module docstring); None when no receiver is dialable.

    Interior peers are ranked by NAT tier (public, hole-punching, relayed: children dial their parent),
    then by the uplink they count for: a peer in `proven` its claim (`UNCAPPED_BPS` without a cap),
    any other only `UNPROVEN_SHARE` of the cap it claims, and nothing without one (identities and
    claims are free; the broadcast tracker leaves peers that did not report a version they were
    planned for out of `receivers`' interior for a while: learner/broadcast_tracker.py). The fan-out f (a
    multiple of the stripes, at most `MAX_FANOUT`) is the one whose interior's slowest member
    forwards its f / s copies soonest: a swarm of equal uplinks gets f = s, one with few fast peers
    a wide fan-out over them. The leaves follow, peers seen working first, so a plan cut at
    MAX_PLAN_ENTRIES keeps them.
    """
    nat = dict(nat or {})
    undialable = set(undialable) | {p for p, n in nat.items() if not n.relays and not n.holepunch}
    receivers = [r for r in receivers if r[0] not in undialable]
    if not receivers:
        return None
    stripes = max(1, min(seeds, 16, len(receivers)))

    def counts(r: tuple[str, int | None]) -> float:
        peer, bps = r
        if proven is None or peer in proven:
            return max(float(bps) if bps is not None else UNCAPPED_BPS, 1.0)
        return max(float(bps or 0) * UNPROVEN_SHARE, 1.0)  # no cap claimed: nothing to count on

    tier = {p: 0 if p not in nat else 1 if nat[p].holepunch else 2 for p, _ in receivers}
    unproven = {p: proven is not None and p not in proven for p, _ in receivers}
    ranked = sorted(receivers, key=lambda r: (tier[r[0]], -counts(r), unproven[r[0]], r[0]))
    n = min(len(ranked), MAX_PLAN_ENTRIES)
    best: tuple[float, int] | None = None
    for fanout in range(max(2, stripes), MAX_FANOUT + 1, stripes):
        interior = ranked[: min(n, stripes * max(1, math.ceil((n - 1) / fanout)))]
        cost = fanout / min(counts(r) for r in interior)  # seconds per byte of a stripe, the slowest interior peer
        if best is None or cost < best[0] * 0.999:
            best = (cost, fanout)
    assert best is not None
    fanout = best[1]
    want = stripes * max(1, math.ceil((n - 1) / fanout))
    size = min(n, want)
    interior = [p for p, _ in ranked[:size]]
    rest = sorted(ranked[size:], key=lambda r: (unproven[r[0]], tier[r[0]], -counts(r), r[0]))
    if size == want:
        # Stripe i's interior is the i-th block of `order`: deal the ranked interior out in turn, so every
        # stripe gets a like share of fast and slower interior peers, the fastest of each nearest its root.
        interior = [p for i in range(stripes) for p in interior[i::stripes]]
    # else a handful of peers: the stripes' interiors overlap (one peer forwards two stripes)
    order = (interior + [p for p, _ in rest])[:MAX_PLAN_ENTRIES]
    return TreeLayout(order=order, stripes=stripes, fanout=fanout)


def make_plan(
    key: PolicyKey, swarm: str, version: int, publisher: str,
    receivers: Sequence[tuple[str, int | None]], seeds: int, undialable: Collection[str] = (),
    nat: Mapping[str, NatPeer] | None = None, proven: Collection[str] | None = None,
    shape: Literal["auto", "chains", "trees"] = "auto",
) -> BroadcastPlan:
    """A signed plan: chains (`plan_chains`), or trees (`plan_tree`) for `shape` trees, and for auto
    from TREE_FROM receivers on."""
    trees = shape == "trees" or (shape == "auto" and len(receivers) >= TREE_FROM)
    layout = plan_tree(receivers, seeds, undialable, nat, proven) if trees else None
    plan = BroadcastPlan(
        swarm=swarm, version=version, publisher=publisher,
        stripes=[] if layout is not None else plan_chains(receivers, seeds, undialable, nat, proven),
        tree=layout, public_key=key.public.text,
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
    if plan.tree is not None and len(set(plan.tree.order)) != len(plan.tree.order):
        raise PlanError("a plan tree lists a peer twice")
    return plan
