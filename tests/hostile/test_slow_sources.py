"""Fresh identities that serve slowly cost the rollout peer a duplicate request, not a stall.

The attack (issue 32, item 3): identities, one after another, each with a fresh key and a properly
signed relay card that claims to hold every version, serve manifests and chunks a byte every few
seconds. On main each new identity got a fresh `fetch.min_rate_grace_s` (10 s) before it was cut
off and banned, and the rollout peer waited on it: the learner's step rate fell to 0.34x.

Each rogue here is a real chunk source the follower's own code path consults: an HTTP chunk server
in this process that proxies the learner's real bytes and drips them, and an overlay node with its
own fresh key that stores its relay card in the swarm's DHT (so the learner may plan it as a
parent, and the rollout peer takes it for a holder). The follower reads every card, as one that no
broadcast plan places does (a late joiner; `fetch.upstream_cards = false`): one the plan places asks
only the peers upstream of it, and the learner plans these rogues after every peer seen working, so
they would never be asked; otherwise it runs with the default fetch settings. The test measures the learner's step rate from its metrics before and during the attack,
samples how far the rollout peer's version is behind the learner's, and checks that every rogue
was asked and banned.
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
from helpers.rogue import PACED, drip
from helpers.swarm import LocalSwarm, http_json, learner_toml, read_metrics, wait_until

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]
HOST = "127.0.0.1"
IDENTITIES = 5
STALENESS = 1  # the learner's S
DRIP_EVERY_S = 2.0  # a byte this often: never a stall (fetch.stall_timeout_s is 15 s), far below the minimum rate
BASELINE_STEPS = 8


class SlowSource:
    """One fresh identity: a chunk server that drips every body, and its own overlay node for its card."""

    def __init__(self, learner_url: str, session: aiohttp.ClientSession):
        self.learner_url = learner_url
        self.session = session
        self.requests: list[str] = []  # paths asked, in order
        self.url = ""
        self.peer_id = ""
        self.overlay: Any = None
        self.runner: web.AppRunner | None = None

    async def start(self, bootstrap: str, swarm: str) -> None:
        from echo2swarm.config.models import OverlayConfig
        from echo2swarm.overlay.node import Overlay

        app = web.Application()
        app.router.add_get("/v1/manifest/{version}", self._drip)
        app.router.add_get("/v1/chunk/{sha}", self._drip)
        # handler_cancellation: a drip whose request the follower cancelled ends with it
        self.runner = web.AppRunner(app, shutdown_timeout=1.0, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, HOST, 0)
        await site.start()
        self.url = f"http://{HOST}:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        self.overlay = await Overlay.start(OverlayConfig(swarm=swarm, initial_peers=[bootstrap], host_maddrs=[]),
                                           client_mode=True)
        self.peer_id = self.overlay.peer_id

    async def announce(self, version: int) -> None:
        from echo2swarm.wire.records import PeerCard

        card = PeerCard(peer_id=self.peer_id, role="relay", price=0.0, version=version, state="ready",
                        software="rogue", chunk_url=self.url, held=list(range(version, version + 32)),
                        updated_ms=int(time.time() * 1000))
        await self.overlay.store_card(card)

    async def _drip(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(request.path)
        path = request.path if request.path.startswith("/v1/manifest/") else f"/v1/chunk/{request.match_info['sha']}"
        async with self.session.get(self.learner_url + path) as resp:
            real = await resp.read() if resp.status == 200 else b""
        if not real:
            return web.Response(status=404)
        return await drip(request, real, DRIP_EVERY_S)  # a wait= it was asked to hold is ignored

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        if self.overlay is not None:
            await self.overlay.stop()


class SlowSources:
    """All the identities, started up front on an event loop in a thread; `activate(i)` has identity
    i (alone) announce its card every 0.5 s from then on."""

    def __init__(self, learner_url: str, bootstrap: str, swarm: str, count: int):
        self.learner_url, self.bootstrap, self.swarm, self.count = learner_url, bootstrap, swarm, count
        self.sources: list[SlowSource] = []
        self.active: SlowSource | None = None
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.stopping = asyncio.Event()
        self.announcer: Any = None

    def __enter__(self) -> "SlowSources":
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(180)
        return self

    async def _start(self) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        for _ in range(self.count):
            source = SlowSource(self.learner_url, self.session)
            self.sources.append(source)
            await source.start(self.bootstrap, self.swarm)
        self.announcer = asyncio.create_task(self._announce())

    async def _announce(self) -> None:
        while not self.stopping.is_set():
            source = self.active
            if source is not None:
                try:
                    async with self.session.get(f"{self.learner_url}/v1/info") as resp:
                        version = (await resp.json())["version"] or 1
                    await source.announce(version)
                except Exception:  # a slow DHT or learner: the next round tries again
                    pass
            try:
                await asyncio.wait_for(self.stopping.wait(), 0.5)
            except asyncio.TimeoutError:
                pass

    def activate(self, index: int) -> SlowSource:
        self.active = self.sources[index]
        return self.active

    async def _stop(self) -> None:
        self.stopping.set()
        if self.announcer is not None:
            await asyncio.gather(self.announcer, return_exceptions=True)
        for source in self.sources:
            await source.stop()
        await self.session.close()

    def __exit__(self, *exc: object) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(30)
            self.loop.close()


class LagSampler:
    """How far the rollout peer's installed version is behind the learner's published one, read every
    0.2 s (the learner first, so a sample never overstates the lag)."""

    def __init__(self, learner_info: str, peer_info: str):
        self.learner_info, self.peer_info = learner_info, peer_info
        self.samples: list[tuple[float, int, int]] = []  # (time, learner's published version, peer's version)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.done.wait(0.2):
            try:
                published = http_json(self.learner_info)["stats"]["published_version"]
                held = http_json(self.peer_info)["version"] or 0
            except (OSError, KeyError):  # a busy daemon: the next sample
                continue
            self.samples.append((time.monotonic(), published, held))

    def __enter__(self) -> "LagSampler":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join(10)

    def worst(self) -> tuple[int, list[tuple[float, int, int]]]:
        lags = [published - held for _, published, held in self.samples]
        return max(lags, default=0), [s for s in self.samples if s[1] - s[2] == max(lags, default=0)][:5]


@pytest.mark.slow
def test_fresh_slow_identities_one_after_another_cost_duplicates_not_stalls(
    local_swarm: LocalSwarm, tiny_model_dir: Path, policy_key: Path, tmp_path: Path
):
    # training_swarm's shape (bootstrap, learner, one paced honest rollout peer), with weight decay: every
    # step changes every weight, so every version has new chunks to fetch (content addressing makes an
    # unchanged chunk free, and the untrained tiny model's steps may not move it).
    local_swarm.bootstrap()
    assert local_swarm.bootstrap_addr
    config = learner_toml(tmp_path / "learner.toml", tiny_model_dir, policy_key, steps=400, staleness=STALENESS,
                          weight_decay=0.1)
    learner = local_swarm.start("learner", "--config", str(config))
    peer = local_swarm.rollout("rollout-1", trust=Path(f"{policy_key}.pub"),
                               env={**PACED, "ECHO2SWARM_FETCH__UPSTREAM_CARDS": "false"})
    local_swarm.ready(learner)
    local_swarm.ready(peer)
    learner_info, peer_info = learner.info["chunk_url"] + "/v1/info", peer.info["chunk_url"] + "/v1/info"
    metrics = learner.state_dir / "run" / "metrics.jsonl"
    wait_until(lambda: len(read_metrics(metrics)) >= 3, 120, what="the learner training on the honest peer")
    with SlowSources(learner.info["chunk_url"], local_swarm.bootstrap_addr, local_swarm.swarm, IDENTITIES) as rogues:
        # The step rate before: steps over the time they took, after the first 3 (start-up).
        first = len(read_metrics(metrics))
        before = wait_until(lambda: m if len(m := read_metrics(metrics)) >= first + BASELINE_STEPS else None, 120,
                            interval=0.2, what=f"{BASELINE_STEPS} steps before the attack")
        rate_before = (len(before) - first) / (before[-1]["time_s"] - before[first - 1]["time_s"])
        attack_started = time.monotonic()  # within 0.2 s of the last step before (the metrics' clock is the learner's)

        bans = http_json(peer_info)["stats"]["fetch"].get("bans", 0)
        with LagSampler(learner_info, peer_info) as lag:
            for i in range(IDENTITIES):
                rogue = rogues.activate(i)
                # Identity i is asked (the attack is real), then banned; only then comes the next one.
                wait_until(lambda: rogue.requests, 60, interval=0.1, what=f"the rollout peer to ask slow source {i}")
                wait_until(lambda: http_json(peer_info)["stats"]["fetch"].get("bans", 0) >= bans + i + 1, 60,
                           interval=0.1, what=f"the rollout peer to ban slow source {i}")
            rogues.active = None
            during = read_metrics(metrics)[len(before):]
            attack_s = time.monotonic() - attack_started
        worst, where = lag.worst()

    fetch = http_json(peer_info)["stats"]["fetch"]
    assert fetch.get("bans_slow", 0) >= IDENTITIES, fetch  # a slow source is still banned
    rate_during = len(during) / attack_s
    assert rate_during >= 0.5 * rate_before, (
        f"step rate {rate_during:.2f}/s under {IDENTITIES} slow identities against {rate_before:.2f}/s before "
        f"({rate_during / rate_before:.2f}x, {len(during)} steps in {attack_s:.1f} s); fetch stats {fetch}")
    assert len(lag.samples) >= 10, lag.samples
    assert worst <= STALENESS, f"the rollout peer fell {worst} versions behind (S = {STALENESS}): {where}"
    assert peer.running() and learner.running()
