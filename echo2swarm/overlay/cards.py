"""Bounded reads of the swarm's peer cards: the peers a reader has reason to trust first, by their own keys.

    read(prefer, limit, whole):
      ┌ card shards (overlay/dht_keys.py; 2**depth of them, one at depth 0): every one (`whole`: the
      │   learner), or a sample (our own shard and one other in turn: a follower finding holders), or
      │   one page of them (`peers`); each in a reply of its own (≤ 4 MiB); a flooded shard is read
      │   at most once per record_ttl_s, the cards kept from it reused in between
      └ the rosters of the first MAX_ROSTERS peers in `prefer` (<swarm>/roster/<id>, overlay/roster.py)
      ─► named, in this order: `prefer`, peers seen working here, the rosters' peers, peers that asked
         (at most limit/4 of those)
      ─► each named peer no shard returned: read by its own key (<swarm>/card/<id>); in a sample of a
         sharded swarm only `prefer` and the peers seen working here
      ─► named cards first, then each shard's others: incumbents (returned before), then newest
      ─► at most `limit` (overlay.max_cards) cards a shard, its named peers included
      ─► whole reads: how many cards the shards hold (overlay/shards.py `ShardDepth`: the depth the
         learner's head asks for)

    read_named(peers): exactly these peers' cards, by their own keys, and no shard read (a follower
      that its broadcast plan places reads its upstream peers so: policy/follower.py)

Anyone can sign cards with fresh keys, so a shard may hold any number: a reply then carries part of
it or fails outright (over hivemind's 4 MiB message cap). Nothing a reader needs comes from one
alone: peers it has evidence for, and the peers on the rosters it trusts, are read by name. Ranking
happens before parsing, so the cost is bounded by `limit` a shard whatever the DHT returns, and the
learner deepens the shards as the swarm grows, so an honest shard holds ~CARDS_PER_SHARD cards and
a follower's sample costs the same at 10 peers or 10,000.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections import Counter, OrderedDict
from collections.abc import Collection
from typing import Any

from hivemind.utils.serializer import MSGPackSerializer

from echo2swarm.config.models import OverlayConfig
from echo2swarm.overlay.dht_keys import card_key, roster_key, shard_key, shard_of
from echo2swarm.overlay.roster import WorkLog
from echo2swarm.overlay.shards import ShardDepth
from echo2swarm.overlay.validation import SwarmRecordValidator
from echo2swarm.runtime.logging import get_logger
from echo2swarm.wire.records import PeerCard, RecordError, RosterRecord

logger = get_logger(__name__)
MAX_ROSTERS = 4  # rosters read per call: those of the first peers in `prefer` (the publishers it trusts)
KEYS_PER_GET = 16  # per-peer keys per DHT query: one key bloated past the reply cap spoils only its batch
READ_TIMEOUTS = 4  # a DHT read gives up after this many overlay.dht_timeout_s (a lookup is a few hops)
MAX_STUCK_READS = 8  # reads given up on and still not ended: past this many no new read begins (memory bound)
SHARD_READS_AT_ONCE = 8  # card shards queried at a time by a whole read
PAGE_SHARDS = 16  # card shards a page of `peers` reads (~2,000 peers at CARDS_PER_SHARD)

Entry = tuple[Any, Any, float]  # (subkey, value, DHT expiration)


def dht_time() -> float:
    return time.time()


class CardReader:
    """Reads cards for one overlay; remembers what it read (addresses, reachability, incumbents)."""

    def __init__(self, config: OverlayConfig, node: Any, validator: SwarmRecordValidator, work: WorkLog,
                 peer_id: str = ""):
        self.config = config
        self.work_peer_id = peer_id  # ours: a sample read looks in our own shard first
        self.depth = ShardDepth(config.record_ttl_s)
        self.shard_sizes: dict[str, int] = {}  # shard key -> entries its last read returned (at most 2,047 keys)
        self._turn = -1  # the other shard a sample read looks in, in turn
        self.node = node
        self.validator = validator
        self.work = work
        self.cards_dropped = 0  # valid cards left out by the max_cards bound, over all reads
        # What reading cards cost: `calls` of read(), `shared` reads of the one dictionary of every card,
        # `named` calls of read_named(), `own_keys` cards looked up by their own keys (what a control
        # plane that grows with N is made of)
        self.reads: Counter[str] = Counter()
        self.rosters: dict[str, RosterRecord] = {}  # signer -> its roster, as the last read that named it found it
        self._recent: OrderedDict[str, float] = OrderedDict()  # peer id -> monotonic time last returned
        self.maddrs: OrderedDict[str, tuple[str, ...]] = OrderedDict()  # peer id -> its newest card's maddrs
        self.reach: OrderedDict[str, str | None] = OrderedDict()  # peer id -> its newest card's reachability
        self._kept: dict[str, list[Entry]] = {}  # while a shard is flooded: the entries its read kept
        self._next: dict[str, float] = {}  # while a shard is flooded: monotonic time it is read again
        self._flood_logged = float("-inf")
        self._stuck = 0  # reads given up on (`_get_dicts`) that have not ended yet

    # -- DHT ---------------------------------------------------------------------------------------
    def _ended(self, read: "asyncio.Future[Any]") -> None:
        """A read given up on ended at last; its outcome, nobody's, is consumed (asyncio would log an
        exception never retrieved)."""
        self._stuck -= 1
        if not read.cancelled():
            read.exception()

    async def get_dict(self, key: str) -> list[Entry]:
        return (await self._get_dicts([key])).get(key, [])

    async def _get_dicts(self, keys: list[str]) -> dict[str, list[Entry]]:
        """Live entries of each dictionary under `keys` (latest values), queried KEYS_PER_GET keys at a time.

        A read that has not finished within READ_TIMEOUTS x overlay.dht_timeout_s finds nothing (counted
        `timed_out`): every request of it is bounded by dht_timeout_s, but a request whose cancellation
        itself never completes (a libp2p call stuck in p2pd) would otherwise hold the reader, a
        follower's loop included, for good. It is cancelled and left behind, not awaited; while
        MAX_STUCK_READS of those have not ended, a read finds nothing at once (counted `timed_out` too)."""
        if self._stuck >= MAX_STUCK_READS:
            self.reads["timed_out"] += 1
            return {}
        batches = [keys[i:i + KEYS_PER_GET] for i in range(0, len(keys), KEYS_PER_GET)]
        read = asyncio.gather(*(self.node.get_many(b, sufficient_expiration_time=float("inf")) for b in batches))
        done, _ = await asyncio.wait({read}, timeout=READ_TIMEOUTS * self.config.dht_timeout_s)
        if not done:
            read.cancel()
            self._stuck += 1
            read.add_done_callback(self._ended)  # whenever it ends: its outcome is nobody's
            self.reads["timed_out"] += 1
            logger.warning("a DHT read of %d key(s) (%s...) did not finish within %.0f s; treated as finding nothing",
                           len(keys), keys[0][:48] if keys else "", READ_TIMEOUTS * self.config.dht_timeout_s)
            return {}
        results = read.result()
        now = dht_time()
        out: dict[str, list[Entry]] = {}
        for found in results:
            for key, item in found.items():
                if item is None or not hasattr(item.value, "items"):
                    continue
                out[key] = [(subkey, v.value, v.expiration_time) for subkey, v in item.value.items()
                            if v.expiration_time > now]
        return out

    # -- parsing -----------------------------------------------------------------------------------
    def _card(self, entry: Entry) -> PeerCard:
        subkey, value, expiration = entry
        if not isinstance(subkey, str):
            raise RecordError("card under a non-string subkey")
        card = self.validator.card(subkey, value, MSGPackSerializer.dumps(value))
        card.check_times(expiration)
        return card

    def _roster(self, signer: str, entries: list[Entry]) -> RosterRecord | None:
        for subkey, value, expiration in entries:
            if subkey != signer:
                continue  # entries under another subkey are not the signer's (the key's owner cannot stop them)
            try:
                roster = self.validator.roster(subkey, value)
                roster.check_times(expiration)
                return roster
            except RecordError as e:
                logger.debug("ignoring roster of %s: %s", signer[-8:], e)
        return None

    # -- the read ----------------------------------------------------------------------------------
    def _shards(self, whole: bool, page: int | None = None) -> list[tuple[str, int, int]]:
        """(key, depth, shard) of the card shards a read looks at now: every shard at every depth in
        use (`whole`), or this node's own shard at each and one other at the current depth, in turn;
        with `page` (from 0), only that page's PAGE_SHARDS shards of the current depth."""
        swarm, own = self.config.swarm, self.work_peer_id
        if page is not None:
            bits = self.depth.bits
            return [(shard_key(swarm, bits, s), bits, s)
                    for s in range(page * PAGE_SHARDS, min(1 << bits, (page + 1) * PAGE_SHARDS))]
        out: list[tuple[str, int, int]] = []
        for bits in self.depth.depths():
            if whole:
                out += [(shard_key(swarm, bits, s), bits, s) for s in range(1 << bits)]
                continue
            mine = shard_of(own, bits) if own else 0
            out.append((shard_key(swarm, bits, mine), bits, mine))
            if bits == self.depth.bits and bits > 0:
                self._turn = (self._turn + 1) % (1 << bits)
                other = self._turn if self._turn != mine else (self._turn + 1) % (1 << bits)
                out.append((shard_key(swarm, bits, other), bits, other))
        return out

    async def _read_shards(self, keys: list[str]) -> dict[str, list[Entry]]:
        """Each shard in a query of its own (a shard's reply may be megabytes: one per message), at most
        SHARD_READS_AT_ONCE at a time."""
        if len(keys) <= 1:
            return await self._get_dicts(keys) if keys else {}
        gate = asyncio.Semaphore(SHARD_READS_AT_ONCE)

        async def one(key: str) -> dict[str, list[Entry]]:
            async with gate:
                return await self._get_dicts([key])

        out: dict[str, list[Entry]] = {}
        for found in await asyncio.gather(*(one(k) for k in keys)):
            out.update(found)
        return out

    def pages(self) -> int:
        """How many pages of PAGE_SHARDS card shards the swarm's cards span at the current depth."""
        return -(-(1 << self.depth.bits) // PAGE_SHARDS)

    async def read(self, prefer: Collection[str], limit: int, whole: bool = True,
                   page: int | None = None) -> tuple[list[PeerCard], int]:
        """`limit`: cards kept per shard, the named peers in it included. `whole`: every shard (the learner);
        else a sample: this node's shard and one other in turn (a follower finding holders). `page`:
        one page of shards (`peers` in a large swarm), the named peers with it."""
        swarm = self.config.swarm
        prefer = list(dict.fromkeys(prefer))
        signers = prefer[:MAX_ROSTERS]
        shards = self._shards(whole, page)
        now = time.monotonic()
        due = [key for key, _, _ in shards if now >= self._next.get(key, float("-inf"))]
        self.reads["calls"] += 1
        timed_out = self.reads["timed_out"]
        self.reads["shared"] += len(due)
        fresh, found = await asyncio.gather(
            self._read_shards(due), self._get_dicts([roster_key(swarm, p) for p in signers]),
        )
        for key in due:
            fresh.setdefault(key, [])
        self.rosters = {s: r for s in signers if (r := self._roster(s, found.get(roster_key(swarm, s), []))) is not None}
        on_rosters = [e.peer_id for r in self.rosters.values() for e in r.peers]
        asked = self.work.asked()[: limit // 4]  # identities are free: askers get a share, never the whole room
        named = list(dict.fromkeys([*prefer, *self.work.worked(), *on_rosters, *asked]))[:limit]

        # Named peers: from a fresh shard read if it returned them, else by their own keys.
        by_subkey = {e[0]: e for entries in fresh.values() for e in entries if isinstance(e[0], str)}
        chosen: dict[str, PeerCard] = {}
        bad = 0
        missing = []
        for peer in named:
            entry = by_subkey.get(peer)
            try:
                if entry is None:
                    raise KeyError(peer)
                chosen[peer] = self._card(entry)
            except (KeyError, RecordError):
                missing.append(peer)
        if missing and not whole and any(bits > 0 for _, bits, _ in shards):
            # A sample of a sharded swarm: by their own keys only the peers asked for and those seen working
            # here; a roster's peers (128) or askers outside the sample would cost a lookup each, every read.
            keep = {*prefer, *self.work.worked()}
            missing = [p for p in missing if p in keep]
        if missing:
            own, bad = await self._own_cards(missing)
            chosen.update(own)
        cards = [chosen[p] for p in named if p in chosen]

        # The rest, per shard: incumbents, then newest `updated_ms` (a date ahead of ours counts as now).
        now_ms = int(time.time() * 1000)

        def rank(entry: Entry) -> tuple[bool, int]:
            subkey, value, _ = entry
            updated = value.get("updated_ms") if isinstance(value, dict) else None
            updated = min(updated, now_ms) if type(updated) is int else -1
            return (isinstance(subkey, str) and subkey in self._recent, updated if isinstance(subkey, str) else -2)

        refused = left_out = total = 0
        taken: set[Any] = set(chosen)
        named_in = {bits: Counter(shard_of(p, bits) for p in chosen) for bits in {b for _, b, _ in shards}}
        for key, bits, shard in shards:
            entries = fresh[key] if key in fresh else [e for e in self._kept.get(key, []) if e[2] > dht_time()]
            others = [e for e in entries if e[0] not in taken]
            room = max(0, limit - named_in[bits][shard])  # the named peers of this shard count in its `limit`
            # Up to 2x the room is parsed, so a few bad records at the top cannot crowd out good ones.
            ranked = heapq.nlargest(2 * room, others, key=rank) if len(others) > room else sorted(others, key=rank, reverse=True)
            kept: set[Any] = set()
            refused_here = 0
            for entry in ranked:
                if len(kept) >= room:
                    break
                try:
                    cards.append(self._card(entry))
                    kept.add(entry[0])
                except RecordError as e:
                    refused_here += 1
                    logger.debug("ignoring peer record %s: %s", str(entry[0])[:16], e)
            taken |= kept
            refused += refused_here
            left_out += max(0, len(others) - len(kept) - refused_here)
            if key in fresh:
                self.shard_sizes[key] = len(entries)
                # Flooded: more cards than anyone keeps, or none at all though named peers' own keys hold
                # some of this shard's (a reply over hivemind's message cap fails whole): read again one TTL later.
                flooded = len(entries) > limit or (not entries and any(shard_of(p, bits) == shard for p in chosen))
                self._kept[key] = [e for e in entries if e[0] in kept or e[0] in chosen] if flooded else []
                self._next[key] = time.monotonic() + self.config.record_ttl_s if flooded else float("-inf")
            total += self.shard_sizes.get(key, 0)
        if left_out > 0:
            self.cards_dropped += left_out
            if time.monotonic() - self._flood_logged >= 60.0:  # once a minute: a flood must not flood the log
                self._flood_logged = time.monotonic()
                logger.warning("%d peer cards in %d card shard(s) read; kept %d (overlay.max_cards a shard), left out %d",
                               total, len(shards), len(cards), left_out)
        if whole and page is None and self.reads["timed_out"] == timed_out:  # a read that found nothing for want
            self.depth.observe([(bits, self.shard_sizes.get(key, 0)) for key, bits, _ in shards])  # of time is no count
        self._remember(cards)
        return cards, bad + refused

    async def read_named(self, peers: Collection[str]) -> tuple[list[PeerCard], int]:
        """The cards of exactly these peers, by their own keys (<swarm>/card/<id>), and how many were
        refused: what a follower with a broadcast plan reads (its plan parents and their parents), a few
        small lookups spread over the DHT, whatever the size of the swarm."""
        self.reads["named"] += 1
        own, bad = await self._own_cards(list(dict.fromkeys(peers)))
        cards = list(own.values())
        self._remember(cards)
        return cards, bad

    async def _own_cards(self, peers: list[str]) -> tuple[dict[str, PeerCard], int]:
        """Each peer's valid card under its own key (<swarm>/card/<id>), in `peers`' order, and how many
        were refused; an entry under another subkey there is not that peer's card and is skipped."""
        self.reads["own_keys"] += len(peers)
        found = await self._get_dicts([card_key(self.config.swarm, p) for p in peers])
        cards: dict[str, PeerCard] = {}
        bad = 0
        for peer in peers:
            for entry in found.get(card_key(self.config.swarm, peer), []):
                if entry[0] != peer:
                    continue
                try:
                    cards[peer] = self._card(entry)
                except RecordError as e:
                    bad += 1
                    logger.debug("ignoring card of %s under its own key: %s", peer[-8:], e)
        return cards, bad

    def _remember(self, cards: list[PeerCard]) -> None:
        now = time.monotonic()
        horizon = now - 3 * self.config.record_ttl_s
        bound = 4 * self.config.max_cards
        for card in cards:
            self._recent[card.peer_id] = now
            self._recent.move_to_end(card.peer_id)
            self.maddrs[card.peer_id] = tuple(card.maddrs)
            self.maddrs.move_to_end(card.peer_id)
            self.reach[card.peer_id] = card.reachability
            self.reach.move_to_end(card.peer_id)
        while self._recent and (len(self._recent) > bound or next(iter(self._recent.values())) < horizon):
            self._recent.popitem(last=False)
        for memory in (self.maddrs, self.reach):
            while len(memory) > bound:
                memory.popitem(last=False)


__all__ = ["CardReader", "MAX_ROSTERS"]
