"""The daemon every participant runs; the role only changes which service sits in the middle.

    start: overlay (DHT + p2pd) ─► stores, announcer ─► role service ─► HTTP server ─► daemon.json, banner
    run:   supervise the role service (restart with back-off if it crashes) and the announcer
    stop:  SIGTERM/SIGINT ─► role service, announce `stopping`, HTTP server, DHT node, p2pd

Back-pressure: the follower fetches one version at a time with a bounded number of chunks in
flight; the chunk server caps concurrent responses. Every daemon runs one HTTP server: /metrics
(daemon/prometheus.py) and /v1/info always, chunks for other peers unless it is a bootstrap or
`--no-chunk-server`. `daemon.json` in the state dir tells tests and tools the peer id, multiaddrs,
chunk URL and HTTP URL without parsing logs, and the card's reachability as it changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import signal
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp

from echo2swarm import __version__
from echo2swarm.config.loading import AnyDaemonConfig, dump_config
from echo2swarm.config.models import LearnerConfig, RelayConfig, RolloutConfig, VerifierConfig
from echo2swarm.daemon.banner import start_banner
from echo2swarm.daemon.context import BootstrapService, DaemonContext, RoleService
from echo2swarm.daemon.prometheus import daemon_registry, metrics_route
from echo2swarm.overlay.announcer import Announcer
from echo2swarm.overlay.node import BootstrapError, Overlay
from echo2swarm.overlay.reachability import DialbackService, ReachabilityTracker, serve_dialback
from echo2swarm.overlay.rejoin import RejoinList
from echo2swarm.overlay.streams import stream_paths
from echo2swarm.policy.limiter import RateLimiter
from echo2swarm.policy.pipeline import InFlight
from echo2swarm.policy.server import ChunkServer, ChunkService
from echo2swarm.policy.store import ChunkStore, VersionStore
from echo2swarm.runtime import dump
from echo2swarm.runtime.aio import backoff_s
from echo2swarm.runtime.logging import get_logger
from echo2swarm.wire.records import MAX_BANS_ON_CARD, Arrival, BanNote, PeerCard, VersionNote

logger = get_logger(__name__)
EXIT_OK, EXIT_CONFIG, EXIT_FAILED = 0, 2, 1


def _delivered(learner: Any) -> Callable[[], Mapping[str, int]]:
    """Groups the learner's intake accepted per peer id (`Intake.delivered`), banned peers left out."""

    def counts() -> Mapping[str, int]:
        intake = learner.intake  # None until the learner started
        if intake is None:
            return {}
        bans = learner.ledger.bans
        return {peer: n for peer, n in intake.delivered.items() if peer not in bans}

    return counts


def make_service(config: AnyDaemonConfig, ctx: DaemonContext) -> RoleService:
    """The role's service, built from its own typed config (heavy imports only for the role that needs them)."""
    if isinstance(config, LearnerConfig):
        from echo2swarm.daemon.learner_service import LearnerService

        return LearnerService(config, ctx)
    if isinstance(config, (RolloutConfig, RelayConfig, VerifierConfig)):
        from echo2swarm.daemon.follower_service import FollowerService

        return FollowerService(config, ctx)
    return BootstrapService()


def _pick_host(maddrs: list[str]) -> str:
    """The best address other peers can reach us at: public, then private, then loopback."""
    ips = []
    for addr in maddrs:
        parts = addr.split("/")
        if len(parts) > 2 and parts[1] in ("ip4", "ip6"):
            with contextlib.suppress(ValueError):
                ips.append(ipaddress.ip_address(parts[2]))
    ips = [ip for ip in ips if not ip.is_unspecified]
    for wanted in (lambda ip: ip.is_global, lambda ip: ip.is_private and not ip.is_loopback, lambda ip: ip.is_loopback):
        for ip in ips:
            if wanted(ip):
                return f"[{ip}]" if ip.version == 6 else str(ip)
    return "127.0.0.1"


