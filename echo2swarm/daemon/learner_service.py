"""The learner's role service: hosts `Learner` (learner/loop.py) inside the daemon.

    supervisor ── DaemonContext ──► LearnerService ── overlay, stores, announcer ──► Learner
    supervisor ◄── card fields, stats, head, plans, the live page ── LearnerService ◄── Learner

It only translates: the loop, the published versions and the peers' accounting live in learner/.
"""

from __future__ import annotations

import asyncio

from echo2swarm.config.models import LearnerConfig
from echo2swarm.daemon import live_page
from echo2swarm.daemon.context import CardFields, DaemonContext, Stats
from echo2swarm.learner.loop import Learner
from echo2swarm.policy.server import Handler
from echo2swarm.runtime.logging import get_logger
from echo2swarm.wire.records import HeadRecord

logger = get_logger(__name__)


class LearnerService:
    def __init__(self, config: LearnerConfig, ctx: DaemonContext):
        self.learner = Learner(config, overlay=ctx.overlay, chunks=ctx.chunks, versions=ctx.versions,
                               announce=ctx.announcer.trigger)
        self.overlay = ctx.overlay

    async def start(self) -> None:
        await self.learner.start()

    async def run(self, stop: asyncio.Event) -> None:
        await self.learner.run(stop)

    async def announce(self) -> None:
        head = self.head()
        if head is not None and not await self.overlay.store_head(head):
            logger.warning("no DHT peer accepted the head record for v%d", head.version)

    def head(self) -> HeadRecord | None:
        return self.learner.head()

    def signed_plan(self, version: int) -> bytes | None:
        return self.learner.broadcast.get_plan(version)

    def http_routes(self) -> list[tuple[str, Handler]]:
        """The live swarm page and the JSON it reads (daemon/live_page.py)."""
        return live_page.routes(self.learner)

    def card_fields(self) -> CardFields:
        learner = self.learner
        t_bcast = learner.broadcast.t_bcast_s
        bans = {peer: ban.reason for peer, ban in learner.ledger.bans.items()} if learner.intake else {}
        return CardFields(version=learner.published.version if learner.published else None, state=learner.state,
                          t_bcast_s=None if t_bcast is None else round(t_bcast, 3), bans=bans,
                          published=learner.publisher.card_versions())

    def stats(self) -> Stats:
        return self.learner.stats()
