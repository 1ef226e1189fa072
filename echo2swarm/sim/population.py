"""The modelled swarm: each rollout peer's links, NAT, price and rollouts/s, drawn from documented ranges.

Link classes (shares of the peers; every range log-uniform; assumptions, not measurements):

    class   share  down Mbit/s   up Mbit/s    RTT ms    price $/h   rollouts/s (8B)
    cloud   0.3    1000-10000    1000-10000   10-60     0.8-2.5     0.3-1.0
    fiber   0.3    300-1000      100-500      15-60     0.2-0.6     0.1-0.4
    cable   0.4    50-300        10-40        20-120    0.1-0.4     0.05-0.3

A share `nat_share` of the peers is behind NAT, home links first (cloud peers only when the share
exceeds the homes'); of those, `holepunch_share` hold hole-punched connections (their card's
`holepunch`), the rest are reached through a public peer's circuit relay at most `relay_bps` a circuit.
Rollouts/s scale with 8e9 / params (a model twice the size generates half as fast).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

MBIT = 1e6 / 8  # bytes/s in one Mbit/s


@dataclass(frozen=True)
class LinkClass:
    name: str
    share: float
    down_mbps: tuple[float, float]
    up_mbps: tuple[float, float]
    rtt_ms: tuple[float, float]
    price: tuple[float, float]
    mu_8b: tuple[float, float]


LINK_CLASSES = (
    LinkClass("cloud", 0.3, (1000, 10000), (1000, 10000), (10, 60), (0.8, 2.5), (0.3, 1.0)),
    LinkClass("fiber", 0.3, (300, 1000), (100, 500), (15, 60), (0.2, 0.6), (0.1, 0.4)),
    LinkClass("cable", 0.4, (50, 300), (10, 40), (20, 120), (0.1, 0.4), (0.05, 0.3)),
)


@dataclass
class Peer:
    peer_id: str
    link: str
    down_bps: float
    up_bps: float
    rtt_s: float
    price: float
    mu: float
    nat: str | None = None  # None: public; "holepunch" or "relayed"


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def fake_peer_id(i: int) -> str:
    """A base58-shaped id that passes the plan's pattern (what the real plan code needs), unique per i."""
    alphabet = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
    digits = ""
    n = i * 2654435761 % (58 ** 10) + 58 ** 9  # spread over ids, so sorted ids are not the draw order
    while n:
        n, r = divmod(n, 58)
        digits = alphabet[r] + digits
    return "12D3KooW" + digits.rjust(44, "1")


LEARNER_ID, BOOTSTRAP_ID = fake_peer_id(10**9), fake_peer_id(10**9 + 1)  # beyond any drawn peer's i


def draw_peers(n: int, nat_share: float, holepunch_share: float, params: float, seed: int) -> list[Peer]:
    """`n` rollout peers, reproducible from `seed`."""
    if not 0 <= nat_share <= 1 or not 0 <= holepunch_share <= 1:
        raise ValueError("nat_share and holepunch_share are shares between 0 and 1")
    rng = random.Random(seed)
    peers = []
    for i in range(n):
        cls = rng.choices(LINK_CLASSES, weights=[c.share for c in LINK_CLASSES])[0]
        peers.append(Peer(
            peer_id=fake_peer_id(i), link=cls.name,
            down_bps=_log_uniform(rng, *cls.down_mbps) * MBIT, up_bps=_log_uniform(rng, *cls.up_mbps) * MBIT,
            rtt_s=_log_uniform(rng, *cls.rtt_ms) / 1000, price=round(_log_uniform(rng, *cls.price), 4),
            mu=_log_uniform(rng, *cls.mu_8b) * 8e9 / params,
        ))
    homes = [p for p in peers if p.link != "cloud"]
    clouds = [p for p in peers if p.link == "cloud"]
    rng.shuffle(homes)
    rng.shuffle(clouds)
    for p in (homes + clouds)[: round(nat_share * n)]:
        p.nat = "holepunch" if rng.random() < holepunch_share else "relayed"
    return peers


__all__ = ["BOOTSTRAP_ID", "LEARNER_ID", "LINK_CLASSES", "MBIT", "Peer", "draw_peers", "fake_peer_id"]
