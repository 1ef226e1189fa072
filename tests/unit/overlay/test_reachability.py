"""What a daemon advertises for each probe outcome (overlay/reachability.py), without a network."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from echo2swarm.config.models import OverlayConfig
from echo2swarm.overlay import reachability
from echo2swarm.overlay.reachability import ReachabilityTracker
from echo2swarm.wire.reach import DialbackReply, DialbackRequest
from echo2swarm.wire.records import PeerCard

RELAY = "12D3KooWRDEWU4MwWfpwGiz9arVpPohbq64LFaUqci9WMZvNRqVU"
BOOT = "12D3KooWLa6nYHf23Sy325fhqkn3CmwykYLBe7okytPd5cDMTd6W"
CIRCUIT = f"/ip4/11.0.0.11/tcp/4001/p2p/{RELAY}/p2p-circuit"


class _Client:
    """p2pd's control client: the connections it lists, and the connects asked of it."""

    def __init__(self) -> None:
        self.conns: dict[str, list[str]] = {}
        self.connects: list[tuple[str, list[str]]] = []

    async def list_peers(self) -> list[Any]:
        return [SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda p=p: p), addrs=addrs)
                for p, addrs in self.conns.items()]

    async def connect(self, peer: Any, addrs: list[Any]) -> None:
        self.connects.append((peer.to_base58(), [str(a) for a in addrs]))


class _Overlay:
    """Stands in for the overlay's p2pd: its listen addresses only (the tracker's other collaborator is `probe`)."""

    peer_id = "12D3KooWSelf1111111111111111111111111111111111111111"

    def __init__(self, listen: list[str]):
        self.listen = listen
        self.nat: dict[str, str] = {}             # peer id -> relayed | private, as cards say
        self.cards: dict[str, list[str]] = {}     # peer id -> card maddrs
        self.p2p = SimpleNamespace(_client=_Client())

    async def listen_maddrs(self) -> list[str]:
        return list(self.listen)

    def public_peers(self) -> list[str]:
        return []

    def nat_peers(self) -> dict[str, str]:
        return dict(self.nat)

    def known_maddrs(self, peer_id: str) -> list[str]:
        return list(self.cards.get(peer_id, []))

    async def get_cards(self) -> tuple[list[object], int]:
        return [], 0


def _tracker(monkeypatch: pytest.MonkeyPatch, listen: list[str], reply: DialbackReply | None) -> ReachabilityTracker:
    async def probe(overlay: Any, targets: list[str], ports: list[int], chunk_port: int | None, **_: Any):
        assert targets == [BOOT]
        return reachability.ProbeResult(responder=BOOT if reply else None, reply=reply, skew_s=0.0 if reply else None,
                                        errors=[] if reply else ["timed out"])

    monkeypatch.setattr(reachability, "probe", probe)
    config = OverlayConfig(initial_peers=[f"/ip4/11.0.0.10/tcp/31337/p2p/{BOOT}"])
    return ReachabilityTracker(_Overlay(listen), config)  # type: ignore[arg-type]


def test_public_advertises_only_addresses_that_answered(monkeypatch: pytest.MonkeyPatch) -> None:
    t = _tracker(monkeypatch, ["/ip4/11.0.0.12/tcp/4001", "/ip4/127.0.0.1/tcp/4001"],
                 DialbackReply(observed="11.0.0.12", reached=[4001], chunk_ok=True, time_ms=0))
    asyncio.run(t.update("http://11.0.0.12:8000", force=True))
    assert t.state == "public" and t.maddrs == ["/ip4/11.0.0.12/tcp/4001"]
    assert t.card_chunk_url("http://11.0.0.12:8000") == "http://11.0.0.12:8000"


def test_behind_nat_advertises_relay_addresses_and_no_chunk_url(monkeypatch: pytest.MonkeyPatch) -> None:
    listen = ["/ip4/127.0.0.1/tcp/4001", "/ip4/192.168.1.2/tcp/4001"]
    t = _tracker(monkeypatch, listen, DialbackReply(observed="11.0.0.20", reached=[], chunk_ok=False, time_ms=0))
    asyncio.run(t.update("http://192.168.1.2:8000", force=True))
    assert t.state == "private" and t.maddrs == [] and t.card_chunk_url("http://192.168.1.2:8000") is None
    t.overlay.listen.append(CIRCUIT)  # type: ignore[attr-defined]  # a relay slot, some seconds later
    assert asyncio.run(t.update("http://192.168.1.2:8000")), "new addresses are probed and change the card"
    assert t.state == "relayed" and t.maddrs == [CIRCUIT]


