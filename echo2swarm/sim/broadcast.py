"""How a version spreads through the modelled swarm under the learner's real broadcast plan.

    plan_chains (policy/broadcast_plan.py) over every follower: `seeds` stripes, each a chain
    stripe i, peer k of its chain: rate r_k = min(parent up / s, own down / s), and at most
                 relay_bps through a relay when the edge is not direct (`direct_edge`)
                 arrival = Σ_{j ≤ k} (chunk / r_j + rtt_j) + (stripe bytes − chunk) / min_{j ≤ k} r_j
                 (store and forward a chunk a hop, the rest pipelined behind the slowest hop so far)
    a peer holds the version when the last of its stripes arrives
    a peer the plan leaves out (past MAX_PLAN_ENTRIES / seeds, `private`, or, as a what-if, an uplink under
                 `plan_min_up_bps`) fetches the whole version
                 from one holder in the plan, picked at random, once that one holds it; a holder's
                 uplink is shared among the peers that picked it
    churn: a parent that leaves during the version (probability churn/h x its arrival) costs each of
                 its children fetch.source_wait_s before it goes around it

The learner uploads one stripe to the head of each chain: one copy a version, whatever N.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from echo2swarm.policy.broadcast_plan import NatPeer, direct_edge, plan_chains
from echo2swarm.sim.population import Peer, fake_peer_id

LEARNER = "learner"


@dataclass
class Spread:
    arrival: dict[str, float]  # peer -> seconds from publication until it holds the version
    learner_bytes: float
    planned: int  # followers the plan placed
    stripes: int
    chain_length: int
    departed: int = 0
    chains: list[list[str]] = field(default_factory=list)


def _nat(peers: list[Peer], rng: random.Random) -> dict[str, NatPeer]:
    public = [p.peer_id for p in peers if p.nat is None] or [LEARNER]
    return {p.peer_id: NatPeer(relays=(rng.choice(public),), holepunch=p.nat == "holepunch") for p in peers if p.nat}


def spread(peers: list[Peer], version_bytes: float, chunk_bytes: float, learner_up_bps: float, seeds: int,
           relay_bps: float, source_wait_s: float, churn_per_hour: float, seed: int = 0,
           plan_min_up_bps: float = 0.0) -> Spread:
    """`plan_min_up_bps` (a what-if, not built: 0 is the plan as the learner makes it): only peers with at
    least this uplink are offered to the plan; the others fetch from holders like peers past its cap."""
    rng = random.Random(seed)
    by_id = {p.peer_id: p for p in peers}
    nat = _nat(peers, rng)
    receivers = [(p.peer_id, int(p.up_bps)) for p in peers if p.up_bps >= plan_min_up_bps]
    chains = plan_chains(receivers, seeds, nat=nat, proven=set(by_id))
    stripes = max(1, len(chains))
    stripe_bytes = version_bytes / stripes
    arrival: dict[str, float] = {}
    departed: set[str] = set()
    for chain in chains:
        latency, slowest = 0.0, float("inf")
        parent_up, parent_id, parent_rtt = learner_up_bps, LEARNER, 0.0
        for peer_id in chain:
            peer = by_id[peer_id]
            rate = min(parent_up / stripes, peer.down_bps / stripes)
            if parent_id != LEARNER and not direct_edge(parent_id, peer_id, nat):
                rate = min(rate, relay_bps)
            latency += min(chunk_bytes, stripe_bytes) / rate + max(parent_rtt, peer.rtt_s)
            if parent_id in departed:
                latency += source_wait_s
            slowest = min(slowest, rate)
            done = latency + max(0.0, stripe_bytes - chunk_bytes) / slowest
            arrival[peer_id] = max(arrival.get(peer_id, 0.0), done)
            if peer_id not in departed and rng.random() < churn_per_hour * done / 3600:
                departed.add(peer_id)
            parent_up, parent_id, parent_rtt = peer.up_bps, peer_id, peer.rtt_s
    planned = list(arrival)
    out = Spread(arrival, learner_bytes=stripe_bytes * len(chains), planned=len(planned), stripes=len(chains),
                 chain_length=max((len(c) for c in chains), default=0), departed=len(departed), chains=chains)
    rest = [p for p in peers if p.peer_id not in arrival]
    if rest and planned:
        picks = [rng.choice(planned) for _ in rest]
        load: dict[str, int] = {}
        for h in picks:
            load[h] = load.get(h, 0) + 1
        for peer, h in zip(rest, picks):
            holder = by_id[h]
            rate = min(peer.down_bps, holder.up_bps / load[h])
            if not direct_edge(h, peer.peer_id, nat):
                rate = min(rate, relay_bps)
            arrival[peer.peer_id] = arrival[h] + max(peer.rtt_s, holder.rtt_s) + version_bytes / rate
    elif rest:  # nobody planned (every follower private): each from the learner, sharing its uplink
        for peer in rest:
            arrival[peer.peer_id] = peer.rtt_s + version_bytes / min(peer.down_bps, learner_up_bps / len(rest))
        out.learner_bytes += version_bytes * len(rest)
    return out


def lab_broadcast(receivers: int, version_bytes: float, chunk_bytes: float, up_bps: float, down_bps: float,
                  seeds: int, *, star: bool = False, homes: int = 0, punching: int = 0, rtt_s: float = 0.0005,
                  relay_bps: float = float("inf")) -> float:
    """The model's T_bcast for bench_broadcast's swarms (the calibration of issue 35): `receivers` relays,
    every uplink (the learner's too) `up_bps`, downlinks `down_bps`; the last `homes` of them behind NAT,
    `punching` of those hole-punched. `star`: every relay from the learner alone (`--no-peer-assist`).
    Seconds from the head's publication until the last relay holds the version, plus a head and a
    manifest round trip."""
    peers = [Peer(fake_peer_id(i), "lab", down_bps, up_bps, rtt_s, 0.0, 0.0) for i in range(receivers)]
    for k, peer in enumerate(peers[receivers - homes:]):
        peer.nat = "holepunch" if k < punching else "relayed"
    overhead = 2 * rtt_s
    if star:
        return overhead + max(p.rtt_s + version_bytes / min(p.down_bps, up_bps / receivers) for p in peers)
    version = spread(peers, version_bytes, chunk_bytes, up_bps, seeds, relay_bps, source_wait_s=10.0,
                     churn_per_hour=0.0)
    return overhead + max(version.arrival.values())


__all__ = ["LEARNER", "Spread", "lab_broadcast", "spread"]
