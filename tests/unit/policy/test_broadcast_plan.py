"""Broadcast plans, the upload limiter and the in-flight tracker: pure logic, no network."""

from __future__ import annotations

import asyncio
import statistics
import time

import pytest

from echo2swarm.config.models import ChunkServerConfig, RelayConfig
from echo2swarm.wire.records import PeerCard, RecordError, parse_card
from echo2swarm.policy.broadcast_plan import MAX_PLAN_BYTES, MAX_PLAN_ENTRIES, PlanError, make_plan, plan_chains, verify_plan
from echo2swarm.policy.limiter import RateLimiter
from echo2swarm.policy.manifest import ChunkRef, FileEntry, Manifest
from echo2swarm.policy.pipeline import InFlight
from echo2swarm.policy.budgets import Busy
from echo2swarm.policy.server import ChunkService
from echo2swarm.wire.signing import PolicyKey
from echo2swarm.policy.store import ChunkStore, VersionStore

LEARNER = "12D3KooWDNSVj168KNjs6cqwmWsqdg9DGvdYcN1E7seBqHR5mAL2"
PEERS = [f"12D3KooW{c * 44}" for c in "ABCDEFGH"]


def test_chains_put_fast_uploaders_first_and_the_slowest_last():
    receivers = [(PEERS[0], 10), (PEERS[1], 30), (PEERS[2], None), (PEERS[3], 20)]  # None: uncapped
    chains = plan_chains(receivers, seeds=2)
    assert chains == [[PEERS[2], PEERS[1], PEERS[3], PEERS[0]], [PEERS[1], PEERS[2], PEERS[3], PEERS[0]]]
    for chain in chains:
        assert sorted(chain) == sorted(p for p, _ in receivers)


@pytest.mark.parametrize("n,seeds,stripes", [(0, 2, 0), (1, 2, 1), (2, 2, 1), (3, 2, 2), (8, 16, 7), (8, 1, 1)])
def test_stripe_count_never_lets_the_tail_head_a_stripe(n: int, seeds: int, stripes: int):
    chains = plan_chains([(p, 100) for p in PEERS[:n]], seeds)
    assert len(chains) == stripes
    if chains:
        assert {chain[-1] for chain in chains} == {chains[0][-1]} or n <= 1


def test_every_peer_has_one_parent_per_chunk_and_the_learner_feeds_each_stripe_once():
    key = PolicyKey.generate()
    plan = make_plan(key, "s", 3, LEARNER, [(p, 100) for p in PEERS[:5]], seeds=2)
    for index in range(10):
        parents = {peer: plan.parent(peer, index) for peer in PEERS[:5]}
        assert list(parents.values()).count(LEARNER) == 1  # one seed per chunk
        assert all(parent != peer for peer, parent in parents.items())
    assert plan.parent(PEERS[7], 0) is None  # joined after the plan: holders only


def test_upstream_names_each_chains_nearest_peers_before_a_peer_and_never_the_learner():
    key = PolicyKey.generate()
    plan = make_plan(key, "s", 3, LEARNER, [(p, 100) for p in PEERS[:6]], seeds=2).model_copy(
        update={"stripes": [PEERS[:6], [PEERS[5], PEERS[3], PEERS[1], PEERS[0], PEERS[4], PEERS[2]]]})  # two known chains
    # The nearest first: both parents, then both grandparents, ...; at most `depth` a chain, no repeats.
    assert plan.upstream(PEERS[4], depth=2) == [PEERS[3], PEERS[0], PEERS[2], PEERS[1]]
    assert plan.upstream(PEERS[4], depth=1) == [plan.parent(PEERS[4], 0), plan.parent(PEERS[4], 1)]
    assert plan.upstream(PEERS[5], depth=3) == [PEERS[4], PEERS[3], PEERS[2]]  # first in the second chain
    assert plan.upstream(PEERS[7], depth=3) == []  # not in the plan


