"""Every DHT key of a swarm, built in one place. Keys are `<swarm>/<record kind>[/<peer id>]`.

The shared peers key holds every card in one dictionary, which one DHT reply carries whole; the
per-peer keys let a reader fetch the cards (and the roster) of peers it names without that reply.
"""

from __future__ import annotations


def peers_key(swarm: str) -> str:
    """Dictionary value: subkey = peer id (base58), value = that peer's card."""
    return f"{swarm}/peers"


def card_key(swarm: str, peer_id: str) -> str:
    """Dictionary value: subkey = `peer_id`, value = its card (the same record as under `peers_key`)."""
    return f"{swarm}/card/{peer_id}"


def roster_key(swarm: str, peer_id: str) -> str:
    """Dictionary value: subkey = `peer_id`, value = the roster it signed (wire/records.py RosterRecord)."""
    return f"{swarm}/roster/{peer_id}"


def head_key(swarm: str) -> str:
    """Dictionary value: subkey = signer's public key text, value = signed head record."""
    return f"{swarm}/head"


def swarm_keys(swarm: str) -> dict[str, str]:
    return {"peers": peers_key(swarm), "head": head_key(swarm)}
