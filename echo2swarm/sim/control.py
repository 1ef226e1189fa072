"""The control plane's DHT traffic in the modelled swarm, per node and second, for one design.

What each daemon stores and reads follows the code: every daemon stores its card under its own key
(`Overlay.store_card`: a lookup, then the replicas) and in its card shard (no lookup) every
announce period; the learner stores its head and roster as often; followers read the head from
the DHT every DHT_OVERDUE x head_poll_s; the learner reads the cards at every broadcast-tracker
refresh (its re-plans and departed-lease checks reuse that read); a follower reads cards when a fetch begins
and every holders_refresh_s while it lasts: its upstream peers' own keys when the plan places it
(`BroadcastPlan.upstream`), its foster parents' when it leaves it out (`BroadcastPlan.fosters`; not in
`today`, which had none), else the learner's roster and the cards `get_cards(whole=False)` reads
(the last two in a sharded swarm at a wait that doubles each time, up to the record TTL).

Designs: `today` keeps every card in the one shard of depth 0 (`<swarm>/peers`, as before card
shards); `shards` lets the learner's `ShardDepth` choose the depth from what its reads find (the
real class, iterated to its steady state). A shard holds at most what a node keeps under one key
(overlay/storage.py SHARED_DICT_BYTES); a read of a shard past overlay.max_cards counts as flooded
(overlay/cards.py): read again one record TTL later, its named peers by their own keys meanwhile.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from echo2swarm.config.models import FetchConfig, OverlayConfig, PublishConfig
from echo2swarm.overlay.shards import ShardDepth
from echo2swarm.overlay.dht_keys import MAX_SHARD_BITS, card_key, head_key, roster_key, shard_key, shard_keys, shard_of
from echo2swarm.overlay.storage import SHARED_DICT_BYTES
from echo2swarm.policy.broadcast_plan import BroadcastPlan
from echo2swarm.policy.follower import DHT_OVERDUE, PLAN_UPSTREAM_DEPTH, next_refresh_wait
from echo2swarm.sim.dht import SimDHT
from echo2swarm.sim.population import BOOTSTRAP_ID, LEARNER_ID
from echo2swarm.wire.peer_keys import PeerKey
from echo2swarm.wire.records import HeadRecord, PeerCard, RosterEntry, RosterRecord
from echo2swarm.wire.signing import PolicyKey

SWARM = "sim"
DESIGNS = ("today", "shards")


@dataclass(frozen=True)
class RecordSizes:
    card: int
    head: int
    roster: int


def record_sizes(roster_entries: int) -> RecordSizes:
    """Bytes of real signed records as the DHT carries them (msgpack): a rollout card with two addresses,
    32 held versions and a chunk URL; a head with its addresses; a roster of `roster_entries` peers."""
    import msgpack

    key, policy = PeerKey.generate(), PolicyKey.generate()
    now = int(time.time() * 1000)
    card = PeerCard(peer_id=key.peer_id, role="rollout", price=0.35, state="ready", software="0.1.0", version=100,
                    held=list(range(69, 101)), rollouts_per_s=0.4, reachability="public", uplink_bps=10**7,
                    chunk_url="http://203.0.113.7:31338",
                    maddrs=[f"/ip4/203.0.113.7/tcp/31337/p2p/{key.peer_id}",
                            f"/ip4/203.0.113.7/udp/31337/quic-v1/p2p/{key.peer_id}"],
                    updated_ms=now).signed(key, SWARM, 30)
    head = HeadRecord(swarm=SWARM, version=100, manifest_sha256="ab" * 32, manifest_size=4096, publisher=key.peer_id,
                      published_ms=now, expires_ms=now + 30_000, public_key=policy.public.text,
                      chunk_url="http://203.0.113.1:31338", maddrs=card.maddrs, card_shard_bits=7).signed(policy)
    entries = [RosterEntry(peer_id=PeerKey.generate().peer_id, work=["delivered"], seen_ms=1000)
               for _ in range(min(roster_entries, 128))]
    roster = RosterRecord(peer_id=key.peer_id, peers=entries, updated_ms=now).signed(key, SWARM, 30)
    size = lambda r: len(msgpack.packb(r.model_dump(mode="json"), use_bin_type=True))  # noqa: E731
    return RecordSizes(card=size(card), head=size(head), roster=size(roster))


def steady_depth(ids: Sequence[str], card_bytes: int, max_bits: int, hold_s: float) -> int:
    """The depth the learner's ShardDepth settles on for these cards, a shard holding at most what one
    node keeps under one key."""
    depth, bits = ShardDepth(hold_s), 0
    cap = SHARED_DICT_BYTES // card_bytes
    for _ in range(MAX_SHARD_BITS + 1):
        counts = np.bincount([shard_of(p, bits) for p in ids], minlength=1 << bits)
        depth.observe([(bits, int(min(c, cap))) for c in counts])
        wanted = depth.wanted(max_bits)
        if wanted == bits:
            return bits
        depth.set(wanted)
        depth._until = float("-inf")  # the steady state: every card re-announced at the new depth
        bits = wanted
    return bits


def refresh_reads(fetch_s: float, refresh_s: float, ttl_s: float, sampling: bool) -> int:
    """Card reads during a fetch of `fetch_s` seconds (policy/follower.py `_refresh_while_fetching`): one at
    the start, then every `refresh_s`; a sample of a sharded swarm's cards at twice the wait each time, up to
    the record TTL."""
    reads, t, wait = 1, 0.0, refresh_s
    while t + wait <= fetch_s:
        t += wait
        reads += 1
        wait = next_refresh_wait(wait, refresh_s, ttl_s, sampling)
    return reads


@dataclass
class Traffic:
    design: str
    depth: int
    per_node: np.ndarray  # bytes/s through each node: [learner, bootstrap, peers...]
    unstored: int = 0  # cards no shard can hold (its nodes' bound is full): readers find them only by name

    def summary(self) -> dict[str, float | int | str]:
        busiest = int(np.argmax(self.per_node))
        return {"design": self.design, "card_shard_bits": self.depth,
                "control_bytes_per_node_s": round(float(np.mean(self.per_node)), 1),
                "control_bytes_busiest_node_s": round(float(self.per_node[busiest]), 1),
                "busiest_node": "learner" if busiest == 0 else "bootstrap" if busiest == 1 else "rollout peer",
                "control_bytes_learner_s": round(float(self.per_node[0]), 1), "cards_unstored": self.unstored}


def control_traffic(design: str, ids: Sequence[str], active: Collection[str], plan: BroadcastPlan | None,
                    arrival: dict[str, float], version_period_s: float, sizes: RecordSizes,
                    seed: int = 0) -> Traffic:
    """Per-node DHT bytes/s with rollout peers `ids` (the learner and a bootstrap besides), `active` of them
    planned by activation, the version's broadcast `plan` (chains or trees), each peer's fetch time
    `arrival` (seconds from publication) and a version every `version_period_s`."""
    if design not in DESIGNS:
        raise ValueError(f"design {design!r}: one of {', '.join(DESIGNS)}")
    overlay, fetch, publish = OverlayConfig(), FetchConfig(), PublishConfig()
    n = len(ids) + 2
    dht = SimDHT(n, seed=seed)
    index = {p: i + 2 for i, p in enumerate(ids)}
    learner, announce = LEARNER_ID, 1 / overlay.announce_period_s
    cap = SHARED_DICT_BYTES // sizes.card
    bits = 0 if design == "today" else steady_depth([*ids, learner, BOOTSTRAP_ID], sizes.card,
                                                    MAX_SHARD_BITS, overlay.record_ttl_s)
    members: dict[str, int] = {}
    for p in [*ids, learner, BOOTSTRAP_ID]:
        key = shard_key(SWARM, bits, shard_of(p, bits))
        members[key] = members.get(key, 0) + 1
    shard_value = {k: min(members.get(k, 0), cap) * sizes.card for k in shard_keys(SWARM, bits)}
    unstored = sum(max(0, c - cap) for c in members.values())  # past what one node keeps under one key
    flooded = {k for k, c in members.items() if min(c, cap) > overlay.max_cards}

    # Every daemon announces its card: own key (a lookup first), then its shard (straight to the replicas).
    for i, p in enumerate([learner, BOOTSTRAP_ID, *ids]):
        dht.store(i, card_key(SWARM, p), sizes.card, announce)
        dht.store(i, shard_key(SWARM, bits, shard_of(p, bits)), sizes.card, announce, lookup=False)
    dht.store(0, head_key(SWARM), sizes.head, announce)
    dht.store(0, roster_key(SWARM, learner), sizes.roster, announce)
    # Followers look at the head in the DHT (lease replies and the learner's long-poll come in between).
    peers = np.arange(2, n)
    dht.get(peers, head_key(SWARM), sizes.head, np.full(len(peers), 1 / (DHT_OVERDUE * FetchConfig().head_poll_s)))

    # The learner's reads of every shard: the broadcast tracker's; re-plans and departed-lease checks take
    # its latest when it is at most one refresh old (Overlay.get_cards max_age_s), as it is here.
    calls = 1 / (publish.cards_refresh_s or min(2.0, overlay.announce_period_s / 2))
    named = min(len(active) + overlay.max_cards // 4, overlay.max_cards)  # worked, then askers (cards.py)
    for key, value in shard_value.items():
        dht.get(0, key, value, 1 / overlay.record_ttl_s if key in flooded else calls)
    if flooded:  # named peers of flooded shards by their own keys at every other call
        for p in list(active)[:named]:
            if shard_key(SWARM, bits, shard_of(p, bits)) in flooded:
                dht.get(0, card_key(SWARM, p), sizes.card, calls)

    # Followers' reads while they fetch: at the start of each version, then every holders_refresh_s.
    reads: dict[str, tuple[list[int], list[float]]] = {}

    def read(key: str, who: int, rate: float) -> None:
        entry = reads.setdefault(key, ([], []))
        entry[0].append(who)
        entry[1].append(rate)

    placed = {p for p in ids if plan is not None and plan.places(p)}
    turn = 0
    for p in ids:
        fetching = min(arrival.get(p, 0.0), version_period_s)
        sampling = bits > 0 and not (p in placed and fetch.upstream_cards)
        rate = refresh_reads(fetching, fetch.holders_refresh_s, overlay.record_ttl_s, sampling) / version_period_s
        who = index[p]
        if p in placed and plan is not None and fetch.upstream_cards:
            for up in plan.upstream(p, PLAN_UPSTREAM_DEPTH):
                read(card_key(SWARM, up), who, rate)
            read(card_key(SWARM, learner), who, rate)
            continue
        fosters = plan.fosters(p) if plan is not None and design != "today" and fetch.upstream_cards else []
        if fosters:  # left out of the plan: its foster parents' cards and the learner's, by their own keys
            for up in fosters:
                read(card_key(SWARM, up), who, rate)
            read(card_key(SWARM, learner), who, rate)
            continue
        read(roster_key(SWARM, learner), who, rate)  # the rosters of `prefer`: the learner's
        own = shard_key(SWARM, bits, shard_of(p, bits))
        sampled = [own]
        if bits > 0:
            turn += 1
            other = turn % (1 << bits)
            sampled.append(shard_key(SWARM, bits, other if other != shard_of(p, bits) else (other + 1) % (1 << bits)))
        for key in sampled:
            read(key, who, 1 / overlay.record_ttl_s if key in flooded else rate)
        if shard_key(SWARM, bits, shard_of(learner, bits)) not in sampled or sampled[0] in flooded:
            read(card_key(SWARM, learner), who, rate)  # the learner's card, named, by its own key
    for key, (who_list, rates) in reads.items():
        value = shard_value.get(key, sizes.roster if key.startswith(f"{SWARM}/roster/") else sizes.card)
        dht.get(np.array(who_list), key, value, np.array(rates))
    return Traffic(design, bits, dht.per_node(), unstored)


__all__ = ["DESIGNS", "RecordSizes", "Traffic", "control_traffic", "record_sizes", "refresh_reads", "steady_depth"]
