"""The dial-back responder dials only the caller's own observed IP, and answers each caller once per interval."""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass

from echo2swarm.overlay.reachability import MIN_INTERVAL_S, DialbackService
from echo2swarm.wire.reach import DialbackRequest

CALLER = "12D3KooWLa6nYHf23Sy325fhqkn3CmwykYLBe7okytPd5cDMTd6W"


@dataclass
class _Info:
    peer_id: object
    addrs: list[str]


class _Id:
    def __init__(self, text: str):
        self.text = text

    def to_base58(self) -> str:
        return self.text


class _Client:
    """p2pd's LIST_PEERS: the caller is connected from 127.0.0.1 (or only through a relay)."""

    def __init__(self, addrs: list[str]):
        self.addrs = addrs

    async def list_peers(self) -> list[_Info]:
        return [_Info(_Id(CALLER), self.addrs)]


class _Overlay:
    def __init__(self, addrs: list[str]):
        self.p2p = type("P2P", (), {"_client": _Client(addrs)})()


def test_dials_the_observed_ip_at_the_asked_ports_once_per_interval() -> None:
    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("127.0.0.1", 0))
        listening.listen(4)
        closed.bind(("127.0.0.1", 0))  # bound, not listening: refuses
        open_port, closed_port = listening.getsockname()[1], closed.getsockname()[1]
        service = DialbackService(_Overlay(["/ip4/127.0.0.1/tcp/50000"]))  # type: ignore[arg-type]
        reply = asyncio.run(service.rpc_dialback(DialbackRequest(ports=[open_port, closed_port]), CALLER))
        assert reply.observed == "127.0.0.1" and reply.reached == [open_port] and reply.refused is None
        again = asyncio.run(service.rpc_dialback(DialbackRequest(ports=[open_port]), CALLER))
        assert again.refused and f"{MIN_INTERVAL_S:g} s" in again.refused and again.reached == []
        assert service.stats == {"answered": 1, "refused": 1}


def test_a_caller_seen_only_through_a_relay_gets_no_dials() -> None:
    circuit = "/ip4/11.0.0.11/tcp/4001/p2p/12D3KooWRDEWU4MwWfpwGiz9arVpPohbq64LFaUqci9WMZvNRqVU/p2p-circuit"
    service = DialbackService(_Overlay([circuit]))  # type: ignore[arg-type]
    reply = asyncio.run(service.rpc_dialback(DialbackRequest(ports=[1], chunk_port=2), CALLER))
    assert reply.observed is None and reply.relayed and reply.reached == [] and reply.chunk_ok is None
