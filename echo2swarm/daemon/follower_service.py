"""Rollout, relay and verifier peers' service: follow the learner's signed versions; rollout peers also
generate, verifier peers compute the learner's exact checks.

    DHT head ─► PolicyFollower (verify, fetch, install) ─► held version in the peer card
                     │           └─► chunk server serves what is verified
                     ├─ on_version ─► RolloutWorker (rollout role): engine swap, leases, generation
                     └─ trusted head's publisher and verifiers ─► CheckServer (verifier role):
                        rpc_check for that learner only (learner/verifiers.py)

The follower and the worker are separate tasks, so a rollout peer keeps generating with the
version it holds while the next one downloads (double-buffering).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from echo2swarm.config.models import RelayConfig, RolloutConfig, VerifierConfig
from echo2swarm.daemon.context import CardFields, DaemonContext, Stats
from echo2swarm.policy.follower import PolicyFollower
from echo2swarm.policy.server import Handler
from echo2swarm.policy.trust import TrustAnchor
from echo2swarm.runtime.logging import get_logger
from echo2swarm.wire.records import HeadRecord
from echo2swarm.wire.signing import load_trusted_key

logger = get_logger(__name__)


class FollowerService:
    """Rollout, relay and verifier peers: follow (fetch, verify, re-serve) every version; rollout peers
    also work, verifier peers also check."""

    def __init__(self, config: RolloutConfig | RelayConfig | VerifierConfig, ctx: DaemonContext):
        self.ctx = ctx
        self.config = config
        pinned = load_trusted_key(config.trust) if config.trust else None
        self.trust = TrustAnchor(Path(config.state_dir), pinned)
        if self.trust.key is not None:
            logger.info("trusting learner key %s (%s)", self.trust.key.fingerprint, self.trust.source)
        else:
            logger.warning("no --trust given: the first learner key seen in the swarm will be pinned")
        self.worker = None
        weights = None
        if isinstance(config, RolloutConfig):
            from echo2swarm.rollout.refit import EngineWeights
            from echo2swarm.rollout.throughput import Throughput

            throughput = Throughput(config, Path(config.state_dir) / "throughput.json")
            weights = EngineWeights(config, on_built=throughput.calibrate)
        self.follower = PolicyFollower(
            ctx.overlay, config.fetch, config.store, self.trust, ctx.chunks, ctx.versions, ctx.session,
            on_version=self._on_version, on_state=self._announce_now, inflight=ctx.inflight,
            in_use=weights.in_use if weights is not None else lambda: (),
        )
        if isinstance(config, RolloutConfig):
            from echo2swarm.rollout.worker import RolloutWorker

            self.worker = RolloutWorker(config, self.follower, weights, throughput, ctx.overlay,
                                        announce=self._announce_now)
        self.checks = None
        if isinstance(config, VerifierConfig):
            from echo2swarm.learner.verifiers import CheckServer

            follower, versions = self.follower, ctx.versions
            self.checks = CheckServer(
                config.check, ctx.overlay.peer_id,
                learner=lambda: (follower.publisher, follower.verifiers) if follower.publisher else None,
                version_dir=lambda v: versions.dir(v) if versions.installed(v) else None)

    def _announce_now(self) -> None:
        self.ctx.announcer.trigger()  # tell the swarm now, not at the next period

    async def _on_version(self, version: int, path: Path) -> None:
        if self.worker is not None:
            await self.worker.on_version(version, path)
        self._announce_now()

    async def start(self) -> None:
        if self.checks is not None:
            from echo2swarm.overlay.rpc import serve
            from echo2swarm.wire.surfaces import VERIFIER_RPC

            await serve(self.ctx.overlay.p2p, self.config.overlay.swarm, VERIFIER_RPC, self.checks)  # rpc_check
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

    def head(self) -> HeadRecord | None:
        return None

    def signed_plan(self, version: int) -> bytes | None:
        return None

    def http_routes(self) -> list[tuple[str, Handler]]:
        return []

    def card_fields(self) -> CardFields:
        mu = self.worker.throughput.rollouts_per_s if self.worker is not None else None
        return CardFields(
            version=self.follower.held_version, state=self.follower.state, fetching=self.follower.fetching_version,
            arrival_s=dict(self.follower.arrival_s), rollouts_per_s=None if mu is None else round(mu, 3),
            active=self.worker.active if self.worker is not None else None,
            fetch_paths={v: (str(p["path"]), int(p["bytes"])) for v, p in self.follower.path_of.items()},  # type: ignore[call-overload]
        )

    def stats(self) -> Stats:
        worker = {}
        if self.worker is not None:
            weights, engine = self.worker.weights, self.worker.weights.engine
            worker = {"worker": self.worker.snapshot(), "rollouts_per_s": self.worker.throughput.rollouts_per_s,
                      "engine_version": weights.version, "swap_s": weights.swap_s,
                      "engine": getattr(engine, "name", None), "refit_s": weights.refit_s,
                      "engine_pid": getattr(engine, "pid", None),
                      "engine_restarts": getattr(engine, "restarts", 0),
                      "engine_busy_s": getattr(engine, "busy_s", None)}
        if self.checks is not None:
            worker["checks"] = self.checks.snapshot()
        return {
            **worker,
            "refused_heads": dict(self.follower.refused),
            "fetch": dict(self.follower.fetcher.stats),
            "fetching_version": self.follower.fetching_version,
            "fetched_from": dict(self.follower.fetcher.bytes_from),
            # delta versions: how many versions came by each path (delta / chain / composite / keyframe),
            # and per recent version its path, the bytes fetched for it and the hops taken
            "fetch_paths": dict(self.follower.paths),
            "fetch_path_of": {str(v): p for v, p in self.follower.path_of.items()},
            "fetch_bytes_last": self.follower.path_of[max(self.follower.path_of)]["bytes"] if self.follower.path_of else None,
            "arrival_s": {str(k): round(v, 3) for k, v in self.follower.arrival_s.items()},
            "trusted_key": self.trust.key.text if self.trust.key else None,
        }
