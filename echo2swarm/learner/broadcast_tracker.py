"""The learner's side of dissemination: plan each version's broadcast, and measure T_bcast.

    publish v ─► plan(v): chains over the follower cards seen lately, signed ─► served at /v1/plan/v
    cards (every refresh) ─► arrivals of v at every peer of plan(v) ─► T_bcast(v) = the slowest one

T_bcast(v) is the time until every peer the plan covered holds v (or a newer version it skipped
to), as the peers report it (from seeing the head to installed: durations, so no clock sync
between machines is assumed). Peers that left or went to standby meanwhile are not waited for.
The capacity model reads `t_bcast_s` (EWMA).

Bounded whatever the DHT holds: the overlay hands over at most `overlay.max_cards` cards, and a
plan puts the followers seen doing work here (leases, submissions) first, in the order their
upload caps give, and at most MAX_UNPROVEN others after them, at the tail of every chain, where
a card that leads nowhere (anyone can sign cards with fresh keys) holds up no proven peer.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict

from echo2swarm.overlay.node import Overlay
from echo2swarm.wire.records import PeerCard
from echo2swarm.policy.broadcast_plan import make_plan
from echo2swarm.wire.signing import PolicyKey
from echo2swarm.runtime.logging import get_logger

logger = get_logger(__name__)
KEEP_PLANS = 16
MAX_UNPROVEN = 32  # followers never seen doing work that a plan covers (relays, newcomers, fakes)
EWMA_ALPHA = 0.3


class BroadcastTracker:
    def __init__(self, overlay: Overlay, key: PolicyKey, seeds: int, refresh_s: float):
        self.overlay = overlay
        self.key = key
        self.seeds = seeds
        self.refresh_s = refresh_s
        self.cards: list[PeerCard] = []
        self.plans: OrderedDict[int, bytes] = OrderedDict()
        self._receivers: OrderedDict[int, set[str]] = OrderedDict()
        self.t_bcast: OrderedDict[int, float] = OrderedDict()  # version -> seconds, once complete
        self.t_bcast_s: float | None = None  # EWMA over completed versions

    def followers(self) -> list[PeerCard]:
        return [c for c in self.cards if c.role in ("rollout", "relay") and c.state != "stopping"]

    def plan(self, version: int) -> bytes:
        """Plan the broadcast of `version` over the followers seen lately; kept for /v1/plan/{version}."""
        receivers = self.receivers()
        plan = make_plan(self.key, self.overlay.config.swarm, version, self.overlay.peer_id, receivers, self.seeds)
        data = plan.to_bytes()
        self.plans[version] = data
        self._receivers[version] = {peer for peer, _ in receivers}
        while len(self.plans) > KEEP_PLANS:
            self.plans.popitem(last=False)
        while len(self._receivers) > KEEP_PLANS:
            self._receivers.popitem(last=False)
        return data

    def receivers(self) -> list[tuple[str, int | None]]:
        """(peer id, upload cap) to plan over: proven followers with their caps, then a few others as the slowest."""
        worked_fn = getattr(self.overlay, "worked", None)  # overlays without work tracking (test doubles): none proven
        worked = worked_fn() if worked_fn is not None else set()
        followers = self.followers()
        proven = [(c.peer_id, c.upload_bps) for c in followers if c.peer_id in worked]
        others = sorted((c for c in followers if c.peer_id not in worked), key=lambda c: -c.updated_ms)[:MAX_UNPROVEN]
        if not proven:  # nobody to protect: the others keep their caps
            return [(c.peer_id, c.upload_bps) for c in others]
        # A cap of 0 sorts after every proven peer (plan_chains orders uncapped, then fastest first).
        return proven + [(c.peer_id, 0) for c in others]

    def get_plan(self, version: int) -> bytes | None:
        return self.plans.get(version)

    def observe(self, cards: list[PeerCard]) -> None:
        """Update T_bcast from fresh cards: v is complete once every live planned peer holds v or newer.

        A peer that skipped v (it was busy fetching v-1 when v appeared) counts with the first
        newer version it installed: a version that nobody fetches is not a reason to never measure.
        Standby rollout peers are not waited for (T_bcast is about the active set).
        """
        self.cards = cards
        live = {c.peer_id: c for c in self.followers() if c.active is not False}
        for version, receivers in list(self._receivers.items()):
            if version in self.t_bcast:
                continue
            waiting = [live[p] for p in receivers if p in live]
            worst: float | None = None
            for card in waiting:
                later = [a for a in card.arrivals if a.version >= version]
                if not later:
                    worst = None
                    break
                seconds = min(later, key=lambda a: a.version).seconds
                worst = seconds if worst is None else max(worst, seconds)
            if worst is not None:
                self.t_bcast[version] = worst
                self.t_bcast_s = worst if self.t_bcast_s is None else (1 - EWMA_ALPHA) * self.t_bcast_s + EWMA_ALPHA * worst
                logger.debug("T_bcast(v%d) = %.2f s over %d peers", version, worst, len(waiting))
        while len(self.t_bcast) > KEEP_PLANS:
            self.t_bcast.popitem(last=False)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            started = time.monotonic()
            try:
                cards, _ = await self.overlay.get_cards()
                self.observe(cards)
            except Exception as e:  # the DHT may hiccup; the next refresh tries again
                logger.debug("card refresh failed: %s", e)
            try:
                await asyncio.wait_for(stop.wait(), max(0.05, self.refresh_s - (time.monotonic() - started)))
            except asyncio.TimeoutError:
                pass
