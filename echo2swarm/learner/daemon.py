"""The learner's service inside the daemon.

    --model DIR ─► Publisher (chunks + signed manifest in the learner's stores) ─► head in the DHT
                                                      └─► chunk server hands them to followers

A restarted learner publishes with a strictly higher version than any it published before, so
followers that hold an older version move on and never go back. (GRPO training plugs in here.)
"""

from __future__ import annotations

import asyncio
from typing import Any

from echo2swarm.config.models import LearnerConfig
from echo2swarm.learner.publisher import PublishedVersion, Publisher
from echo2swarm.policy.manifest import HeadRecord
from echo2swarm.policy.signing import PolicyKey
from echo2swarm.runtime.daemon import DaemonContext
from echo2swarm.runtime.logging import get_logger

logger = get_logger(__name__)


class LearnerService:
    def __init__(self, ctx: DaemonContext):
        self.ctx = ctx
        self.config: LearnerConfig = ctx.config
        self.key = PolicyKey.load(self.config.publish.policy_key)  # type: ignore[arg-type]
        self.publisher = Publisher(
            self.config.overlay.swarm, self.key, ctx.chunks, ctx.versions, self.config.publish.chunk_size, ctx.overlay.peer_id
        )
        self.published: PublishedVersion | None = None
        self.state = "starting"

    async def start(self) -> None:
        version = (self.ctx.versions.latest() or 0) + 1
        self.published = await asyncio.to_thread(self.publisher.publish_dir, self.config.publish.model, version)  # type: ignore[arg-type]
        self.state = "ready"
        if self.ctx.announcer is not None:
            self.ctx.announcer.trigger()
        logger.info("policy key %s; followers pin it with --trust %s", self.key.public.fingerprint, self.key.public.text)

    async def run(self, stop: asyncio.Event) -> None:
        await stop.wait()

    def current_head(self) -> HeadRecord | None:
        if self.published is None:
            return None
        return self.publisher.sign_head(self.published, self.config.overlay.record_ttl_s)

    async def announce(self) -> None:
        head = self.current_head()
        if head is not None and not await self.ctx.overlay.store_head(head):
            logger.warning("no DHT peer accepted the head record for v%d", head.version)

    def card_fields(self) -> dict[str, Any]:
        return {"version": self.published.version if self.published else None, "state": self.state}

    def stats(self) -> dict[str, Any]:
        return {"published_version": self.published.version if self.published else None}