def test_a_plan_verifies_only_with_its_key_swarm_version_and_publisher():
    key = PolicyKey.generate()
    data = make_plan(key, "s", 3, LEARNER, [(PEERS[0], None)], seeds=2).to_bytes()
    assert verify_plan(data, trusted=key.public, swarm="s", version=3, publisher=LEARNER).stripes == [[PEERS[0]]]
    with pytest.raises(PlanError, match="trusted learner key"):
        verify_plan(data, trusted=PolicyKey.generate().public, swarm="s", version=3, publisher=LEARNER)
    with pytest.raises(PlanError, match="not the head"):
        verify_plan(data, trusted=key.public, swarm="s", version=4, publisher=LEARNER)
    tampered = data.replace(PEERS[0].encode(), PEERS[1].encode())
    with pytest.raises(PlanError, match="signature"):
        verify_plan(tampered, trusted=key.public, swarm="s", version=3, publisher=LEARNER)
    with pytest.raises(PlanError, match="malformed"):
        verify_plan(b"{not json", trusted=key.public, swarm="s", version=3, publisher=LEARNER)
    with pytest.raises(PlanError, match="exceeds"):
        verify_plan(b" " * (300 * 1024), trusted=key.public, swarm="s", version=3, publisher=LEARNER)


def test_the_limiter_holds_the_rate_over_concurrent_writers():
    async def scenario() -> float:
        limiter = RateLimiter(2 * 1024 * 1024, burst=64 * 1024)

        async def writer() -> None:
            for _ in range(8):
                await limiter.take(64 * 1024)

        started = time.monotonic()
        await asyncio.gather(*(writer() for _ in range(4)))  # 2 MiB in all
        return time.monotonic() - started

    elapsed = asyncio.run(scenario())
    assert elapsed >= 0.9, f"2 MiB at 2 MiB/s (less one burst) took only {elapsed:.2f} s"


def test_the_burst_covers_50_ms_of_a_fast_rate_and_one_write_block_of_a_slow_one():
    assert RateLimiter(16 * 2**20).burst == 0.05 * 16 * 2**20  # a writer woken 50 ms late loses nothing
    assert RateLimiter(2**20).burst == 256 * 1024  # slow caps stay tight: one 256 KiB block


def test_an_unlimited_limiter_never_waits_and_rates_are_validated():
    limiter = RateLimiter(None)
    asyncio.run(limiter.take(10**9))
    assert limiter.bytes_total == 10**9
    with pytest.raises(ValueError):
        RateLimiter(0)


def _manifest(shas: list[str]) -> Manifest:
    return Manifest(
        swarm="s", version=2, created_ms=1, chunk_size=1024,
        files=[FileEntry(name="model.safetensors", size=1024 * len(shas), sha256="0" * 64,
                         chunks=[ChunkRef(sha256=s, size=1024) for s in shas])],
    )


def test_a_waiting_request_is_released_when_its_chunk_arrives_and_not_before():
    async def scenario() -> tuple[bool, float]:
        inflight = InFlight()
        a, b = "a" * 64, "b" * 64
        inflight.begin(_manifest([a, b]), b"{}", held={a})
        waiter = asyncio.create_task(inflight.wait(b, 5.0))
        for _ in range(10):  # let the waiter run as far as it can without the chunk
            await asyncio.sleep(0)
        early = waiter.done()
        started = time.monotonic()
        inflight.arrived(b)
        await waiter
        return early, time.monotonic() - started

    early, latency = asyncio.run(scenario())
    assert not early and latency < 0.5


def test_a_request_for_a_newer_version_pokes_the_follower_and_gives_up_at_its_deadline():
    async def scenario() -> tuple[int, float]:
        pokes = []
        inflight = InFlight(poke=lambda: pokes.append(1))
        started = time.monotonic()
        await inflight.wait("c" * 64, 0.2, newer_than=1, version=2)
        return len(pokes), time.monotonic() - started

    pokes, elapsed = asyncio.run(scenario())
    assert pokes == 1 and 0.15 <= elapsed < 2


def test_upload_slots_refuse_beyond_the_cap(tmp_path):
    service = ChunkService(ChunkServerConfig(upload_slots=1), ChunkStore(tmp_path), VersionStore(tmp_path))
    with service.upload_slot():
        with pytest.raises(Busy):
            with service.upload_slot():
                pass
    with service.upload_slot():  # released
        pass
    assert service.stats["refused_busy"] == 1


def test_upload_limit_accepts_human_rates_and_refuses_nonsense():
    assert RelayConfig(upload_limit="16MiB/s").upload_limit == 16 * 1024 * 1024
    assert RelayConfig(upload_limit="1 MB").upload_limit == 1_000_000
    for bad in ("fast", "-1", "1KiB"):
        with pytest.raises(ValueError, match="upload_limit|byte size"):
            RelayConfig(upload_limit=bad)


