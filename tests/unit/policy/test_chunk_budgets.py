"""The chunk server's budgets: per-client and global caps, the control reserve, which waits are
held, and how both front ends refuse. Pure logic and in-process handlers, no network."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import Counter
from pathlib import Path

import pytest
from pydantic import ValidationError

from echo2swarm.config.models import ChunkServerConfig
from echo2swarm.policy import pipeline
from echo2swarm.policy.manifest import ChunkRef, FileEntry, Manifest
from echo2swarm.policy.p2p import p2p_handler
from echo2swarm.policy.pipeline import InFlight
from echo2swarm.policy.budgets import Budget, Busy, TooMany
from echo2swarm.policy.server import ChunkService
from echo2swarm.policy.store import ChunkStore, VersionStore

A, B, C = "a" * 64, "b" * 64, "c" * 64


def _manifest(version: int, shas: list[str]) -> Manifest:
    return Manifest(
        swarm="s", version=version, created_ms=1, chunk_size=1024,
        files=[FileEntry(name="model.safetensors", size=1024 * len(shas), sha256="0" * 64,
                         chunks=[ChunkRef(sha256=s, size=1024) for s in shas])],
    )


def _service(tmp_path: Path, **config: object) -> tuple[ChunkService, InFlight, list[int]]:
    pokes: list[int] = []
    inflight = InFlight(poke=lambda: pokes.append(1))
    service = ChunkService(ChunkServerConfig(**config), ChunkStore(tmp_path), VersionStore(tmp_path), inflight=inflight)
    return service, inflight, pokes


# -- Budget ------------------------------------------------------------------------------------

def test_a_client_past_its_share_gets_429_before_the_server_is_full_and_others_still_get_in():
    stats: Counter[str] = Counter()
    budget = Budget("waiting", 4, 2, stats)
    assert budget.acquire("ip:1") is None and budget.acquire("ip:1") is None
    refusal = budget.acquire("ip:1")
    assert isinstance(refusal, TooMany) and refusal.status == 429 and refusal.reason == "waiting_per_client"
    assert budget.acquire("ip:2") is None and budget.acquire("ip:2") is None
    refusal = budget.acquire("ip:3")  # the server is full: 503, whoever asks
    assert isinstance(refusal, Busy) and refusal.status == 503 and refusal.reason == "waiting"
    assert stats["open_waiting"] == 4 and budget.by_client == {"ip:1": 2, "ip:2": 2}
    budget.release("ip:1")
    assert budget.acquire("ip:3") is None  # a freed unit goes to whoever asks next
    for client in ("ip:1", "ip:2", "ip:2", "ip:3"):
        budget.release(client)
    assert budget.used == 0 and not budget.by_client and stats["open_waiting"] == 0


@pytest.mark.parametrize("name", ["connections", "streams", "control", "waiting", "uploads"])
@pytest.mark.parametrize("reserve", [0, 1])
def test_a_working_peer_at_a_full_budget_is_refused_with_its_text(name: str, reserve: int):
    """Every budget the chunk service keeps, with and without a reserve: a working peer that finds it
    full gets a 503 that reads as that budget (it raised KeyError, an HTTP 500, for `uploads`)."""
    budget = Budget(name, 2, 2, Counter(), reserve=reserve)
    assert budget.acquire("ip:1") is None and budget.acquire("peer:w", working=True) is None
    refusal = budget.acquire("peer:w2", working=True)
    assert isinstance(refusal, Busy) and refusal.status == 503 and refusal.text == Busy(name).text
    assert refusal.reason == (f"{name}_reserve" if reserve else name)
    assert isinstance(budget.acquire("ip:1"), (Busy, TooMany))


def test_hold_counts_refusals_by_reason_and_status_and_releases_on_errors(tmp_path: Path):
    service, _, _ = _service(tmp_path, upload_slots=2)
    assert service.uploads.per_client == 1  # a per-client cap left unset follows its global cap down
    with service.upload_slot("ip:1"):
        with pytest.raises(TooMany):
            with service.upload_slot("ip:1"):
                pass
        with service.upload_slot("ip:2"):
            with pytest.raises(Busy):
                with service.upload_slot("ip:3"):
                    pass
    with pytest.raises(RuntimeError):
        with service.upload_slot("ip:1"):
            raise RuntimeError("transfer failed")
    assert service.uploads.used == 0 and service.stats["open_uploads"] == 0
    s = service.stats
    assert (s["refused_uploads_per_client"], s["refused_uploads"]) == (1, 1)
    assert (s["refused_per_client"], s["refused_busy"]) == (1, 1)


# -- configuration -----------------------------------------------------------------------------

def test_caps_have_sane_defaults_and_per_client_caps_stay_below_global_ones():
    c = ChunkServerConfig()
    for per_client, total in c.per_client_caps():
        assert 1 <= getattr(c, per_client) < getattr(c, total), per_client
    assert c.max_connections >= c.control_slots + c.max_waiting + c.upload_slots
    assert ChunkServerConfig(upload_slots=1).upload_slots_per_client == 1
    assert ChunkServerConfig(max_waiting=6).max_waiting_per_client == 3
    for bad in ({"upload_slots_per_client": 16}, {"max_waiting": 4, "max_waiting_per_client": 5},
                {"max_connections": 40}, {"max_connections_per_client": 10},
                {"retry_after_s": 0}, {"idle_timeout_s": 0}):
        with pytest.raises(ValidationError):
            ChunkServerConfig(**bad)


# -- which waits are held ----------------------------------------------------------------------

def test_a_wait_for_a_version_never_seen_signed_is_answered_at_once_and_pokes_at_most_once_a_second(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    async def scenario(service: ChunkService) -> tuple[list, float]:
        started = time.monotonic()
        answers = [await service.open_chunk(A, wait=10, version=v, client="ip:1") for v in (7, 8, 9, 3)]
        return answers, time.monotonic() - started

    service, inflight, pokes = _service(tmp_path)
    inflight.begin(_manifest(5, [A, B]), b"{}", held=set())  # fetching v5: A would be waited for with v=5
    answers, elapsed = asyncio.run(scenario(service))
    assert answers == [None] * 4 and elapsed < 1.0
    assert service.stats["wait_unseen"] == 4 and service.stats["waited"] == 0
    assert pokes == [1]  # 7, 8 and 9 are newer than anything known: one poke for the lot; 3 is older
    monkeypatch.setattr(pipeline, "POKE_INTERVAL_S", 0.0)
    asyncio.run(scenario(service))
    assert len(pokes) == 4


def test_a_chunk_of_the_signed_version_in_flight_is_held_until_it_arrives(tmp_path: Path):
    data = b"x" * 1024
    sha = hashlib.sha256(data).hexdigest()

    async def scenario(service: ChunkService, inflight: InFlight) -> tuple[bool, dict, bytes, object]:
        inflight.begin(_manifest(2, [sha, B]), b"{}", held=set())
        waiter = asyncio.create_task(service.open_chunk(sha, wait=10, version=2, client="ip:1"))
        for _ in range(10):
            await asyncio.sleep(0)
        early, during = waiter.done(), dict(service.stats)
        service.chunks.put(sha, data)
        inflight.arrived(sha)
        with await asyncio.wait_for(waiter, 1) as f:
            body = f.read()
        # Without v, a chunk of the verified manifest may be waited for; one outside it is not.
        outside = await asyncio.wait_for(service.open_chunk(C, wait=10, client="ip:1"), 1)
        return early, during, body, outside

    service, inflight, _ = _service(tmp_path)
    early, during, body, outside = asyncio.run(scenario(service, inflight))
    assert not early and body == data and outside is None
    assert during["waited"] == 1 and during["open_waiting"] == 1 and service.stats["open_waiting"] == 0


def test_held_requests_past_the_clients_share_get_429_and_past_the_servers_503_at_once(tmp_path: Path):
    async def scenario(service: ChunkService, inflight: InFlight) -> list:
        inflight.begin(_manifest(2, [A, B]), b"{}", held=set())
        held = [asyncio.create_task(service.open_chunk(A, wait=10, version=2, client="ip:1")) for _ in range(2)]
        held.append(asyncio.create_task(service.open_chunk(B, wait=10, version=2, client="ip:2")))
        for _ in range(10):
            await asyncio.sleep(0)
        outcomes: list = []
        for client in ("ip:1", "ip:3"):  # ip:1 holds its share; then the server holds max_waiting
            try:
                await asyncio.wait_for(service.open_chunk(B, wait=10, version=2, client=client), 1)
                outcomes.append("held")
            except (TooMany, Busy) as e:
                outcomes.append(e.status)
        outcomes.append(await asyncio.wait_for(service.open_chunk(A, wait=0, version=2, client="ip:3"), 1))
        inflight.end()  # the fetch ends: every held request is released at once
        outcomes.append(await asyncio.wait_for(asyncio.gather(*held), 1))
        return outcomes

    service, inflight, _ = _service(tmp_path, max_waiting=3, max_waiting_per_client=2)
    outcomes = asyncio.run(scenario(service, inflight))
    assert outcomes == [429, 503, None, [None, None, None]]
    s = service.stats
    assert (s["refused_waiting_per_client"], s["refused_waiting"], s["waited"], s["open_waiting"]) == (1, 1, 3, 0)


# -- the libp2p front end ----------------------------------------------------------------------

class _Frames:
    """What a handler wrote to one stream."""

    def __init__(self) -> None:
        self.headers: list[dict] = []
        self.body = b""
        self.header_sent = False

    async def header(self, status: int, size: int = 0, error: str | None = None) -> None:
        self.headers.append({"status": status, "size": size, "error": error})
        self.header_sent = True

    async def write(self, block: bytes) -> None:
        self.body += block


def test_libp2p_refuses_by_peer_with_error_frames_and_keeps_its_reserve_for_manifests(tmp_path: Path):
    async def scenario(service: ChunkService, inflight: InFlight) -> dict:
        handle = p2p_handler(service)
        inflight.begin(_manifest(2, [A, B]), b'{"signed": "manifest"}', held=set())
        frames = {name: _Frames() for name in ("p1", "p1_again", "p2", "p3", "p1_manifest", "p4_unseen")}

        def chunk(peer: str, name: str, version: int = 2) -> asyncio.Task:
            request = {"op": "chunk", "sha256": A, "wait": 10, "version": version}
            return asyncio.create_task(handle(request, peer, frames[name]))

        held = [chunk("P1", "p1"), chunk("P2", "p2")]  # the whole waiting budget (2), one each
        for _ in range(10):
            await asyncio.sleep(0)
        await asyncio.wait_for(chunk("P1", "p1_again"), 1)  # P1's share is taken: 429
        await asyncio.wait_for(chunk("P3", "p3"), 1)  # the server's is: 503
        await asyncio.wait_for(chunk("P4", "p4_unseen", version=9), 1)  # never held: 404 at once
        # Every held request the server allows is taken: manifests still come from the control budget.
        await asyncio.wait_for(handle({"op": "manifest", "version": 2}, "P1", frames["p1_manifest"]), 1)
        early = [task.done() for task in held]
        inflight.end()
        await asyncio.wait_for(asyncio.gather(*held), 1)
        return {"early": early, **{name: (f.headers, f.body) for name, f in frames.items()}}

    service, inflight, _ = _service(tmp_path, max_waiting=2, max_waiting_per_client=1)
    seen = asyncio.run(scenario(service, inflight))
    assert seen["early"] == [False, False]
    assert [h["status"] for h in seen["p1_again"][0] + seen["p3"][0]] == [429, 503]
    for name in ("p1_again", "p3"):
        assert seen[name][0][0]["size"] == 0 and seen[name][0][0]["error"].endswith("; retry after 2 s")
    assert seen["p4_unseen"][0] == [{"status": 404, "size": 0, "error": "chunk not held"}]
    assert seen["p1_manifest"] == ([{"status": 200, "size": 22, "error": None}], b'{"signed": "manifest"}')
    assert seen["p1"][0][0]["status"] == seen["p2"][0][0]["status"] == 404  # released when the fetch ended
    s = service.stats
    assert (s["p2p_refused"], s["refused_waiting_per_client"], s["refused_waiting"]) == (2, 1, 1)
    assert (s["refused_per_client"], s["refused_busy"], s["wait_unseen"], s["waited"]) == (1, 1, 1, 2)
    assert s["open_streams"] == s["open_waiting"] == s["open_control"] == 0
