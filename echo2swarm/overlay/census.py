"""Who is in the swarm: live peer cards and announced heads, as plain rows for tables and JSON."""

from __future__ import annotations

import time
from typing import Any

from echo2swarm.overlay.node import Overlay

_ROLE_ORDER = {"learner": 0, "rollout": 1, "relay": 2, "verifier": 3, "bootstrap": 4}


async def census(overlay: Overlay, page: int | None = None) -> dict[str, Any]:
    """Peers and heads. However many cards the DHT holds, the publishers of signed heads (learners) and
    the peers their rosters say they saw working are read first, by their own keys (overlay/cards.py),
    and listed first within their role; `work` says what each was seen doing.

    `page` (from 0): one page of the swarm's card shards (`pages` says how many; the learners and their
    rosters' peers come with page 0); None: all of them when they fit one page, else page 0."""
    heads, bad_heads = await overlay.get_heads()
    overlay.shards_from(heads)
    dropped_before = overlay.cards_dropped
    signed = sorted((h for h in heads if h.signature_ok()), key=lambda h: -h.version)
    publishers = list(dict.fromkeys(h.publisher for h in signed))  # newest version first: its roster is read first
    pages = overlay.cards.pages()
    if page is not None and not 0 <= page < pages:
        raise ValueError(f"page {page + 1} of {pages}: the swarm's cards span {pages} page(s)")
    if page is None and pages > 1:
        page = 0
    if page is None:
        cards, bad_cards = await overlay.get_cards(prefer=publishers)
    else:
        cards, bad_cards = await overlay.get_card_page(page, prefer=publishers if page == 0 else ())
    now_ms = time.time() * 1000
    work: dict[str, set[str]] = {p: {"published"} for p in publishers}
    for roster in overlay.cards.rosters.values():
        for entry in roster.peers:
            work.setdefault(entry.peer_id, set()).update(entry.work)
    # Bans are the learner's word: only cards of a peer publishing a correctly signed head count (its
    # card is signed by its own key, so nobody else can put bans on it).
    banned = {b.peer_id: b.reason for c in cards if c.peer_id in publishers for b in c.bans}
    peers = [
        {
            "peer_id": c.peer_id,
            "role": c.role,
            "price": c.price,
            "version": c.version,
            "state": c.state,
            "rollouts_per_s": c.rollouts_per_s,
            # rollout peers the learner keeps on standby (cost-aware activation) get no leases
            "activation": None if c.active is None else ("active" if c.active else "standby"),
            "upload_bps": c.upload_bps,
            "uplink_bps": c.uplink_bps,  # measured: what its uploads sustained (policy/uplink.py)
            "fetching": c.fetching,
            # how long the newest version this peer installed took to arrive (head seen -> installed)
            "arrival_s": max(c.arrivals, key=lambda a: a.version).seconds if c.arrivals else None,
            # delta versions: how the newest version got here (delta / chain / composite / keyframe) and its bytes
            "fetch_path": max(c.arrivals, key=lambda a: a.version).path if c.arrivals else None,
            "fetch_bytes": max(c.arrivals, key=lambda a: a.version).fetched_bytes if c.arrivals else None,
            # learner: its newest versions, dense or delta, with dense and delta bytes
            "versions": [n.model_dump() for n in c.versions],
            "t_bcast_s": c.t_bcast_s,
            "last_seen": round(max(0.0, now_ms - c.updated_ms) / 1000, 1),
            "software": c.software,
            "chunk_url": c.chunk_url,
            "reachability": c.reachability,  # public / relayed / private / unknown (overlay/reachability.py)
            "maddrs": c.maddrs,
            "banned": banned.get(c.peer_id),  # why the learner banned this peer for the run, else None
            # seen doing work: "published" (signed heads), "delivered" / "served" (a publisher's roster)
            "work": sorted(work.get(c.peer_id, ())),
        }
        for c in cards
    ]
    peers.sort(key=lambda p: (_ROLE_ORDER.get(p["role"], 9), not p["work"], p["peer_id"]))
    return {
        "swarm": overlay.config.swarm,
        "peers": peers,
        "heads": [
            {"version": h.version, "public_key": h.public_key, "publisher": h.publisher, "signature_ok": h.signature_ok()}
            for h in sorted(heads, key=lambda h: -h.version)
        ],
        "malformed_records": bad_cards + bad_heads,
        "cards_left_out": overlay.cards_dropped - dropped_before,  # valid cards past overlay.max_cards (a shard)
        "card_shard_bits": overlay.cards.depth.bits,  # the swarm's card shards: 2**bits (overlay/dht_keys.py)
        "page": page, "pages": pages,
        "banned": banned,
    }
