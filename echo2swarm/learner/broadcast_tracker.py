"""The learner's side of dissemination: plan each version's broadcast, and measure T_bcast.

    publish v ─► plan(v): chains or trees over the follower cards seen lately, signed ─► served at /v1/plan/v
    cards (every refresh) ─► arrivals of v at every peer of plan(v) ─► T_bcast(v) = the slowest one

T_bcast(v) is the time until every peer the plan covered holds v (or a newer version it skipped
to), as the peers report it (from seeing the head to installed: durations, so no clock sync
between machines is assumed). Peers that left or went to standby meanwhile are not waited for.
The capacity model reads `t_bcast_s` (EWMA).

A receiver that never reports v (a card that never lists it, a peer that stopped updating, a fake
card) must not freeze the estimate: once v is REPORT_WAIT_S old and REPORT_WAIT_FACTOR times the
slowest arrival reported for it, T_bcast(v) is measured over the receivers that did report, and
the others are counted (`unreported`). One whose card says it is fetching v (or newer) is waited
for up to REPORT_WAIT_MAX_S. A version about to leave the KEEP_PLANS window is settled the same way.

Bounded whatever the DHT holds: the overlay hands over at most `overlay.max_cards` cards, and a
plan puts the followers seen doing work (groups the intake accepted from them) first, in the order
of their uplinks (`planned_upload`: measured, within the cap; self-reported like every card field),
and at most `publish.plan_unproven` (MAX_UNPROVEN) others after them, towards the tail of every chain,
where a card that leads nowhere (anyone can sign cards with fresh keys) holds up no proven peer; in a
tree they forward only on a quarter of the cap they claim (policy/broadcast_plan.py `plan_tree`). The
followers past that bound fetch from planned peers, their foster parents (`BroadcastPlan.fosters`). A planned peer that never
reports a version is planned last, with no uplink counted, for the next DEMOTE_VERSIONS versions.

The evidence is published too: every refresh, the peers whose delivered groups grew are noted with
the overlay (`saw_work`), which reads their cards by their own keys first; every announce period
the overlay's roster of them is signed and stored (overlay/roster.py), less the banned peers, so
followers and `echo2swarm peers` read those cards first however many others the DHT holds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping

from echo2swarm.overlay.node import Overlay
from echo2swarm.wire.records import PeerCard
from echo2swarm.policy.broadcast_plan import MAX_UNPROVEN, make_plan, nat_peers
from echo2swarm.wire.signing import PolicyKey
from echo2swarm.runtime.logging import get_logger

logger = get_logger(__name__)
KEEP_PLANS = 16
DEMOTE_VERSIONS = 16  # versions for which a planned peer that never reported one is planned last
REPORT_WAIT_S = 30.0  # a receiver silent about v this long after its publish...
REPORT_WAIT_FACTOR = 3.0  # ...and this many times the slowest reported arrival of v is left out of T_bcast(v)
REPORT_WAIT_MAX_S = 600.0  # one whose card says it is fetching v (or newer) is waited for this long at most



def planned_upload(card: PeerCard) -> int | None:
    """The upload bytes/s a plan counts on for a peer: what its uploads were measured to sustain
    (`uplink_bps`), never above its cap (`upload_bps`); its cap alone while unmeasured (None: uncapped,
    planned as fastest, so a newcomer is tried early in a chain and measured there)."""
    if card.uplink_bps is None:
        return card.upload_bps
    return card.uplink_bps if card.upload_bps is None else min(card.upload_bps, card.uplink_bps)

class BroadcastTracker:
    def __init__(self, overlay: Overlay, key: PolicyKey, seeds: int, refresh_s: float, ewma_alpha: float,
                 clock: Callable[[], float] = time.monotonic, excluded: Callable[[], Collection[str]] = lambda: (),
                 delivered: Callable[[], Mapping[str, int]] = dict, shape: str = "auto", unproven: int = MAX_UNPROVEN):
        self.overlay = overlay
        self.delivered = delivered  # groups accepted per peer so far (the intake's tally): evidence of work
        self._delivered_seen: dict[str, int] = {}
        self.ewma_alpha = ewma_alpha  # activation.ewma_alpha: the weight of the newest version's T_bcast
        self.excluded = excluded  # peers never planned as receivers or parents (the learner banned them)
        self.key = key
        self.seeds = seeds
        self.shape = shape  # publish.plan_shape: chains, trees, or auto (trees from TREE_FROM receivers)
        self.unproven = unproven  # publish.plan_unproven: followers not seen working that a plan places at most
        self.refresh_s = refresh_s
        self.cards: list[PeerCard] = []
        self.plans: OrderedDict[int, bytes] = OrderedDict()
        self._receivers: OrderedDict[int, set[str]] = OrderedDict()
        self.t_bcast: OrderedDict[int, float] = OrderedDict()  # version -> seconds, once complete
        self.t_bcast_s: float | None = None  # EWMA over completed versions
        self.clock = clock
        self._published: dict[int, float] = {}  # version -> clock() at plan(), while it is not settled
        self.unreported: OrderedDict[int, int] = OrderedDict()  # version -> receivers left out of T_bcast(v)
        self.unreported_total = 0  # receivers left out, over every settled version
        self._silent_logged: list[str] = []
        # Per settled version (the last DEMOTE_VERSIONS), the planned peers that never reported it: planned
        # last (no uplink counted) while they are in there, so none forwards a stripe to others again soon.
        self.silent: OrderedDict[int, frozenset[str]] = OrderedDict()

    def followers(self) -> list[PeerCard]:
        excluded = self.excluded()
        return [c for c in self.cards
                if c.role in ("rollout", "relay", "verifier") and c.state != "stopping" and c.peer_id not in excluded]

    def plan(self, version: int) -> bytes:
        """Plan the broadcast of `version` over the followers seen lately; kept for /v1/plan/{version}."""
        undialable = {c.peer_id for c in self.cards if c.reachability == "private"}  # NAT'd, no relay slot yet
        demoted = self.demoted()
        receivers = [(p, 0 if p in demoted else bps) for p, bps in self.receivers() if p not in undialable]
        plan = make_plan(self.key, self.overlay.config.swarm, version, self.overlay.peer_id, receivers, self.seeds,
                         nat=nat_peers(self.cards),  # direct edges first; relayed ones load their relay too
                         proven=self._proven() - demoted,  # peers seen working ahead of the rest, whatever they claim
                         shape=self.shape)  # type: ignore[arg-type]
        data = plan.to_bytes()
        self.plans[version] = data
        self._receivers[version] = {peer for peer, _ in receivers}
        while len(self.plans) > KEEP_PLANS:
            self.plans.popitem(last=False)
        self._published[version] = self.clock()
        while len(self._receivers) > KEEP_PLANS:
            oldest, receivers = next(iter(self._receivers.items()))
            if oldest not in self.t_bcast and oldest in self._published:
                self._settle(oldest, receivers, self._live(), self.clock(), force=True)
            self._receivers.popitem(last=False)
            self._published.pop(oldest, None)
        return data

    def demoted(self) -> set[str]:
        """Peers planned for one of the last DEMOTE_VERSIONS versions that never reported it."""
        return set().union(*self.silent.values()) if self.silent else set()

    def _proven(self) -> set[str]:
        worked_fn = getattr(self.overlay, "worked", None)  # overlays without work tracking (test doubles): none proven
        return set(worked_fn()) if worked_fn is not None else set()

    def receivers(self) -> list[tuple[str, int | None]]:
        """(peer id, upload bytes/s) to plan over, with their uplinks (`planned_upload`): the followers seen
        working, then at most `unproven` others (newest cards first; publish.plan_unproven, MAX_UNPROVEN by
        default); `plan` ranks the latter after the former. The rest fetch from their foster parents in the
        plan (`BroadcastPlan.fosters`)."""
        worked = self._proven()
        followers = self.followers()
        proven = [c for c in followers if c.peer_id in worked]
        others = sorted((c for c in followers if c.peer_id not in worked), key=lambda c: -c.updated_ms)[:self.unproven]
        return [(c.peer_id, planned_upload(c)) for c in proven + others]

    def note_deliveries(self) -> None:
        """Tell the overlay which peers delivered groups since the last look (evidence of work)."""
        for peer, groups in list(self.delivered().items()):
            if groups > self._delivered_seen.get(peer, 0):
                self._delivered_seen[peer] = groups
                self.overlay.saw_work(peer, "delivered")

    async def publish_roster(self) -> None:
        """Sign and store the overlay's roster of the peers seen working, less the ones we banned."""
        roster = await self.overlay.store_roster(exclude=set(self.excluded()))
        logger.debug("roster of %d peers seen working stored", len(roster.peers))

    def get_plan(self, version: int) -> bytes | None:
        return self.plans.get(version)

    def _live(self) -> dict[str, PeerCard]:
        return {c.peer_id: c for c in self.followers() if c.active is not False}

    def observe(self, cards: list[PeerCard], now: float | None = None) -> None:
        """Update T_bcast from fresh cards: v is complete once every live planned peer holds v or newer,
        or, past the report bound, over the live planned peers that reported it.

        A peer that skipped v (it was busy fetching v-1 when v appeared) counts with the first
        newer version it installed: a version that nobody fetches is not a reason to never measure.
        Standby rollout peers are not waited for (T_bcast is about the active set).
        """
        self.cards = cards
        now = self.clock() if now is None else now
        live = self._live()
        for version, receivers in list(self._receivers.items()):
            if version in self.t_bcast or version not in self._published:
                continue
            self._settle(version, receivers, live, now, force=False)
        while len(self.t_bcast) > KEEP_PLANS:
            self.t_bcast.popitem(last=False)

    def _settle(self, version: int, receivers: set[str], live: dict[str, PeerCard], now: float, force: bool) -> None:
        """Measure T_bcast(version) if every live receiver reported it, or if the bound has passed
        (or `force`) over those that did; the rest are counted as unreported."""
        reported: list[float] = []
        silent: list[PeerCard] = []
        for peer in receivers:
            card = live.get(peer)
            if card is None:
                continue  # left or on standby: not waited for
            later = [a for a in card.arrivals if a.version >= version]
            if later:
                reported.append(min(later, key=lambda a: a.version).seconds)
            else:
                silent.append(card)
        if silent and not force:
            age = now - self._published[version]
            if age <= max(REPORT_WAIT_S, REPORT_WAIT_FACTOR * max(reported, default=0.0)):
                return
            fetching = any(c.fetching is not None and c.fetching >= version for c in silent)
            if (fetching or not reported) and age <= REPORT_WAIT_MAX_S:
                return  # a receiver on its way, or nobody at all yet: wait longer
        if not reported and not silent:
            return  # no live receiver: never measured
        self.silent[version] = frozenset(c.peer_id for c in silent)  # settled: who never reported it
        while len(self.silent) > DEMOTE_VERSIONS:
            self.silent.popitem(last=False)
        if silent:
            del self._published[version]  # settled: not looked at again
            self.unreported[version] = len(silent)
            self.unreported_total += len(silent)
            while len(self.unreported) > KEEP_PLANS:
                self.unreported.popitem(last=False)
            names = sorted(c.peer_id[-8:] for c in silent)
            # Logged when the silent peers change; the same ones version after version at debug level.
            logger.log(logging.INFO if names != self._silent_logged else logging.DEBUG,
                       "T_bcast(v%d): %d of %d planned peers never reported it (%s); %s", version, len(silent),
                       len(silent) + len(reported), ", ".join(names[:8]),
                       f"measured over the {len(reported)} that did" if reported else "not measured")
            self._silent_logged = names
        if not reported:
            return
        worst = max(reported)
        self._published.pop(version, None)
        self.t_bcast[version] = worst
        self.t_bcast_s = worst if self.t_bcast_s is None else (1 - self.ewma_alpha) * self.t_bcast_s + self.ewma_alpha * worst
        logger.debug("T_bcast(v%d) = %.2f s over %d peers", version, worst, len(reported))

    async def run(self, stop: asyncio.Event) -> None:
        roster_due, roster = float("-inf"), None
        try:
            while not stop.is_set():
                started = time.monotonic()
                self.note_deliveries()
                if started >= roster_due and (roster is None or roster.done()):  # beside the refreshes, not in their way
                    roster_due = started + self.overlay.config.announce_period_s
                    roster = asyncio.create_task(self.publish_roster())
                    roster.add_done_callback(_log_failure)
                try:
                    cards, _ = await self.overlay.get_cards()
                    self.observe(cards)
                except Exception as e:  # the DHT may hiccup; the next refresh tries again
                    logger.debug("card refresh failed: %s", e)
                try:
                    await asyncio.wait_for(stop.wait(), max(0.05, self.refresh_s - (time.monotonic() - started)))
                except asyncio.TimeoutError:
                    pass
        finally:
            if roster is not None:
                roster.cancel()


def _log_failure(task: "asyncio.Task[None]") -> None:
    if not task.cancelled() and task.exception() is not None:  # the DHT may hiccup; the next period tries again
        logger.debug("roster publication failed: %s", task.exception())
