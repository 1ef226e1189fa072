"""Head long-polls (`GET /v1/head?after=V&wait=S`): held until the learner's store installs a newer
version whose plan is served, answered at the end of the wait otherwise, bounded by the waiting
budget, and refused when malformed. A real ChunkServer on 127.0.0.1, a real VersionStore written
by the real VersionWriter, aiohttp as the client."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import pytest

from echo2swarm.config.models import ChunkServerConfig
from echo2swarm.learner.versions import VersionWriter
from echo2swarm.policy.head_watch import HEAD_RECHECK_S
from echo2swarm.policy.server import ChunkServer, ChunkService
from echo2swarm.policy.store import ChunkStore, VersionStore
from echo2swarm.wire.signing import PolicyKey

pytestmark = pytest.mark.timeout(60)
PEER_ID = "12D3KooW" + "A" * 44


class Learner:
    """What the supervisor wires for a learner: head() = its newest published version, plan(v) = its plans."""

    def __init__(self, root: Path):
        self.chunks, self.versions = ChunkStore(root), VersionStore(root)
        self.writer = VersionWriter("s", PolicyKey.generate(), self.chunks, self.versions, 64 * 1024, PEER_ID)
        self.published: int | None = None
        self.plans: set[int] = set()

    def head(self) -> bytes | None:
        return None if self.published is None else json.dumps({"version": self.published}).encode()

    def publish(self, version: int, plan: bool = True, out: bool = True) -> None:
        """Install `version` (the store wakes the long-polls), then make it the head (and plan it)."""
        self.writer.write_files({"config.json": f'{{"v": {version}}}'.encode()}, version)
        if out:
            self.out(version, plan)

    def out(self, version: int, plan: bool = True) -> None:
        """The learner's head moves to `version` (after the install, as LearnerService does), and its plan."""
        self.published = version
        if plan:
            self.plans.add(version)


async def _serve(tmp_path: Path, **config: object) -> tuple[Learner, ChunkServer, str]:
    learner = Learner(tmp_path)
    service = ChunkService(ChunkServerConfig(host="127.0.0.1", **config), learner.chunks, learner.versions,
                           plan=lambda v: b"{}" if v in learner.plans else None)
    server = ChunkServer(service, head=learner.head)
    port = await server.start()
    return learner, server, f"http://127.0.0.1:{port}"


async def _until_held(server: ChunkServer, timeout: float = 2.0) -> None:
    """Until the server holds a long-poll (asserted within `timeout`)."""
    deadline = time.monotonic() + timeout
    while not server.head_watch.waiters:
        assert time.monotonic() < deadline, "the long-poll was never held"
        await asyncio.sleep(0.01)


# A head that must stay held is checked after ten of the watch's rechecks of the head (a negative
# check: the window is how long a wrong early answer would have had to show).
HELD_WINDOW_S = 10 * HEAD_RECHECK_S


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[int, bytes, float]:
    started = time.monotonic()
    async with session.get(url) as resp:
        return resp.status, await resp.read(), time.monotonic() - started


def test_a_long_poll_is_answered_when_a_newer_version_is_installed_and_planned(tmp_path: Path):
    async def main() -> None:
        learner, server, url = await _serve(tmp_path)
        try:
            learner.publish(1)
            async with aiohttp.ClientSession() as session:
                status, body, took = await _get(session, f"{url}/v1/head?after=0&wait=10")
                assert status == 200 and json.loads(body)["version"] == 1 and took < 2  # newer already: at once
                poll = asyncio.create_task(_get(session, f"{url}/v1/head?after=1&wait=10"))
                await _until_held(server)
                assert server.head_watch.waiters == 1 and not poll.done()
                # installed first; the head and the plan come out a moment later (the learner plans after)
                await asyncio.to_thread(learner.publish, 2, True, False)
                await asyncio.sleep(HELD_WINDOW_S)
                assert not poll.done()
                learner.out(2)
                status, body, took = await asyncio.wait_for(poll, 5)
                assert status == 200 and json.loads(body)["version"] == 2 and took < 5
                # and again for the next version (the watch follows every install, not just the first)
                poll = asyncio.create_task(_get(session, f"{url}/v1/head?after=2&wait=10"))
                await _until_held(server)
                await asyncio.to_thread(learner.publish, 3, True, False)
                await asyncio.sleep(HELD_WINDOW_S)
                learner.out(3)
                status, body, took = await asyncio.wait_for(poll, 5)
                assert status == 200 and json.loads(body)["version"] == 3 and took < 5
                assert server.stats["head_waited"] == 3 and server.head_watch.waiters == 0
        finally:
            await server.stop()

    asyncio.run(main())


def test_a_head_without_its_plan_is_held_back_until_the_plan_is_served(tmp_path: Path):
    async def main() -> None:
        learner, server, url = await _serve(tmp_path)
        try:
            learner.publish(1)
            async with aiohttp.ClientSession() as session:
                poll = asyncio.create_task(_get(session, f"{url}/v1/head?after=1&wait=10"))
                await _until_held(server)
                await asyncio.to_thread(learner.publish, 2, False)  # installed and the head, no plan yet
                await asyncio.sleep(HELD_WINDOW_S)
                assert not poll.done()  # followers would find no plan: not told yet
                learner.plans.add(2)
                status, body, _ = await asyncio.wait_for(poll, 5)
                assert status == 200 and json.loads(body)["version"] == 2
        finally:
            await server.stop()

    asyncio.run(main())


def test_a_long_poll_with_nothing_new_gets_the_current_head_at_the_end_of_its_wait(tmp_path: Path):
    async def main() -> None:
        learner, server, url = await _serve(tmp_path, wait_s=0.5)
        try:
            async with aiohttp.ClientSession() as session:
                status, _, took = await _get(session, f"{url}/v1/head?after=0&wait=0.3")
                assert status == 404 and 0.25 < took < 3  # no head at all: 404 once the wait is over
                learner.publish(1)
                status, body, took = await _get(session, f"{url}/v1/head?after=1&wait=100")
                # held at most chunk_server.wait_s, whatever the client asks
                assert status == 200 and json.loads(body)["version"] == 1 and 0.45 < took < 3
        finally:
            await server.stop()

    asyncio.run(main())


def test_long_polls_are_bounded_by_the_waiting_budget_and_malformed_ones_refused(tmp_path: Path):
    async def main() -> None:
        learner, server, url = await _serve(tmp_path, max_waiting=2, max_waiting_per_client=1)
        try:
            learner.publish(1)
            async with aiohttp.ClientSession() as session:
                held = asyncio.create_task(_get(session, f"{url}/v1/head?after=1&wait=1"))
                await _until_held(server)
                status, _, took = await _get(session, f"{url}/v1/head?after=1&wait=1")
                assert status == 429 and took < 0.9  # the client's share of held requests is taken: at once
                assert server.stats["refused_waiting_per_client"] == 1
                for query in ("after=1&wait=nan", "after=-1&wait=1", "after=01&wait=1", "after=1&wait=x"):
                    status, _, _ = await _get(session, f"{url}/v1/head?{query}")
                    assert status == 400, query
                assert (await held)[0] == 200
                status, body, _ = await _get(session, f"{url}/v1/head")  # the plain head: as before
                assert status == 200 and json.loads(body)["version"] == 1
        finally:
            await server.stop()

    asyncio.run(main())
