"""Multiaddr syntax checks without importing hivemind, so config errors surface before any network start.

The overlay parses addresses again with hivemind's own Multiaddr; this module only makes sure a user
gets an error that names the flag and the bad address instead of a libp2p stack trace.
"""

from __future__ import annotations

import ipaddress
import re

# protocol -> validator of its value (None: the protocol takes no value)
_PORT = re.compile(r"^\d{1,5}$")
_BASE58_PEER_ID = re.compile(r"^(Qm[1-9A-HJ-NP-Za-km-z]{44}|12D3Koo[1-9A-HJ-NP-Za-km-z]{45,50}|[1-9A-HJ-NP-Za-km-z]{40,100})$")
_DNS_NAME = re.compile(r"^(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$")


def _ip4(v: str) -> bool:
    try:
        ipaddress.IPv4Address(v)
        return True
    except ValueError:
        return False


def _ip6(v: str) -> bool:
    try:
        ipaddress.IPv6Address(v)
        return True
    except ValueError:
        return False


def _port(v: str) -> bool:
    return bool(_PORT.fullmatch(v)) and int(v) <= 65535


_PROTOCOLS = {
    "ip4": _ip4,
    "ip6": _ip6,
    "dns": _DNS_NAME.fullmatch,
    "dns4": _DNS_NAME.fullmatch,
    "dns6": _DNS_NAME.fullmatch,
    "tcp": _port,
    "udp": _port,
    "p2p": _BASE58_PEER_ID.fullmatch,
    "ipfs": _BASE58_PEER_ID.fullmatch,
    "quic": None,
    "quic-v1": None,
    "ws": None,
    "wss": None,
    "tls": None,
    "noise": None,
    "p2p-circuit": None,
}


class MaddrError(ValueError):
    pass


def parse_maddr(text: str) -> list[tuple[str, str | None]]:
    """Split a multiaddr into (protocol, value) pairs, raising MaddrError on anything malformed."""
    if not isinstance(text, str) or not text.startswith("/"):
        raise MaddrError(f"{text!r} is not a multiaddr (it must start with '/', e.g. /ip4/1.2.3.4/tcp/31337/p2p/12D3Koo...)")
    parts = text.strip("/").split("/")
    out: list[tuple[str, str | None]] = []
    i = 0
    while i < len(parts):
        proto = parts[i]
        if proto not in _PROTOCOLS:
            raise MaddrError(f"{text!r}: unknown multiaddr protocol {proto!r}")
        check = _PROTOCOLS[proto]
        if check is None:
            out.append((proto, None))
            i += 1
            continue
        if i + 1 >= len(parts) or not parts[i + 1]:
            raise MaddrError(f"{text!r}: protocol {proto!r} needs a value")
        value = parts[i + 1]
        if not check(value):
            raise MaddrError(f"{text!r}: {value!r} is not a valid {proto} value")
        out.append((proto, value))
        i += 2
    if not out or out[0][0] not in ("ip4", "ip6", "dns", "dns4", "dns6", "p2p"):
        raise MaddrError(f"{text!r}: a multiaddr starts with an address (/ip4, /ip6, /dns...)")
    for (proto, _), nxt in zip(out, [*out[1:], ("", None)]):
        # p2pd (go-libp2p 0.32) speaks QUIC v1 only: a bare /udp or draft-29 /quic fails when p2pd starts
        # ("no transport for protocol"); say so here, naming the fix.
        if proto == "udp" and nxt[0] != "quic-v1":
            raise MaddrError(f"{text!r}: UDP is for QUIC only: write /udp/<port>/quic-v1 (draft /quic is not supported)")
    return out


def check_listen_maddr(text: str) -> str:
    """An address to listen on or announce: host + transport, no peer id."""
    parsed = parse_maddr(text)
    if not any(p in ("tcp", "udp") for p, _ in parsed):
        raise MaddrError(f"{text!r}: a listen address needs a transport, e.g. /ip4/0.0.0.0/tcp/31337")
    if any(p == "p2p" for p, _ in parsed):
        raise MaddrError(f"{text!r}: a listen address must not carry a /p2p/ peer id")
    return text


def check_peer_maddr(text: str) -> str:
    """An address of another peer: host + transport + /p2p/<peer id> as the last component."""
    parsed = parse_maddr(text)
    if parsed[-1][0] != "p2p":
        raise MaddrError(f"{text!r}: a peer address must end with /p2p/<peer id>, as printed by the daemon at start")
    if not any(p in ("tcp", "udp") for p, _ in parsed) and not any(p == "p2p-circuit" for p, _ in parsed):
        raise MaddrError(f"{text!r}: a peer address needs a transport, e.g. /ip4/1.2.3.4/tcp/31337/p2p/12D3Koo...")
    return text
