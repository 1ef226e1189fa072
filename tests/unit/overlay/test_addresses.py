"""Multiaddrs as go-libp2p reads them, and how our addresses are classified."""

from __future__ import annotations

from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

from echo2swarm.overlay.addresses import EncodedMaddr, classify, dial_addrs, tcp_port

RELAY = "12D3KooWRDEWU4MwWfpwGiz9arVpPohbq64LFaUqci9WMZvNRqVU"
TARGET = "12D3KooWLa6nYHf23Sy325fhqkn3CmwykYLBe7okytPd5cDMTd6W"


def test_p2p_component_is_the_bare_multihash_go_expects() -> None:
    circuit = f"/ip4/11.0.0.11/tcp/35965/p2p/{RELAY}/p2p-circuit"
    data = EncodedMaddr(circuit).to_bytes()
    multihash = PeerID.from_base58(RELAY).to_bytes()
    # ip4 (04) 11.0.0.11, tcp (06) 35965, p2p (a5 03) length-prefixed multihash, p2p-circuit (a2 02)
    assert data == (bytes.fromhex("040b00000b") + bytes.fromhex("068c7d") + bytes.fromhex("a503")
                    + bytes([len(multihash)]) + multihash + bytes.fromhex("a202"))
    # hivemind's own encoder writes a CID there (01 72 ...), which p2pd refuses
    assert Multiaddr(circuit).to_bytes() != data


def test_dial_addrs_strip_the_target_but_keep_the_relay() -> None:
    direct = f"/ip4/1.2.3.4/tcp/5/p2p/{TARGET}"
    circuit = f"/ip4/11.0.0.11/tcp/35965/p2p/{RELAY}/p2p-circuit/p2p/{TARGET}"
    texts = [str(a) for a in dial_addrs([direct, circuit, "garbage"])]
    assert texts == ["/ip4/1.2.3.4/tcp/5", f"/ip4/11.0.0.11/tcp/35965/p2p/{RELAY}/p2p-circuit"]


def test_classify() -> None:
    assert classify(f"/ip4/11.0.0.11/tcp/1/p2p/{RELAY}/p2p-circuit") == "circuit"
    assert classify("/ip4/127.0.0.1/tcp/1") == "loopback"
    assert classify("/ip4/192.168.1.2/tcp/1") == "private"
    assert classify("/ip4/11.0.0.10/tcp/1") == "public"
    assert classify("/dns4/example.com/tcp/1") == "other"
    assert tcp_port("/ip4/11.0.0.10/tcp/4001") == 4001 and tcp_port("/ip4/1.2.3.4/udp/1/quic") is None