class Daemon:
    def __init__(self, config: AnyDaemonConfig):
        self.config = config
        self.stop_event = asyncio.Event()
        self.started_at = time.time()
        self.chunk_url: str | None = None  # where peers fetch chunks; None without a chunk server
        self.http_url: str | None = None   # the daemon's HTTP server (/metrics, /v1/info), chunks or not
        self.server: ChunkServer | None = None
        self.ctx: DaemonContext | None = None
        self.service: RoleService | None = None
        self.chunk_service: ChunkService | None = None
        self.maddrs: list[str] = []  # p2pd's listen addresses at start (daemon.json); the card's come from `reach`
        self.reach: ReachabilityTracker | None = None
        self.dialback: DialbackService | None = None
        self.p2p_served_to: Any = None  # policy.p2p.ServedTo once the libp2p chunk service runs
        self.ready_written = False  # daemon.json is there (rewritten when the card's reachability changes)

    # -- records -------------------------------------------------------------------------------
    def card(self, state: str | None = None) -> PeerCard:
        assert self.ctx is not None and self.service is not None
        fields = self.service.card_fields()
        arrivals = sorted(fields.arrival_s.items())[-8:]
        return PeerCard(
            peer_id=self.ctx.overlay.peer_id,
            role=self.config.role,
            price=self.config.price,
            version=fields.version,
            state=state or fields.state,
            software=__version__,
            maddrs=(self.reach.maddrs if self.reach is not None else self.maddrs)[:8],
            chunk_url=self.reach.card_chunk_url(self.chunk_url) if self.reach is not None else self.chunk_url,
            reachability=self.reach.state if self.reach is not None else None,
            holepunch=list(self.reach.holepunch) if self.reach is not None else [],
            upload_bps=self.config.upload_limit,
            uplink_bps=self.chunk_service.uplink.estimate() if self.chunk_service is not None else None,
            held=self.ctx.versions.versions()[-32:] if self.config.role != "bootstrap" else [],
            fetching=fields.fetching,
            arrivals=[Arrival(version=v, seconds=round(t, 3), path=fields.fetch_paths.get(v, (None, None))[0],
                              fetched_bytes=fields.fetch_paths.get(v, (None, None))[1]) for v, t in arrivals],
            versions=[VersionNote(**note) for note in fields.published[-8:]],
            t_bcast_s=fields.t_bcast_s,
            rollouts_per_s=fields.rollouts_per_s,
            active=fields.active,
            bans=[BanNote(peer_id=p, reason=r[:120]) for p, r in list(fields.bans.items())[-MAX_BANS_ON_CARD:]],
            updated_ms=int(time.time() * 1000),
        )

    async def _announce(self) -> None:
        assert self.ctx is not None and self.service is not None
        await self.service.announce()
        if not await self.ctx.overlay.store_card(self.card()):
            logger.warning("no DHT peer accepted our peer card (is the swarm reachable?)")

    def info(self) -> dict[str, Any]:
        """Served at GET /v1/info; also what `stats` tools read."""
        assert self.ctx is not None and self.service is not None
        stats = dict(self.service.stats())
        if self.chunk_service is not None:
            stats["server"] = dict(self.chunk_service.stats)
            stats["server"]["uplink_bps"] = self.chunk_service.uplink.estimate()
            stats["server"]["uplink_windows"] = [round(r) for r in self.chunk_service.uplink.rates]
            stats["server"]["working_peers"] = len(self.chunk_service.working)
        stats["dht_refused"] = self.ctx.overlay.validator.refused
        stats["dht_requests"] = dict(self.ctx.overlay.traffic.requests)
        stats["dht_bytes"] = dict(self.ctx.overlay.traffic.bytes)
        stats["card_reads"] = dict(self.ctx.overlay.cards.reads)
        return {
            "peer_id": self.ctx.overlay.peer_id,
            "role": self.config.role,
            "swarm": self.config.overlay.swarm,
            "uptime_s": round(time.time() - self.started_at, 1),
            **self.service.card_fields().as_json(),
            "reachability": self.reachability_info(),
            # chunk bytes served over libp2p (relayed peers' only transport), by client peer id
            "p2p_served_to": dict(self.p2p_served_to.bytes) if self.p2p_served_to is not None else {},
            "stats": stats,
        }

    def reachability_info(self) -> dict[str, Any] | None:
        reach = self.reach
        if reach is None:
            return None
        return {
            "state": reach.state, "maddrs": reach.maddrs, "listen": reach.listen, "observed": reach.observed,
            "chunk_url_reachable": reach.chunk_ok, "responder": reach.responder,
            "holepunch": reach.holepunch, "direct": dict(reach.direct),
            # chunk-stream requests answered per client and connection kind (direct / relayed)
            "streams": stream_paths(self.ctx.overlay.p2p) if self.ctx is not None else {},
            "clock_skew_s": None if reach.skew_s is None else round(reach.skew_s, 3), "error": reach.last_error,
            "dialback": dict(self.dialback.stats) if self.dialback is not None else {},
        }

    async def _watch_reachability(self) -> None:
        """Re-read our addresses every announce period; probe as ReachabilityTracker decides."""
        assert self.reach is not None and self.ctx is not None
        period = self.config.overlay.announce_period_s
        while not self.stop_event.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stop_event.wait(), period)
            if self.stop_event.is_set():
                return
            try:
                if await self.reach.update(self.chunk_url):
                    self.ctx.overlay.advertise(self.reach.card_chunk_url(self.chunk_url), self.reach.maddrs)
                    if self.ready_written and not self.stop_event.is_set():  # daemon.json says what the card says
                        self._write_ready_file()
            except Exception:
                logger.exception("reachability check failed; keeping the last result")

    async def _remember_peers(self, overlay: Overlay, rejoin: RejoinList) -> None:
        """Keep the peers seen working in rejoin.json, for a restart after the initial peers are gone: looked at
        every announce period, written when the set changed."""
        while not self.stop_event.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stop_event.wait(), self.config.overlay.announce_period_s)
            peers = overlay.rejoin_candidates()
            try:
                if rejoin.update(peers):
                    logger.debug("rejoin list: %d peers saved in %s", len(peers), rejoin.path)
            except OSError as e:  # a full or read-only disk costs the list, never the daemon
                logger.warning("could not save %s: %s", rejoin.path, e)

    def _head_bytes(self) -> bytes | None:
        head = self.service.head() if self.service is not None else None
        return None if head is None else head.model_dump_json().encode()

    def ready_info(self) -> dict[str, Any]:
        """What daemon.json holds (docs/protocol.md §8.1); its reachability and card addresses are the card's."""
        assert self.ctx is not None
        return {
            "peer_id": self.ctx.overlay.peer_id,
            "role": self.config.role,
            "swarm": self.config.overlay.swarm,
            "maddrs": self.maddrs,
            "card_maddrs": self.reach.maddrs if self.reach is not None else self.maddrs,
            "reachability": self.reach.state if self.reach is not None else None,
            "chunk_url": self.chunk_url,
            "http_url": self.http_url,
            "pid": os.getpid(),
            "software": __version__,
        }

    def _write_ready_file(self) -> None:
        """Written once the role service has started, and again whenever the card's reachability or
        addresses change, so that it never says other than the card."""
        path = Path(self.config.state_dir) / "daemon.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.ready_info(), indent=2))
        os.replace(tmp, path)
        self.ready_written = True

    # -- lifecycle -----------------------------------------------------------------------------
    async def _supervise(self, service: RoleService) -> None:
        failures = 0
        settings = self.config.supervisor
        while not self.stop_event.is_set():
            try:
                await service.run(self.stop_event)
                return
            except Exception:
                failures += 1
                delay = backoff_s(failures, settings.restart_backoff_s, settings.restart_backoff_max_s)
                logger.exception("%s service crashed (%d); restarting in %.1f s", self.config.role, failures, delay)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.stop_event.wait(), delay)

    async def run(self) -> int:
        config = self.config
        state_dir = Path(config.state_dir)
        state_dir.mkdir(parents=True, exist_ok=True)
        (state_dir / "daemon.json").unlink(missing_ok=True)
        logger.info("echo2swarm %s %s daemon, resolved config: %s", __version__, config.role, dump_config(config))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop_event.set)
        dump.install(loop)  # kill -USR1: where every task waits, in the log

        try:
            # Without --identity the per-start libp2p key reaches p2pd through a temporary file in the state dir.
            rejoin = RejoinList(state_dir, config.overlay.swarm)
            overlay = await Overlay.start(config.overlay, key_dir=state_dir, rejoin=rejoin)
        except BootstrapError as e:
            logger.error("%s", e)
            from echo2swarm.daemon.doctor import check_p2pd_binary, check_ports

            for check in [check_p2pd_binary(), *check_ports(config)]:  # the doctor's reasons, where they apply
                if check.status == "fail":
                    logger.error("%s: %s -> %s", check.name, check.detail, check.fix)
            return EXIT_CONFIG
        session = aiohttp.ClientSession()
        tasks: list[asyncio.Task[None]] = []
        try:
            self.maddrs = await overlay.visible_maddrs()
            chunks, versions = ChunkStore(state_dir), VersionStore(state_dir)
            versions.clean_temporaries()
            chunks.clean_temporaries()
            inflight = InFlight()
            announcer = Announcer(config.overlay.announce_period_s, self._announce, name=f"{config.role} card")
            self.ctx = DaemonContext(overlay, chunks, versions, session, inflight, announcer)
            self.service = service = make_service(config, self.ctx)
            # The learner's reserves of held requests and connections go to the peers whose groups it accepted
            # (its loop is LearnerService.learner).
            hosted: Any = service
            work = [_delivered(hosted.learner)] if isinstance(config, LearnerConfig) else []
            self.chunk_service = ChunkService(config.chunk_server, chunks, versions, RateLimiter(config.upload_limit),
                                              inflight, plan=service.signed_plan, peer_id=overlay.peer_id, work=work)
            if config.role != "bootstrap":
                from echo2swarm.policy.p2p import serve_p2p

                self.p2p_served_to = await serve_p2p(overlay, self.chunk_service)  # the fallback transport, always on
            # Every daemon runs one HTTP server (/metrics, /v1/info, the role's pages); it serves the
            # swarm chunks only where there are chunks to serve and the chunk server is on.
            serves_chunks = config.role != "bootstrap" and config.chunk_server.enabled
            # The learner's step records (its MetricsLog, there once it started) feed its step metrics.
            learner: Any = hosted.learner if isinstance(config, LearnerConfig) else None
            registry = daemon_registry(self.info, versions.versions, lambda: learner.metrics if learner else None)
            routes = [*service.http_routes(), metrics_route(registry)]
            self.server = ChunkServer(self.chunk_service, info=self.info, head=self._head_bytes, routes=routes,
                                      chunks=serves_chunks)
            port = await self.server.start()
            host = config.chunk_server.host
            if host in ("0.0.0.0", "::", ""):
                host = _pick_host(self.maddrs)
            self.http_url = config.chunk_server.public_url or f"http://{host}:{port}"
            self.chunk_url = self.http_url if serves_chunks else None
            self.dialback = await serve_dialback(overlay)
            self.reach = ReachabilityTracker(overlay, config.overlay)
            try:  # a public peer dials us back (bounded: an unanswered probe leaves the state `unknown`)
                await asyncio.wait_for(self.reach.update(self.chunk_url, force=True), 20.0)
            except asyncio.TimeoutError:
                logger.warning("reachability probe at start took over 20 s; advertising what p2pd reports")
                self.reach.assume(self.maddrs)
            overlay.advertise(self.reach.card_chunk_url(self.chunk_url), self.reach.maddrs)  # signed heads carry it
            # Announce from the start, so a learner that takes minutes to publish shows as `starting`.
            tasks = [asyncio.create_task(announcer.run(self.stop_event)),
                     asyncio.create_task(self._watch_reachability()),
                     asyncio.create_task(self._remember_peers(overlay, rejoin))]
            await service.start()
            tasks.append(asyncio.create_task(self._supervise(service)))
            self._write_ready_file()
            for line in start_banner(config, overlay.peer_id, self.maddrs, self.chunk_url, self.http_url,
                                     [path for path, _ in routes]):
                print(line, flush=True)
            await self.stop_event.wait()
            logger.info("stopping %s daemon", config.role)
            return EXIT_OK
        except Exception:
            logger.exception("%s daemon failed", config.role)
            return EXIT_FAILED
        finally:
            self.stop_event.set()
            await self._shutdown(overlay, session, tasks)

    async def _shutdown(self, overlay: Overlay, session: aiohttp.ClientSession, tasks: list[asyncio.Task[None]]) -> None:
        settings = self.config.supervisor
        deadline = time.monotonic() + settings.stop_budget_s
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=settings.stop_budget_s / 4)
            for task in pending:
                task.cancel()
        if self.service is not None:
            # Mark the card `stopping` at once. Its expiry must be later than the last card's, or
            # hivemind keeps the old one; it then lapses one TTL from now like any unrenewed record.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(overlay.store_card(self.card("stopping")), settings.stopping_card_timeout_s)
        if self.server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.stop(), settings.stop_budget_s / 4)
        await session.close()
        await overlay.stop(timeout=max(0.5, (deadline - time.monotonic()) / 2))
        (Path(self.config.state_dir) / "daemon.json").unlink(missing_ok=True)


