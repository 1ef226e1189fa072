"""Every DHT key of a swarm, built in one place. Keys are `<swarm>/<record kind>[/<peer id>]`.

Cards live twice: under a per-peer key (a reader names the peers it wants, whatever the swarm's
size) and in one **card shard**, a dictionary of the cards whose peer ids hash into it. How many
shards there are is the swarm's **shard depth** `bits` (2**bits shards), which the learner signs
into its head (`HeadRecord.card_shard_bits`) from the number of cards it reads, so a shard holds
about CARDS_PER_SHARD cards however large the swarm. At depth 0 the one shard is `<swarm>/peers`,
the key every card shared before shards existed: small swarms keep that layout byte for byte.

    shard_of(peer_id, bits) = the first `bits` bits of sha256(peer id, UTF-8), as an integer
    shard_key(swarm, 0, 0)  = "<swarm>/peers"
    shard_key(swarm, b, s)  = "<swarm>/peers/<b>/<s>"  (b ≥ 1, 0 ≤ s < 2**b, both decimal)
"""

from __future__ import annotations

import hashlib

from echo2swarm.wire.records import MAX_CARD_SHARD_BITS as MAX_SHARD_BITS  # 1,024 shards: ~130,000 peers

CARDS_PER_SHARD = 128  # the learner deepens the shards when they hold more than this on average


def peers_key(swarm: str) -> str:
    """Dictionary value: subkey = peer id (base58), value = that peer's card. The shard at depth 0."""
    return f"{swarm}/peers"


def shard_of(peer_id: str, bits: int) -> int:
    """Which of the 2**bits card shards `peer_id`'s card lives in (0 at depth 0)."""
    if not 0 <= bits <= MAX_SHARD_BITS:
        raise ValueError(f"shard depth {bits} outside 0..{MAX_SHARD_BITS}")
    if bits == 0:
        return 0
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:2], "big") >> (16 - bits)


def shard_key(swarm: str, bits: int, shard: int) -> str:
    """Dictionary value: subkey = peer id, value = its card, for the peers whose `shard_of` is `shard`."""
    if not 0 <= shard < 1 << bits:
        raise ValueError(f"shard {shard} outside 0..{(1 << bits) - 1} at depth {bits}")
    return peers_key(swarm) if bits == 0 else f"{swarm}/peers/{bits}/{shard}"


def shard_keys(swarm: str, bits: int) -> list[str]:
    """Every card shard of the swarm at depth `bits`, in shard order."""
    return [shard_key(swarm, bits, s) for s in range(1 << bits)]


def all_shard_keys(swarm: str) -> dict[str, tuple[int, int]]:
    """Every card shard key at every depth -> (depth, shard): what a DHT node recognises and bounds."""
    return {shard_key(swarm, b, s): (b, s) for b in range(MAX_SHARD_BITS + 1) for s in range(1 << b)}


def card_key(swarm: str, peer_id: str) -> str:
    """Dictionary value: subkey = `peer_id`, value = its card (the same record as in its shard)."""
    return f"{swarm}/card/{peer_id}"


def roster_key(swarm: str, peer_id: str) -> str:
    """Dictionary value: subkey = `peer_id`, value = the roster it signed (wire/records.py RosterRecord)."""
    return f"{swarm}/roster/{peer_id}"


def head_key(swarm: str) -> str:
    """Dictionary value: subkey = signer's public key text, value = signed head record."""
    return f"{swarm}/head"


def swarm_keys(swarm: str) -> dict[str, str]:
    return {"peers": peers_key(swarm), "head": head_key(swarm)}