def test_unknown_keeps_loopback_only_on_a_one_machine_swarm(monkeypatch: pytest.MonkeyPatch) -> None:
    t = _tracker(monkeypatch, ["/ip4/127.0.0.1/tcp/4001"], None)
    asyncio.run(t.update(None, force=True))
    assert t.state == "unknown" and t.maddrs == ["/ip4/127.0.0.1/tcp/4001"] and "timed out" in (t.last_error or "")
    t = _tracker(monkeypatch, ["/ip4/127.0.0.1/tcp/4001", "/ip4/10.0.0.5/tcp/4001"], None)
    asyncio.run(t.update(None, force=True))
    assert t.maddrs == ["/ip4/10.0.0.5/tcp/4001"]


def test_probe_messages_and_card_field_are_bounded() -> None:
    with pytest.raises(ValueError):
        DialbackRequest(ports=[1, 2, 3, 4, 5])
    with pytest.raises(ValueError):
        DialbackRequest(ports=[70000])
    fields = dict(peer_id=BOOT, role="rollout", price=0.0, state="ready", software="t", updated_ms=0)
    assert PeerCard(**fields, reachability="relayed").reachability == "relayed"
    with pytest.raises(ValueError):
        PeerCard(**fields, reachability="hole-punched-maybe")  # type: ignore[arg-type]


def test_an_unanswered_probe_keeps_the_last_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    t = _tracker(monkeypatch, ["/ip4/11.0.0.12/tcp/4001"],
                 DialbackReply(observed="11.0.0.12", reached=[4001], chunk_ok=True, time_ms=0))
    asyncio.run(t.update(None, force=True))
    assert t.state == "public"
    _tracker(monkeypatch, [], None)  # the responder left: the next probe gets no answer
    asyncio.run(t.update(None, force=True))
    assert t.state == "public" and t.maddrs == ["/ip4/11.0.0.12/tcp/4001"] and t.last_error


HOME_B = "12D3KooWPyMeQwGfaQpTXH7NaxbLWv59XvybnxJHBgVzBuHUrCrV"
HOME_C = "12D3KooWCXqzv7NT5WHtRT96REpHCMabkDTMXYH59RMYq3TKyXsB"


def test_public_advertises_quic_beside_the_tcp_that_answered(monkeypatch: pytest.MonkeyPatch) -> None:
    listen = ["/ip4/11.0.0.12/tcp/4001", "/ip4/11.0.0.12/udp/4002/quic-v1", "/ip4/127.0.0.1/udp/4002/quic-v1"]
    t = _tracker(monkeypatch, listen, DialbackReply(observed="11.0.0.12", reached=[4001], chunk_ok=True, time_ms=0))
    asyncio.run(t.update(None, force=True))
    assert t.state == "public" and t.maddrs == listen[:2] and t.holepunch == []


def test_relayed_peer_gives_dcutr_a_relayed_connection_then_reports_the_punched_transport(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    listen = ["/ip4/192.168.1.2/tcp/4001", "/ip4/192.168.1.2/udp/4002/quic-v1", CIRCUIT]
    t = _tracker(monkeypatch, listen, DialbackReply(observed="11.0.0.20", reached=[], chunk_ok=False, time_ms=0))
    overlay: Any = t.overlay
    circuit_b = f"/ip4/11.0.0.11/udp/4003/quic-v1/p2p/{RELAY}/p2p-circuit"
    overlay.nat = {HOME_B: "relayed", HOME_C: "private"}
    overlay.cards = {HOME_B: [circuit_b]}
    asyncio.run(t.update(None, force=True))
    assert t.state == "relayed" and t.holepunch == [] and t.direct == {}
    # No punched connection yet: one relayed connection to the relayed peer (not the private one) for DCUtR.
    assert overlay.p2p._client.connects == [(HOME_B, [circuit_b])]
    asyncio.run(t.update(None))
    assert len(overlay.p2p._client.connects) == 1, "at most one try per reachability period"
    # DCUtR upgraded it: a direct QUIC connection beside the relayed one.
    overlay.p2p._client.conns = {HOME_B: [circuit_b, "/ip4/11.0.0.21/udp/5000/quic-v1"], BOOT: ["/ip4/11.0.0.10/tcp/1"]}
    assert asyncio.run(t.update(None)), "a new hole-punched transport changes the card"
    assert t.holepunch == ["quic"] and t.direct == {HOME_B: "quic"}
    overlay.p2p._client.conns = {}
    asyncio.run(t.update(None))
    assert t.holepunch == ["quic"] and t.direct == {}, "the transport stays on the card for a reachability period"


def test_card_holepunch_field_is_bounded() -> None:
    fields = dict(peer_id=HOME_B, role="rollout", price=0.0, state="ready", software="x", updated_ms=0)
    assert PeerCard(**fields, holepunch=["quic", "tcp"]).holepunch == ["quic", "tcp"]
    for bad in (["quic", "quic"], ["udp"], ["quic", "tcp", "tcp"], "quic"):
        with pytest.raises(ValueError):
            PeerCard(**fields, holepunch=bad)
