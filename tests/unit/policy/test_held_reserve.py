"""Held requests and connections: one budget for everyone not seen working, a reserve for the peers
that are, known by a credential of their libp2p key that is checked for its server, its time and
its novelty. Pure logic first, then a real ChunkServer on 127.0.0.1 with clients bound to several
loopback source addresses (each its own client to the per-address caps)."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path

import aiohttp
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from pydantic import ValidationError

from echo2swarm.config.models import ChunkServerConfig
from echo2swarm.policy.budgets import Budget
from echo2swarm.policy.peer_auth import HEADER, CredentialCheck, CredentialRefused, PeerSigner
from echo2swarm.policy.server import ChunkServer, ChunkService
from echo2swarm.policy.store import ChunkStore, VersionStore
from echo2swarm.policy.working import WATCH_EVERY_S, WorkingPeers
from echo2swarm.wire.peer_keys import PeerKey

pytestmark = pytest.mark.timeout(60)
SERVER = PeerKey.generate().peer_id  # the audience: the chunk server's own peer id


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


# -- the budget ----------------------------------------------------------------------------------

def test_everyone_not_seen_working_shares_one_budget_and_working_peers_keep_the_reserve():
    stats: Counter[str] = Counter()
    waiting = Budget("waiting", 8, 2, stats, reserve=3)
    # Ten addresses, each within its own share: together they get total - reserve, no more.
    taken = [waiting.acquire(f"ip:10.0.0.{i}") for i in range(10)]
    assert taken[:5] == [None] * 5
    assert [(r.reason, r.status) for r in taken[5:] if r is not None] == [("waiting", 503)] * 5
    # Working peers take the reserve, each within its own share.
    assert waiting.acquire("peer:A", working=True) is None and waiting.acquire("peer:A", working=True) is None
    assert waiting.acquire("peer:A", working=True).reason == "waiting_per_client"
    assert waiting.acquire("peer:B", working=True) is None
    full = waiting.acquire("peer:C", working=True)
    assert (full.reason, full.status) == ("waiting_reserve", 503)
    assert (stats["open_waiting"], stats["working_open_waiting"]) == (8, 3)
    # A working peer's unit freed is not the others' to take: they still hold their whole share.
    waiting.release("peer:B", working=True)
    assert waiting.acquire("ip:10.0.0.9").reason == "waiting"
    waiting.release("ip:10.0.0.0")
    assert waiting.acquire("ip:10.0.0.9") is None
    # With few others about, working peers may use the whole budget.
    roomy = Budget("waiting", 4, 4, Counter(), reserve=1)
    assert [roomy.acquire("peer:A", working=True) for _ in range(4)] == [None] * 4


def test_a_reserve_is_below_its_budget_and_follows_it_down():
    assert (ChunkServerConfig().held_reserve, ChunkServerConfig().connection_reserve) == (8, 32)
    assert ChunkServerConfig(max_waiting=8).held_reserve == 2  # a quarter, when that is less than the default
    assert ChunkServerConfig(max_waiting=8, held_reserve=0).held_reserve == 0
    with pytest.raises(ValidationError, match="held_reserve"):
        ChunkServerConfig(max_waiting=8, held_reserve=8)
    with pytest.raises(ValueError, match="reserve"):
        Budget("waiting", 4, 2, Counter(), reserve=4)


# -- who is working ------------------------------------------------------------------------------

def test_working_peers_are_those_seen_doing_checked_work_lately():
    clock = Clock()
    stats: Counter[str] = Counter()
    working = WorkingPeers(ttl_s=60.0, stats=stats, clock=clock)
    delivered: Counter[str] = Counter({"A": 3})
    working.watch(lambda: delivered)
    assert "A" in working and "B" not in working and len(working) == 1
    clock.now += 59
    assert "A" in working  # its count has not grown, but it was seen within the ttl
    clock.now += 2
    assert "A" not in working
    delivered["A"] += 1
    clock.now += WATCH_EVERY_S
    assert "A" in working and stats["working_seen_delivery"] == 2
    # A whole version's worth of bytes fetched (over several versions, as a plan child fetches a stripe).
    working.fetched("B", 300, whole=1000)
    working.fetched("B", 600, whole=1000)
    assert "B" not in working
    working.fetched("B", 100, whole=1000)
    assert "B" in working and stats["working_seen_fetch"] == 1
    working.fetched("C", 10**9, whole=0)  # nothing held here: nothing to have fetched whole
    assert "C" not in working
    bounded = WorkingPeers(ttl_s=60.0, clock=clock, max_peers=2)
    for peer in "PQR":
        bounded.saw(peer)
    assert "P" not in bounded and {"Q", "R"} <= {p for p in "QR" if p in bounded}


# -- credentials ---------------------------------------------------------------------------------

def test_a_credential_proves_its_peer_to_its_server_for_its_path_now_and_once():
    key, stranger = PeerKey.generate(), PeerKey.generate()
    clock = Clock(1_700_000_000.0)
    stats: Counter[str] = Counter()
    check = CredentialCheck(SERVER, window_s=30.0, stats=stats, clock=clock)
    signer = PeerSigner(key, clock=clock)

    header = signer.credential(SERVER, "/v1/head")
    assert check.claimed(header) == key.peer_id
    assert check.verify(header, "/v1/head") == key.peer_id
    with pytest.raises(CredentialRefused) as replayed:
        check.verify(header, "/v1/head")  # the same credential again
    assert replayed.value.reason == "replayed"

    for forged, path in [
        (signer.credential(PeerKey.generate().peer_id, "/v1/head"), "/v1/head"),  # made for another server
        (signer.credential(SERVER, "/v1/plan/3"), "/v1/head"),  # for another path
        (key.peer_id + PeerSigner(stranger, clock=clock).credential(SERVER, "/v1/head")[len(stranger.peer_id):],
         "/v1/head"),  # names our peer, signed by a stranger's key
    ]:
        with pytest.raises(CredentialRefused) as refused:
            check.verify(forged, path)
        assert refused.value.reason == "forged"

    late = signer.credential(SERVER, "/v1/head")
    clock.now += 31
    assert check.verify(late, "/v1/head") is None  # outside the window: the request is anyone's
    for junk in ("", "nonsense", f"{key.peer_id} 1 2 3", "x" * 5000):
        assert check.verify(junk, "/v1/head") is None
    assert (stats["auth_ok"], stats["auth_replayed"], stats["auth_forged"], stats["auth_stale"],
            stats["auth_malformed"]) == (1, 1, 3, 1, 3)


def test_a_peer_id_that_hashes_an_rsa_key_sends_the_key_with_its_credential():
    key = PeerKey(rsa.generate_private_key(public_exponent=65537, key_size=2048))
    check = CredentialCheck(SERVER, window_s=30.0, stats=Counter())
    assert check.verify(PeerSigner(key).credential(SERVER, "/v1/head"), "/v1/head") == key.peer_id


# -- a real server, clients on several source addresses ------------------------------------------

HEAD = json.dumps({"version": 1}).encode()
HOLD = "/v1/head?after=5&wait={wait}"  # a head nobody publishes: held the whole wait


def _server(tmp_path: Path, working: list[str], **config: object) -> ChunkServer:
    delivered = Counter({peer: 1 for peer in working})
    service = ChunkService(ChunkServerConfig(host="127.0.0.1", **config), ChunkStore(tmp_path), VersionStore(tmp_path),
                           peer_id=SERVER, work=[lambda: delivered])
    return ChunkServer(service, head=lambda: HEAD)


async def _get(url: str, source: str, headers: dict[str, str] | None = None,
               timeout: float = 10.0) -> tuple[int, float, dict[str, str]]:
    """One GET from `source` (a loopback address bound as the source): status, seconds, headers."""
    started = time.monotonic()
    connector = aiohttp.TCPConnector(local_addr=(source, 0), force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        async with session.get(url, headers=headers) as resp:
            await resp.read()
            return resp.status, time.monotonic() - started, dict(resp.headers)


async def _until(predicate, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)  # poll interval of an in-process condition


def test_many_addresses_hold_only_the_others_share_and_a_working_peer_still_gets_held(tmp_path: Path):
    honest, newcomer = PeerKey.generate(), PeerKey.generate()
    server = _server(tmp_path, working=[honest.peer_id], max_waiting=6, max_waiting_per_client=2, held_reserve=2,
                     retry_after_s=1)
    stats = server.stats

    async def main() -> None:
        port = await server.start()
        url = f"http://127.0.0.1:{port}" + HOLD.format(wait=3)
        try:
            # Eight addresses, each within its share: together they hold 6 - 2 = 4, the rest refused at once.
            flood = [asyncio.create_task(_get(url, f"127.0.0.{10 + i}")) for i in range(8)]
            await _until(lambda: sum(t.done() for t in flood) == 4, "4 of the flood refused")
            refused = [t.result() for t in flood if t.done()]
            assert {(status, h.get("Retry-After")) for status, _, h in refused} == {(503, "1")}
            assert stats["open_waiting"] == 4 and all(took < 0.9 for _, took, _ in refused)  # first refusals: at once
            # An address refused again before its Retry-After is up gets the answer only then.
            first = next(i for i, t in enumerate(flood) if t.done())
            status, took, _ = await _get(url, f"127.0.0.{10 + first}")
            assert status == 503 and took >= 0.5 and stats["paced_refusals"] == 1

            # A newcomer's valid credential proves who it is, not that it works: it is one of the others.
            status, _, _ = await _get(url, "127.0.0.40", PeerSigner(newcomer).headers(SERVER, "/v1/head"))
            assert status == 503
            # The working peer, from an address of its own, is held from the reserve.
            header = PeerSigner(honest).headers(SERVER, "/v1/head")
            held = asyncio.create_task(_get(url, "127.0.0.30", header))
            await _until(lambda: stats["working_open_waiting"] == 1, "the working peer's request to be held")
            assert stats["open_waiting"] == 5
            # Its credential replayed (by whoever saw it), or its peer id with a stranger's signature: 401.
            assert (await _get(url, "127.0.0.41", header))[0] == 401
            forged = {HEADER: honest.peer_id + PeerSigner(newcomer).credential(SERVER, "/v1/head")[len(newcomer.peer_id):]}
            assert (await _get(url, "127.0.0.42", forged))[0] == 401
            assert (stats["refused_auth_replayed"], stats["refused_auth_forged"]) == (1, 1)


            assert (await held)[0] == 200  # the working peer's long-poll ran its course
            assert [s for s, _, _ in await asyncio.gather(*flood)].count(200) == 4
        finally:
            await server.stop()

    asyncio.run(main())


def test_a_connection_past_the_others_share_is_kept_for_a_working_peer(tmp_path: Path):
    honest = PeerKey.generate()
    server = _server(tmp_path, working=[honest.peer_id], max_connections=12, connection_reserve=4, control_slots=2,
                     max_waiting=6, upload_slots=2)
    stats = server.stats

    async def main() -> None:
        port = await server.start()
        base = f"http://127.0.0.1:{port}"
        idle: list[asyncio.StreamWriter] = []
        try:
            for i in range(8):  # the others' share of connections (12 - 4), from four addresses
                _, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(f"127.0.0.{10 + i // 2}", 0))
                idle.append(writer)
            await _until(lambda: stats["open_connections"] == 8, "8 connections")
            status, _, _ = await _get(base + HOLD.format(wait=1), "127.0.0.20")
            assert status == 503 and stats["refused_connections"] == 1  # past the others' share: refused, closed
            # The working peer's first request names it: its connection is kept, out of the reserve.
            connector = aiohttp.TCPConnector(local_addr=("127.0.0.30", 0))
            signer = PeerSigner(honest)
            async with aiohttp.ClientSession(connector=connector) as session:
                for _ in range(2):  # the same connection serves it again
                    async with session.get(base + HOLD.format(wait=0.2), headers=signer.headers(SERVER, "/v1/head")) as resp:
                        assert resp.status == 200 and (await resp.read()) == HEAD
                assert stats["promoted_connections"] == 1 and stats["working_open_connections"] == 1
        finally:
            for writer in idle:
                writer.close()
            await server.stop()

    asyncio.run(main())


def test_a_dropped_connection_is_held_unread_for_retry_after_then_closed(tmp_path: Path):
    server = _server(tmp_path, working=[], max_connections=12, control_slots=2, max_waiting=6, upload_slots=2,
                     retry_after_s=1)  # 6 connections per address, dropped past 12

    async def main() -> None:
        port = await server.start()
        writers: list[asyncio.StreamWriter] = []
        try:
            for _ in range(12):
                _, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.10", 0))
                writers.append(writer)
            await _until(lambda: server.stats["open_connections"] == 12, "12 connections")
            reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.10", 0))
            writers.append(writer)
            started = time.monotonic()
            writer.write(b"GET /v1/info HTTP/1.1\r\nHost: x\r\n\r\n")
            try:
                answer = await asyncio.wait_for(reader.read(), 5)
            except ConnectionError:
                answer = b""
            assert answer == b"" and 0.5 <= time.monotonic() - started < 3  # never read, closed after ~1 s
            assert server.stats["dropped_connections"] == 1
        finally:
            for w in writers:
                w.close()
            await server.stop()

    asyncio.run(main())
