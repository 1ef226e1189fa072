"""How a version spreads through the modelled swarm under the learner's real broadcast plan.

    make_plan's layout (policy/broadcast_plan.py: chains, or trees past TREE_FROM receivers) over every
    follower: `seeds` stripes; `BroadcastPlan.edges` gives each peer's parent in each stripe
    stripe i, a peer whose path from the learner is hops 1..k: rate r_j = min(parent up / the
                 parent's child edges over all stripes, own down / s), and at most relay_bps through
                 a relay when the edge is not direct (`direct_edge`)
                 arrival = Σ_{j ≤ k} (chunk / r_j + rtt_j) + (stripe bytes − chunk) / min_{j ≤ k} r_j
                 (store and forward a chunk a hop, the rest pipelined behind the slowest hop so far)
    a peer holds the version when the last of its stripes arrives
    a peer the plan leaves out (past MAX_PLAN_ENTRIES / seeds or MAX_UNPROVEN, `private`, or, as a what-if,
                 an uplink under `plan_min_up_bps`) fetches the whole version from its foster parents
                 (`BroadcastPlan.fosters`: planned peers, a tree's leaves), chunks in turn, once they hold
                 it; a foster's uplink is shared among the peers it fosters
    churn: a parent that leaves during the version (probability churn/h x its arrival) costs each of
                 its children fetch.source_wait_s before it goes around it

The learner uploads each stripe once, to its chain's head or tree's root: one copy a version, whatever N.
"""

from __future__ import annotations

import random
from collections.abc import Collection
from dataclasses import dataclass, field

from echo2swarm.policy.broadcast_plan import (
    MAX_UNPROVEN, TREE_FROM, BroadcastPlan, NatPeer, direct_edge, plan_chains, plan_tree,
)
from echo2swarm.sim.population import LEARNER_ID, Peer, fake_peer_id

LEARNER = "learner"


@dataclass
class Spread:
    arrival: dict[str, float]  # peer -> seconds from publication until it holds the version
    learner_bytes: float
    planned: int  # followers the plan placed
    stripes: int
    chain_length: int  # hops from the learner to the deepest peer
    departed: int = 0
    chains: list[list[str]] = field(default_factory=list)  # per stripe, the peers it places (parents first)
    plan: BroadcastPlan | None = None


def _depth(edges: list[list[tuple[str, str | None]]]) -> int:
    deepest = 0
    for rows in edges:
        hops: dict[str, int] = {}
        for peer, parent in rows:
            hops[peer] = 1 if parent is None else hops[parent] + 1
            deepest = max(deepest, hops[peer])
    return deepest


def _nat(peers: list[Peer], rng: random.Random) -> dict[str, NatPeer]:
    public = [p.peer_id for p in peers if p.nat is None] or [LEARNER]
    return {p.peer_id: NatPeer(relays=(rng.choice(public),), holepunch=p.nat == "holepunch") for p in peers if p.nat}