def test_cards_bound_what_they_advertise():
    base = dict(peer_id=LEARNER, role="relay", price=0.0, state="ready", software="0", updated_ms=1)
    card = parse_card({**base, "held": [1, 2], "fetching": 3, "arrivals": [{"version": 2, "seconds": 1.5}],
                       "upload_bps": 1 << 24})
    assert isinstance(card, PeerCard) and card.arrivals[0].seconds == 1.5
    for bad in ({"held": list(range(1, 40))}, {"arrivals": [{"version": 0, "seconds": 1.0}]},
                {"arrivals": [{"version": 1, "seconds": float("nan")}]}, {"fetching": 0}, {"upload_bps": -1}):
        with pytest.raises(RecordError):
            parse_card({**base, **bad})


@pytest.mark.parametrize("seeds", [1, 2, 16])
def test_a_plan_for_a_huge_swarm_still_fits_what_followers_accept(seeds: int):
    key = PolicyKey.generate()
    peers = [(f"12D3KooW{i:044d}".replace("0", "A"), None) for i in range(6000)]
    plan = make_plan(key, "s", 1, LEARNER, peers, seeds)
    data = plan.to_bytes()
    assert verify_plan(data, trusted=key.public, swarm="s", version=1, publisher=LEARNER)
    assert sum(len(c) for c in plan.stripes) <= 4096


def test_t_bcast_waits_for_every_planned_peer_and_counts_a_skipped_version_by_the_next_one():
    from echo2swarm.learner.broadcast_tracker import BroadcastTracker

    class FakeOverlay:  # only what plan() reads: the swarm name and our peer id
        class config:
            swarm = "s"
        peer_id = LEARNER

    def card(peer: str, arrivals: dict[int, float], active: bool | None = None) -> PeerCard:
        return PeerCard(peer_id=peer, role="rollout", price=0.0, state="ready", software="0", updated_ms=1,
                        arrivals=[{"version": v, "seconds": t} for v, t in arrivals.items()], active=active)

    tracker = BroadcastTracker(FakeOverlay(), PolicyKey.generate(), seeds=2, refresh_s=1.0, ewma_alpha=0.3)  # type: ignore[arg-type]
    tracker.observe([card(PEERS[0], {}), card(PEERS[1], {}), card(PEERS[2], {}, active=False)])
    tracker.plan(5)
    tracker.observe([card(PEERS[0], {5: 2.0}), card(PEERS[1], {}), card(PEERS[2], {}, active=False)])
    assert tracker.t_bcast_s is None  # PEERS[1] does not hold v5 yet; the standby peer is not waited for
    tracker.observe([card(PEERS[0], {5: 2.0}), card(PEERS[1], {6: 3.5}), card(PEERS[2], {}, active=False)])
    assert tracker.t_bcast == {5: 3.5} and tracker.t_bcast_s == 3.5


def test_a_peer_nobody_can_dial_is_never_a_parent() -> None:
    from echo2swarm.policy.broadcast_plan import plan_chains

    receivers = [("a", None), ("b", 10), ("nat", 50), ("c", 5)]
    chains = plan_chains(receivers, seeds=2, undialable={"nat"})
    assert chains and all("nat" not in chain for chain in chains)
    assert chains == [["a", "b", "c"], ["b", "a", "c"]]


def test_nat_plans_prefer_direct_edges_and_count_relayed_ones_against_the_relay() -> None:
    from echo2swarm.policy.broadcast_plan import NatPeer, direct_edge, plan_chains, relay_load

    # pub0 and pub1 public; h0..h2 hole-punch; r0, r1 do not (relayed through pub0); x has no relay slot.
    nat = {"h0": NatPeer(("pub0",), True), "h1": NatPeer(("pub1",), True), "h2": NatPeer(("pub0",), True),
           "r0": NatPeer(("pub0",), False), "r1": NatPeer(("pub0",), False), "x": NatPeer((), False)}
    receivers = [(p, None) for p in ["r0", "h0", "x", "pub0", "r1", "h1", "pub1", "h2"]]
    chains = plan_chains(receivers, seeds=2, nat=nat)
    assert all("x" not in chain for chain in chains), "a peer nobody can reach is nobody's parent"
    for chain in chains:
        assert chain[-2:] in (["r0", "r1"], ["r1", "r0"]), f"relayed parents go last: {chain}"
        assert set(chain[:2]) == {"pub0", "pub1"} and set(chain[2:5]) == {"h0", "h1", "h2"}
    edges = [(a, b) for chain in chains for a, b in zip(chain, chain[1:])]
    # Relayed: h -> r (r cannot answer DCUtR) and r -> r, in each chain; every other edge is direct.
    assert sum(not direct_edge(a, b, nat) for a, b in edges) == 2 * len(chains)
    # pub0 relays for r0/r1: its uplink is shared, so pub1 (uncapped too) now heads the first chain
    assert chains[0][0] == "pub1"
    load = relay_load(chains, nat)
    assert load["pub0"] == 2 + 2 * 2, "a parent in both chains, plus the 2 relayed edges of each chain it carries"
    assert load.get("r0", 0) + load.get("r1", 0) == 2  # the non-tail relayed peer uploads once per chain


