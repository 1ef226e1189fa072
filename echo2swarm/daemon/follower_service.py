"""Rollout and relay peers' service: follow the learner's signed versions; rollout peers also generate.

    DHT head ─► PolicyFollower (verify, fetch, install) ─► held version in the peer card
                     │           └─► chunk server serves what is verified
                     └─ on_version ─► RolloutWorker (rollout role): engine swap, leases, generation

The follower and the worker are separate tasks, so a rollout peer keeps generating with the
version it holds while the next one downloads (double-buffering).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from echo2swarm.policy.follower import PolicyFollower
from echo2swarm.wire.signing import load_trusted_key
from echo2swarm.policy.trust import TrustAnchor
from echo2swarm.daemon.supervisor import DaemonContext
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
            on_version=self._on_version, on_state=self._announce_now, inflight=ctx.inflight,
        )
        self.worker = None
        if config.role == "rollout":
            from echo2swarm.rollout.worker import RolloutWorker

            self.worker = RolloutWorker(ctx, self.follower)
            self.follower.in_use = self.worker.weights.in_use

    def _announce_now(self) -> None:
        if self.ctx.announcer is not None:
            self.ctx.announcer.trigger()  # tell the swarm now, not at the next period

    async def _on_version(self, version: int, path: Path) -> None:
        if self.worker is not None:
            await self.worker.on_version(version, path)
        self._announce_now()

    async def start(self) -> None:
        held = self.follower.held_version
        if held is not None:
            logger.info("holding policy v%d from a previous run", held)
            await self._on_version(held, self.ctx.versions.dir(held))
            self.follower.ready_version = held

    async def run(self, stop: asyncio.Event) -> None:
        tasks = [asyncio.create_task(self.follower.run(stop))]
        if self.worker is not None:
            tasks.append(asyncio.create_task(self.worker.run(stop)))
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            if self.worker is not None:
                await asyncio.gather(*tasks, return_exceptions=True)
                await asyncio.to_thread(self.worker.close)

    async def announce(self) -> None:
        return None

    def _worker_fields(self) -> dict[str, Any]:
        if self.worker is None:
            return {}
        mu = self.worker.throughput.rollouts_per_s
        return {"rollouts_per_s": None if mu is None else round(mu, 3), "active": self.worker.active}

    def card_fields(self) -> dict[str, Any]:
        return {**self._worker_fields(), "version": self.follower.held_version, "state": self.follower.state,
                "fetching": self.follower.fetching_version, "arrival_s": dict(self.follower.arrival_s)}

    def stats(self) -> dict[str, Any]:
        worker = {}
        if self.worker is not None:
            weights, engine = self.worker.weights, self.worker.weights.engine
            worker = {"worker": self.worker.snapshot(), "rollouts_per_s": self.worker.throughput.rollouts_per_s,
                      "engine_version": weights.version, "swap_s": weights.swap_s,
                      "engine": getattr(engine, "name", None), "refit_s": weights.refit_s,
                      "engine_pid": getattr(engine, "pid", None),
                      "engine_restarts": getattr(engine, "restarts", 0),
                      "engine_busy_s": getattr(engine, "busy_s", None)}
        return {
            **worker,
            "refused_heads": dict(self.follower.refused),
            "fetch": dict(self.follower.fetcher.stats),
            "fetching_version": self.follower.fetching_version,
            "fetched_from": dict(self.follower.fetcher.bytes_from),
            "arrival_s": {str(k): round(v, 3) for k, v in self.follower.arrival_s.items()},
            "trusted_key": self.trust.key.text if self.trust.key else None,
        }