def spread(peers: list[Peer], version_bytes: float, chunk_bytes: float, learner_up_bps: float, seeds: int,
           relay_bps: float, source_wait_s: float, churn_per_hour: float, seed: int = 0,
           plan_min_up_bps: float = 0.0, shape: str = "auto", proven: Collection[str] | None = None) -> Spread:
    """`plan_min_up_bps` (a what-if, not built: 0 is the plan as the learner makes it): only peers with at
    least this uplink are offered to the plan; the others fetch from holders like peers past its cap.
    `shape`: make_plan's (auto: chains below TREE_FROM receivers, trees from there). `proven`: the peers
    the learner saw working (the active ones): the plan takes them and at most MAX_UNPROVEN others, as
    the broadcast tracker's `receivers()` does; None: every peer counts as proven and is planned."""
    rng = random.Random(seed)
    by_id = {p.peer_id: p for p in peers}
    nat = _nat(peers, rng)
    offered = [p for p in peers if p.up_bps >= plan_min_up_bps]
    if proven is not None:
        others = [p for p in offered if p.peer_id not in proven]
        offered = [p for p in offered if p.peer_id in proven] + rng.sample(others, min(MAX_UNPROVEN, len(others)))
    else:
        proven = set(by_id)
    receivers = [(p.peer_id, int(p.up_bps)) for p in offered]
    trees = shape == "trees" or (shape == "auto" and len(receivers) >= TREE_FROM)
    layout = plan_tree(receivers, seeds, nat=nat, proven=proven) if trees else None
    plan = BroadcastPlan(swarm="sim", version=1, publisher=LEARNER_ID, public_key="",
                         stripes=[] if layout is not None else plan_chains(receivers, seeds, nat=nat, proven=proven),
                         tree=layout)
    stripes = max(1, plan.stripe_count)
    stripe_bytes = version_bytes / stripes
    edges = plan.edges()
    load: dict[str | None, int] = {}
    for rows in edges:
        for _, parent in rows:
            load[parent] = load.get(parent, 0) + 1
    arrival: dict[str, float] = {}
    departed: set[str] = set()
    for rows in edges:
        path: dict[str, tuple[float, float]] = {}  # peer -> (latency so far, slowest rate so far)
        for peer_id, parent_id in rows:
            peer = by_id[peer_id]
            if parent_id is None:
                parent_up, parent_rtt, (latency, slowest) = learner_up_bps / load[None], 0.0, (0.0, float("inf"))
            else:
                parent = by_id[parent_id]
                parent_up, parent_rtt, (latency, slowest) = parent.up_bps / load[parent_id], parent.rtt_s, path[parent_id]
            rate = min(parent_up, peer.down_bps / stripes)
            if parent_id is not None and not direct_edge(parent_id, peer_id, nat):
                rate = min(rate, relay_bps)
            latency += min(chunk_bytes, stripe_bytes) / rate + max(parent_rtt, peer.rtt_s)
            if parent_id in departed:
                latency += source_wait_s
            slowest = min(slowest, rate)
            path[peer_id] = (latency, slowest)
            done = latency + max(0.0, stripe_bytes - chunk_bytes) / slowest
            arrival[peer_id] = max(arrival.get(peer_id, 0.0), done)
            if peer_id not in departed and rng.random() < churn_per_hour * done / 3600:
                departed.add(peer_id)
    chains = [[peer for peer, _ in rows] for rows in edges]
    planned = list(arrival)
    depth = _depth(edges)
    out = Spread(arrival, learner_bytes=stripe_bytes * load.get(None, 0), planned=len(planned), stripes=len(chains),
                 chain_length=depth, departed=len(departed), chains=chains, plan=plan)
    rest = [p for p in peers if p.peer_id not in arrival]
    if rest and planned:
        picks = [plan.fosters(p.peer_id) for p in rest]
        load: dict[str, int] = {}
        for fosters in picks:
            for h in fosters:
                load[h] = load.get(h, 0) + 1
        for peer, fosters in zip(rest, picks):
            # chunks in turn from each foster parent (`rates` add up), once the last of them holds the version
            rates = [holder.up_bps / load[h] if direct_edge(h, peer.peer_id, nat) else
                     min(holder.up_bps / load[h], relay_bps) for h, holder in ((h, by_id[h]) for h in fosters)]
            rate = min(peer.down_bps, sum(rates))
            arrival[peer.peer_id] = (max(arrival[h] for h in fosters) + max(peer.rtt_s, *(by_id[h].rtt_s for h in fosters))
                                     + version_bytes / rate)
    elif rest:  # nobody planned (every follower private): each from the learner, sharing its uplink
        for peer in rest:
            arrival[peer.peer_id] = peer.rtt_s + version_bytes / min(peer.down_bps, learner_up_bps / len(rest))
        out.learner_bytes += version_bytes * len(rest)
    return out


# A link the kernel shapes (tc tbf) counts every frame's bytes: of a full 1514-byte Ethernet frame of TCP
# (timestamps on) 1448 are payload. The WAN lab's links carry chunks at that share of their rate; the
# loopback bench's limiter counts payload bytes only.
FRAME_PAYLOAD = 1448 / 1514


def lab_broadcast(receivers: int, version_bytes: float, chunk_bytes: float, up_bps: float, down_bps: float,
                  seeds: int, *, star: bool = False, homes: int = 0, punching: int = 0, rtt_s: float = 0.0005,
                  relay_bps: float = float("inf"), payload_share: float = 1.0) -> float:
    """The model's T_bcast for bench_broadcast's swarms (the calibration of issue 35): `receivers` relays,
    every uplink (the learner's too) `up_bps`, downlinks `down_bps`, of which `payload_share` carries
    chunks (FRAME_PAYLOAD on kernel-shaped links); the last `homes` behind NAT, `punching` of those
    hole-punched. `star`: every relay from the learner alone (`--no-peer-assist`). Seconds from the
    head's publication until the last relay holds the version, plus a head and a manifest round trip."""
    up_bps, down_bps, relay_bps = up_bps * payload_share, down_bps * payload_share, relay_bps * payload_share
    peers = [Peer(fake_peer_id(i), "lab", down_bps, up_bps, rtt_s, 0.0, 0.0) for i in range(receivers)]
    for k, peer in enumerate(peers[receivers - homes:]):
        peer.nat = "holepunch" if k < punching else "relayed"
    overhead = 2 * rtt_s
    if star:
        return overhead + max(p.rtt_s + version_bytes / min(p.down_bps, up_bps / receivers) for p in peers)
    version = spread(peers, version_bytes, chunk_bytes, up_bps, seeds, relay_bps, source_wait_s=10.0,
                     churn_per_hour=0.0)
    return overhead + max(version.arrival.values())


__all__ = ["FRAME_PAYLOAD", "LEARNER", "Spread", "lab_broadcast", "spread"]