def test_nat_peers_read_from_cards_are_bounded_claims() -> None:
    from echo2swarm.policy.broadcast_plan import NatPeer, nat_peers

    relay = PEERS[7]
    def card(peer: str, reach: str | None, maddrs: list[str], holepunch: list[str]) -> PeerCard:
        return PeerCard(peer_id=peer, role="rollout", price=0.0, state="ready", software="0", updated_ms=1,
                        reachability=reach, maddrs=maddrs, holepunch=holepunch)

    circuit = f"/ip4/11.0.0.10/udp/1/quic-v1/p2p/{relay}/p2p-circuit"
    cards = [card(PEERS[0], "relayed", [circuit, circuit.replace("udp/1/quic-v1", "tcp/2")], ["quic"]),
             card(PEERS[1], "public", ["/ip4/11.0.0.11/tcp/1"], []), card(PEERS[2], "private", [], [])]
    assert nat_peers(cards) == {PEERS[0]: NatPeer((relay,), True), PEERS[2]: NatPeer((), False)}


def test_peers_seen_working_come_first_within_their_nat_tier_whatever_the_others_claim() -> None:
    from echo2swarm.policy.broadcast_plan import NatPeer

    receivers = [(PEERS[0], None), (PEERS[1], 1_000), (PEERS[2], 5_000), (PEERS[3], None)]
    assert plan_chains(receivers, seeds=1)[0] == [PEERS[0], PEERS[3], PEERS[2], PEERS[1]]
    proven = {PEERS[1], PEERS[2]}
    assert plan_chains(receivers, seeds=1, proven=proven)[0] == [PEERS[2], PEERS[1], PEERS[0], PEERS[3]]
    # Behind NAT without hole punching, a proven peer still goes after the public ones (who can be dialled).
    nat = {PEERS[2]: NatPeer(relays=(PEERS[7],))}
    assert plan_chains(receivers, seeds=1, proven=proven, nat=nat)[0] == [PEERS[1], PEERS[0], PEERS[3], PEERS[2]]


# -- trees (past TREE_FROM receivers) ------------------------------------------------------------------
def _ids(n: int) -> list[str]:
    from echo2swarm.sim.population import fake_peer_id

    return [fake_peer_id(i) for i in range(n)]


def test_trees_put_the_fastest_peers_in_disjoint_stripe_interiors_and_every_peer_in_every_stripe():
    import math
    import random

    rng = random.Random(0)
    ids = _ids(300)
    uplink = {p: rng.choice([2 * 10**6, 20 * 10**6, 200 * 10**6]) for p in ids}
    key = PolicyKey.generate()
    plan = verify_plan(make_plan(key, "s", 3, LEARNER, list(uplink.items()), seeds=4).to_bytes(), trusted=key.public,
                       swarm="s", version=3, publisher=LEARNER)  # auto: 300 >= TREE_FROM
    tree = plan.tree
    assert tree is not None and plan.stripes == [] and plan.stripe_count == 4 and tree.fanout % 4 == 0
    parents_in: dict[str, set[int]] = {}
    for stripe, rows in enumerate(plan.edges()):
        assert sorted(p for p, _ in rows) == sorted(ids)  # every peer receives every stripe
        assert [p for p, up in rows if up is None] == [rows[0][0]]  # one root, fed by the learner
        children: dict[str, int] = {}
        hops: dict[str, int] = {}
        for peer, up in rows:
            hops[peer] = 1 if up is None else hops[up] + 1  # parents come before their children
            if up is not None:
                children[up] = children.get(up, 0) + 1
                parents_in.setdefault(up, set()).add(stripe)
            assert plan.parent(peer, stripe) == (up or LEARNER) == plan.parent(peer, stripe + 4)
        assert max(children.values()) <= tree.fanout
        assert max(hops.values()) <= 1 + math.ceil(math.log(300, tree.fanout))
    # Each interior peer forwards one stripe only, and they are the fastest claims.
    assert all(len(stripes) == 1 for stripes in parents_in.values())
    assert min(uplink[p] for p in parents_in) >= max(uplink[p] for p in ids if p not in parents_in)
    me = tree.order[-1]
    assert plan.places(me) and not plan.places(PEERS[0])
    up = plan.upstream(me, 2)
    assert up[:4] == [plan.parent(me, i) for i in range(4)] and LEARNER not in up and me not in up


