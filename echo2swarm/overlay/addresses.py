"""Multiaddrs as p2pd understands them, and which of ours others can use.

hivemind's Python `Multiaddr` writes a `/p2p/<id>` component as a CID (`01 72 ...`), where go-libp2p
expects the bare multihash: p2pd refuses such an address with "length greater than remaining number
of bytes in buffer". A relayed peer's address is `/ip4/R/tcp/N/p2p/<relay>/p2p-circuit`, so without
`encode_maddr` nobody can dial a peer behind NAT through its relay.

    >>> classify("/ip4/11.0.0.11/tcp/4001/p2p/12D3KooW.../p2p-circuit")
    'circuit'
    >>> classify("/ip4/192.168.1.2/tcp/4001")
    'private'
"""

from __future__ import annotations

import ipaddress
from typing import Literal

from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

from echo2swarm.wire.peer_keys import varint

AddressClass = Literal["circuit", "loopback", "private", "public", "other"]
_P2P_CODE = 421


class EncodedMaddr:
    """A multiaddr in go-libp2p's binary form; p2pd's control client only calls `to_bytes()`."""

    def __init__(self, text: str):
        self.text = text
        parts = text.split("/p2p/")
        data = Multiaddr(parts[0]).to_bytes() if parts[0] else b""
        for part in parts[1:]:
            peer, _, rest = part.partition("/")
            multihash = PeerID.from_base58(peer).to_bytes()
            data += varint(_P2P_CODE) + varint(len(multihash)) + multihash
            if rest:
                data += Multiaddr("/" + rest).to_bytes()
        self._data = data

    def to_bytes(self) -> bytes:
        return self._data

    def __str__(self) -> str:
        return self.text


def dial_addrs(maddrs: list[str]) -> list[EncodedMaddr]:
    """What to hand p2pd's connect for a peer: its transport addresses, and circuit addresses whole.

    A direct address loses its trailing `/p2p/<peer>` (connect names the peer separately); a circuit
    address keeps the relay's `/p2p/<relay>`, correctly encoded. Unparsable addresses are skipped.
    """
    out = []
    for addr in maddrs:
        text = addr if "/p2p-circuit" in addr else addr.split("/p2p/", 1)[0]
        if "/p2p-circuit/p2p/" in text:  # a circuit address naming its target: connect names it already
            text = text.split("/p2p-circuit/p2p/", 1)[0] + "/p2p-circuit"
        try:
            out.append(EncodedMaddr(text))
        except Exception:  # hivemind's parser raises several types on garbage from a card
            continue
    return out


def ip_of(maddr: str) -> str | None:
    parts = maddr.split("/")
    if len(parts) > 2 and parts[1] in ("ip4", "ip6"):
        return parts[2]
    return None


def classify(maddr: str) -> AddressClass:
    if "/p2p-circuit" in maddr:
        return "circuit"
    ip = ip_of(maddr)
    if ip is None:
        return "other"
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        return "other"
    if address.is_loopback:
        return "loopback"
    if address.is_global:
        return "public"
    if address.is_private or address.is_link_local:
        return "private"
    return "other"


def transport(maddr: str) -> Literal["tcp", "quic"] | None:
    """The transport a direct address dials: tcp, quic (QUIC v1), or None (circuit, websocket, garbage)."""
    if classify(maddr) == "circuit":
        return None
    parts = maddr.split("/")
    if len(parts) > 4 and parts[3] == "tcp" and (len(parts) == 5 or parts[5] == "p2p"):
        return "tcp"
    if len(parts) > 5 and parts[3] == "udp" and parts[5] == "quic-v1":
        return "quic"
    return None


def tcp_port(maddr: str) -> int | None:
    parts = maddr.split("/")
    if len(parts) > 4 and parts[3] == "tcp" and parts[4].isdigit():
        return int(parts[4])
    return None
