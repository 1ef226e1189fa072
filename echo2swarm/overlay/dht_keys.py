"""Every DHT key of a swarm, built in one place. Keys are `<swarm>/<record kind>`."""

from __future__ import annotations


def peers_key(swarm: str) -> str:
    """Dictionary value: subkey = peer id (base58), value = that peer's card."""
    return f"{swarm}/peers"


def head_key(swarm: str) -> str:
    """Dictionary value: subkey = signer's public key text, value = signed head record."""
    return f"{swarm}/head"


def swarm_keys(swarm: str) -> dict[str, str]:
    return {"peers": peers_key(swarm), "head": head_key(swarm)}