def test_a_fresh_key_claiming_an_uncapped_uplink_does_not_carry_a_tree_ahead_of_proven_peers():
    ids = _ids(100)
    proven = set(ids[:90])
    receivers = [(p, 50 * 10**6) for p in ids[:90]] + [(p, None) for p in ids[90:]]  # 10 fresh keys, "uncapped"
    tree = make_plan(PolicyKey.generate(), "s", 1, LEARNER, receivers, seeds=2, proven=proven).tree
    assert tree is not None
    interior = {tree.order[(tree.offset(i) + k) % len(tree.order)] for i in range(2) for k in range(tree.interior)}
    assert not interior & set(ids[90:])


def test_auto_plans_chains_below_tree_from_and_old_daemons_read_chain_plans_unchanged():
    from echo2swarm.policy.broadcast_plan import TREE_FROM

    key = PolicyKey.generate()
    small = make_plan(key, "s", 1, LEARNER, [(p, 100) for p in _ids(TREE_FROM - 1)], seeds=2)
    assert small.tree is None and b'"tree"' not in small.to_bytes()  # the record and signed bytes of before
    assert make_plan(key, "s", 1, LEARNER, [(p, 100) for p in _ids(TREE_FROM)], seeds=2).tree is not None
    assert make_plan(key, "s", 1, LEARNER, [(p, 100) for p in _ids(8)], seeds=2, shape="trees").tree is not None
    assert make_plan(key, "s", 1, LEARNER, [(p, 100) for p in _ids(500)], seeds=2, shape="chains").tree is None


def test_a_tree_for_a_huge_swarm_fits_what_followers_accept():
    key = PolicyKey.generate()
    plan = make_plan(key, "s", 1, LEARNER, [(p, 100) for p in _ids(6000)], seeds=16)
    data = plan.to_bytes()
    assert plan.tree is not None and len(plan.tree.order) == MAX_PLAN_ENTRIES and len(data) <= MAX_PLAN_BYTES
    assert verify_plan(data, trusted=key.public, swarm="s", version=1, publisher=LEARNER).tree == plan.tree


def test_followers_left_out_get_foster_parents_among_the_planned_peers_that_upload_nothing_else():
    from collections import Counter

    from echo2swarm.policy.broadcast_plan import FOSTERS

    key = PolicyKey.generate()
    left_out = _ids(1200)[1000:]
    uplinks = [(p, 10**8 if i < 30 else 10**6) for i, p in enumerate(_ids(300))]  # a wide fan-out over 30 fast peers
    tree_plan = make_plan(key, "s", 7, LEARNER, uplinks, seeds=2)
    chain_plan = make_plan(key, "s", 7, LEARNER, [(p, 10**7) for p in _ids(20)], seeds=2)
    for plan in (tree_plan, chain_plan):
        edges = plan.edges()
        uploading = {up for rows in edges for _, up in rows if up is not None}
        picks: Counter[str] = Counter()
        for peer in left_out:
            fosters = plan.fosters(peer)
            assert len(fosters) == len(set(fosters)) == FOSTERS and all(plan.places(f) for f in fosters)
            assert fosters == plan.fosters(peer)  # the same for every fetch of this version
            picks.update(fosters)
        if plan.tree is not None:  # a tree's leaves, never an interior peer (those forward a stripe already)
            assert plan.tree.fanout > 2 and not picks.keys() & uploading
            assert len(picks) >= 0.6 * (len(plan.tree.order) - len(uploading))
        else:
            assert len(picks) == 20  # a chain plan: any planned peer
        assert max(picks.values()) <= 3 * statistics.mean(picks.values())  # spread, not a hot spot
        placed = plan.edges()[0][-1][0]
        assert plan.fosters(placed) == []  # a peer the plan places has parents, not fosters
    # Another version, other fosters: a follower left out for a while does not load the same peers forever.
    later = make_plan(key, "s", 8, LEARNER, uplinks, seeds=2)
    assert sum(later.fosters(p) != tree_plan.fosters(p) for p in left_out) > len(left_out) // 2
