"""Rollout and relay peers' service: follow the learner's signed versions.

    DHT head ─► PolicyFollower (verify, fetch, install) ─► held version in the peer card
                                 └─► chunk server serves what is verified

The follower runs as its own task, so the daemon keeps serving (and, once engines exist, keeps
generating with the version it holds) while a new version downloads.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from echo2swarm.policy.follower import PolicyFollower
from echo2swarm.policy.signing import load_trusted_key
from echo2swarm.policy.trust import TrustAnchor
from echo2swarm.runtime.daemon import DaemonContext
from echo2swarm.runtime.logging import get_logger

logger = get_logger(__name__)


class FollowerService:
    def __init__(self, ctx: DaemonContext):
        self.ctx = ctx
        config = ctx.config
        pinned = load_trusted_key(config.trust) if config.trust else None
        self.trust = TrustAnchor(Path(config.state_dir), pinned)
        if self.trust.key is not None:
            logger.info("trusting learner key %s (%s)", self.trust.key.fingerprint, self.trust.source)
        else:
            logger.warning("no --trust given: the first learner key seen in the swarm will be pinned")
        self.follower = PolicyFollower(
            ctx.overlay, config.fetch, config.store, self.trust, ctx.chunks, ctx.versions, ctx.session,
            on_version=self._on_version,
        )

    async def _on_version(self, version: int, path: Path) -> None:
        if self.ctx.announcer is not None:
            self.ctx.announcer.trigger()  # tell the swarm now, not at the next period

    async def start(self) -> None:
        if self.follower.held_version is not None:
            logger.info("holding policy v%d from a previous run", self.follower.held_version)

    async def run(self, stop: asyncio.Event) -> None:
        await self.follower.run(stop)

    async def announce(self) -> None:
        return None

    def card_fields(self) -> dict[str, Any]:
        return {"version": self.follower.held_version, "state": self.follower.state}

    def stats(self) -> dict[str, Any]:
        return {
            "refused_heads": dict(self.follower.refused),
            "fetch": dict(self.follower.fetcher.stats),
            "arrival_s": {str(k): round(v, 3) for k, v in self.follower.arrival_s.items()},
            "trusted_key": self.trust.key.text if self.trust.key else None,
        }
