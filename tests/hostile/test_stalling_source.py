"""Sources that stall are dropped: a real learner and rollout peer next to rogue chunk sources.

The case seen on a local swarm: a peer that re-serves chunks but drips a byte every few seconds
held followers for the whole request timeout on every chunk of every version, and one that sent
truncated or oversized bodies was counted but asked again and again.

Each rogue here is what the follower's real code path consults: a relay card in the swarm's DHT
(stored by the rogue's own overlay node, so it is signed by the rogue's own key like any card)
whose `chunk_url` is a small aiohttp server in this process and whose `held` claims every version
the learner is about to publish, so the follower takes it for a holder and asks it for chunks.
The rogues serve the real manifest (proxied from the learner), then misbehave on chunk bodies.
Their cards never report arrivals, so they are also planned receivers that never report, which
must not freeze the learner's T_bcast.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from helpers.rogue import drip
from helpers.swarm import LocalSwarm, http_json, learner_toml, wait_until

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]
HOST = "127.0.0.1"
GRACE_S = 3.0  # the follower's min_rate_grace_s: what one cut-off costs
STALL_S = 15.0  # the follower's stall_timeout_s (the default): what each chunk cost before
DRIP_EVERY_S = 2.0  # a byte this often: never a stall (< STALL_S), always far below the minimum rate
FOLLOWER_ENV = {
    "ECHO2SWARM_FETCH__MIN_RATE_GRACE_S": str(GRACE_S),
    "ECHO2SWARM_FETCH__STALL_TIMEOUT_S": str(STALL_S),
    # Longer than the test: a banned rogue is never asked again here (the doubling is unit-tested).
    "ECHO2SWARM_FETCH__BAN_S": "900",
    "ECHO2SWARM_FETCH__BAN_MAX_S": "1800",
    "ECHO2SWARM_FETCH__HEAD_POLL_S": "0.3",
    "ECHO2SWARM_ENGINE__THREADS": "1",
    "ECHO2SWARM_WORKER__MAX_ROLLOUTS_PER_S": "40",
}


class Rogue:
    """One rogue chunk source: an HTTP server, and an overlay node that announces its relay card."""

    def __init__(self, kind: str, learner_url: str):
        self.kind = kind  # "drip" or "bad_size"
        self.learner_url = learner_url
        self.chunk_requests: list[float] = []  # monotonic time of each chunk request
        self.url = ""
        self.peer_id = ""
        self.overlay: Any = None
        self.runner: web.AppRunner | None = None

    async def start(self, session: aiohttp.ClientSession, bootstrap: str, swarm: str) -> None:
        from echo2swarm.config.models import OverlayConfig
        from echo2swarm.overlay.node import Overlay

        self.session = session
        app = web.Application()
        app.router.add_get("/v1/manifest/{version}", self._manifest)
        app.router.add_get("/v1/chunk/{sha}", self._chunk)
        self.runner = web.AppRunner(app, shutdown_timeout=1.0)
        await self.runner.setup()
        site = web.TCPSite(self.runner, HOST, 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://{HOST}:{port}"
        config = OverlayConfig(swarm=swarm, initial_peers=[bootstrap], host_maddrs=[])
        self.overlay = await Overlay.start(config, client_mode=True)
        self.peer_id = self.overlay.peer_id

    async def announce(self, version: int) -> None:
        from echo2swarm.wire.records import PeerCard

        card = PeerCard(peer_id=self.peer_id, role="relay", price=0.0, version=version, state="ready",
                        software="rogue", chunk_url=self.url, held=list(range(version, version + 32)),
                        updated_ms=int(time.time() * 1000))
        await self.overlay.store_card(card)

    async def _real(self, sha: str) -> bytes:
        async with self.session.get(f"{self.learner_url}/v1/chunk/{sha}") as resp:
            return await resp.read() if resp.status == 200 else b""

    async def _manifest(self, request: web.Request) -> web.Response:
        async with self.session.get(f"{self.learner_url}/v1/manifest/{request.match_info['version']}") as resp:
            return web.Response(status=resp.status, body=await resp.read())

    async def _chunk(self, request: web.Request) -> web.StreamResponse:
        self.chunk_requests.append(time.monotonic())
        real = await self._real(request.match_info["sha"])
        if not real:
            return web.Response(status=404)
        if self.kind == "bad_size":
            if len(self.chunk_requests) % 2:  # truncated: an honest Content-Length for half the chunk
                return web.Response(body=real[: len(real) // 2])
            return web.Response(body=real + b"\0" * 4096)  # oversized
        return await drip(request, real, DRIP_EVERY_S)

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        if self.overlay is not None:
            await self.overlay.stop()


class Rogues:
    """The rogues on their own event loop in a thread, announcing their cards every 0.5 s."""

    def __init__(self, learner_url: str, bootstrap: str, swarm: str):
        self.learner_url, self.bootstrap, self.swarm = learner_url, bootstrap, swarm
        self.drip = Rogue("drip", learner_url)
        self.bad_size = Rogue("bad_size", learner_url)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.stopping = asyncio.Event()
        self.announcer: Any = None

    def __enter__(self) -> "Rogues":
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(120)
        return self

    async def _start(self) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        for rogue in (self.drip, self.bad_size):
            await rogue.start(self.session, self.bootstrap, self.swarm)
        self.announcer = asyncio.create_task(self._announce())

    async def _announce(self) -> None:
        while not self.stopping.is_set():
            try:
                async with self.session.get(f"{self.learner_url}/v1/info") as resp:
                    version = (await resp.json())["version"] or 1
                for rogue in (self.drip, self.bad_size):
                    await rogue.announce(version)
            except Exception:  # a slow DHT or learner: the next round tries again
                pass
            try:
                await asyncio.wait_for(self.stopping.wait(), 0.5)
            except asyncio.TimeoutError:
                pass

    def cards_seen(self) -> set[str]:
        async def read() -> set[str]:
            cards, _ = await self.drip.overlay.get_cards()
            return {c.peer_id for c in cards}

        return asyncio.run_coroutine_threadsafe(read(), self.loop).result(30)

    async def _stop(self) -> None:
        self.stopping.set()
        if self.announcer is not None:
            await asyncio.gather(self.announcer, return_exceptions=True)
        for rogue in (self.drip, self.bad_size):
            await rogue.stop()
        await self.session.close()

    def __exit__(self, *exc: object) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(30)
            self.loop.close()


def _info(daemon: Any) -> dict[str, Any]:
    return http_json(daemon.info["chunk_url"] + "/v1/info")


def _newest(peer: Any) -> int:
    return max(map(int, _info(peer)["arrival_s"]), default=0)


def _installed_after(peer: Any, version: int, count: int) -> list[int]:
    """The first `count` versions above `version` the peer installed (waits for them, bounded)."""
    def installed() -> list[int] | None:
        found = sorted(v for v in map(int, _info(peer)["arrival_s"]) if v > version)
        return found[:count] if len(found) >= count else None

    return wait_until(installed, 120, interval=0.3, what=f"{count} versions above v{version} at {peer.name}")


@pytest.mark.slow
def test_a_dripping_and_a_lying_source_are_banned_and_later_versions_do_not_wait_for_them(
    local_swarm: LocalSwarm, tiny_model_dir: Path, policy_key: Path, tmp_path: Path
):
    local_swarm.bootstrap()
    assert local_swarm.bootstrap_addr
    # weight_decay: every step changes every weight, so every version has new chunks to fetch
    # (content addressing makes a repeated chunk free, and an untrained model may not move).
    config = learner_toml(tmp_path / "learner.toml", tiny_model_dir, policy_key, steps=200, staleness=1,
                          weight_decay=0.1)
    learner = local_swarm.start("learner", "--config", str(config), "--chunk-size", "64KiB",
                                env={"ECHO2SWARM_ACTIVATION__ENABLED": "false"})
    learner_url = local_swarm.ready(learner)["chunk_url"]

    with Rogues(learner_url, local_swarm.bootstrap_addr, local_swarm.swarm) as rogues:
        rogue_ids = {rogues.drip.peer_id, rogues.bad_size.peer_id}
        wait_until(lambda: rogue_ids <= rogues.cards_seen(), 30, interval=0.3, what="the rogue cards in the DHT")
        peer = local_swarm.rollout("rollout", trust=Path(f"{policy_key}.pub"), env=FOLLOWER_ENV)
        local_swarm.ready(peer)

        # Both rogues are asked (they claim to hold every version), misbehave, and are banned.
        fetch = wait_until(lambda: (f := _info(peer)["stats"]["fetch"]).get("bans", 0) >= 2 and f, 120,
                           interval=0.2, what="the rollout peer to ban both rogues")
        assert fetch["bans_slow"] == 1, fetch
        assert fetch.get("bans_truncated", 0) + fetch.get("bans_oversized", 0) == 1, fetch
        assert fetch["source_slow"] >= 1 and fetch.get("source_truncated", 0) + fetch.get("source_oversized", 0) >= 1
        # Requests decided before the bans may still reach the rogues a moment later: count from the
        # next installed version on.
        after_bans = _installed_after(peer, _newest(peer), 1)[0]
        asked = {"drip": len(rogues.drip.chunk_requests), "bad_size": len(rogues.bad_size.chunk_requests)}

        # Later versions keep coming, from the learner, without asking the banned rogues again, and
        # none waits out a stall timeout (or even one grace period) on them.
        later = _installed_after(peer, after_bans, 3)
        info = _info(peer)
        arrivals = {int(v): s for v, s in info["arrival_s"].items()}
        assert {"drip": len(rogues.drip.chunk_requests), "bad_size": len(rogues.bad_size.chunk_requests)} == asked
        for v in later:
            assert arrivals[v] < STALL_S, f"v{v} took {arrivals[v]} s: it waited on a banned source ({arrivals})"
        fetch = info["stats"]["fetch"]
        assert fetch["bans"] == 2 and fetch.get("learner_backoffs", 0) == 0, fetch
        learner_name = "learner:" + learner.info["peer_id"][-8:]
        assert set(info["stats"]["fetched_from"]) == {learner_name}, info["stats"]["fetched_from"]
        log = peer.log_path.read_text()
        assert log.count(" banned for ") == 2, "each ban is logged once"
        assert f"source relay:{rogues.drip.peer_id[-8:]} banned for" in log

        # The rogue relay cards are planned receivers that never report an arrival: T_bcast is
        # measured anyway, over the peers that did report (once the 30 s report bound has passed).
        planned_with_rogues: set[int] = set()  # the learner keeps only its 16 newest plans: note them as they come

        def measured_with_a_rogue_planned() -> dict[int, float]:
            stats = _info(learner)["stats"]
            version = stats["published_version"]
            try:
                chains = http_json(f"{learner_url}/v1/plan/{version}")["stripes"]
            except OSError:  # a plan just dropped (404) or a busy learner: the next look sees a newer one
                chains = []
            if rogue_ids & {p for chain in chains for p in chain}:
                planned_with_rogues.add(version)
            measured = {int(v): seconds for v, seconds in stats.get("t_bcast", {}).items()}
            return {v: measured[v] for v in planned_with_rogues & set(measured)}

        measured = wait_until(measured_with_a_rogue_planned, 120, interval=0.5,
                              what="the learner to measure T_bcast of a version planned over silent rogues")
        assert all(seconds < STALL_S for seconds in measured.values()), measured
        assert peer.running() and learner.running()