def preflight(config: AnyDaemonConfig) -> None:
    """Check keys and files before touching the network; raises ValueError with a user-facing message."""
    identity = config.overlay.identity
    if identity is not None and Path(identity).exists():  # a missing one is created at start
        from echo2swarm.wire.peer_keys import PeerKey

        try:
            PeerKey.load(Path(identity))
        except ValueError as e:
            raise ValueError(f"--identity {identity}: {e}") from None
    if isinstance(config, LearnerConfig):
        from echo2swarm.learner.versions import model_files
        from echo2swarm.wire.signing import PolicyKey

        from echo2swarm.tasks.registry import available_tasks

        PolicyKey.load(config.publish.policy_key)
        model_files(config.publish.model)
        if config.train.task not in available_tasks():
            raise ValueError(f"train.task {config.train.task!r} is unknown; available: {', '.join(available_tasks())}")
        if config.train.device.startswith("cuda"):  # torch only when CUDA is asked for: auto and cpu cannot fail
            from echo2swarm.runtime.devices import resolve_device

            resolve_device(config.train.device, setting="train.device (--device)")
    elif isinstance(config, (RolloutConfig, RelayConfig, VerifierConfig)) and config.trust:
        from echo2swarm.wire.signing import load_trusted_key

        load_trusted_key(config.trust)
    if isinstance(config, RolloutConfig):
        from echo2swarm.rollout.engines import check_engine_installed

        check_engine_installed(config.engine.type)  # `--engine vllm` without vllm fails now, not at v1
        if config.engine.device.startswith("cuda") and config.engine.type != "vllm":
            from echo2swarm.runtime.devices import resolve_device

            resolve_device(config.engine.device, setting="engine.device (--device)")


def run_daemon(config: AnyDaemonConfig) -> int:
    """Run a daemon to completion and return its exit code.

    Not `asyncio.run`: on the way out it waits for every worker thread, so a SIGTERM that lands
    during a multi-second engine load or generation would hold the process past its stop budget.
    Our shutdown is complete when `Daemon.run` returns (p2pd stopped, every file written
    atomically), so the executor is closed without waiting; the CLI then exits the process.
    """
    loop = asyncio.new_event_loop()
    try:
        code = loop.run_until_complete(Daemon(config).run())
        leftovers = [t for t in asyncio.all_tasks(loop) if not t.done()]  # hivemind's background tasks
        for task in leftovers:
            task.cancel()
        if leftovers:
            loop.run_until_complete(asyncio.wait(leftovers, timeout=1.0))
        return code
    finally:
        loop.close()  # shuts the default executor down with wait=False
