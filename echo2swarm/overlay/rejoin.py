"""The peers a daemon can rejoin its swarm by when none of its --initial-peers answers any more.

A swarm's bootstrap is often one machine; when it is gone, a daemon restarted with the same
`--initial-peers` could not join though the learner and its peers still run. So every daemon keeps
`rejoin.json` in its state dir: up to `LIMIT` peers of its swarm it saw doing work (what it can
vouch for: they delivered groups or served verified chunks here, or a roster it read names them:
overlay/roster.py), each with the addresses its card gave. A stranger that only announces a card
or asks for work never gets in, so a crowd of fresh identities cannot make the list lead to them.

    supervisor ─ every announce period ─► Overlay.rejoin_candidates() ─► RejoinList.update (written if changed)
    Overlay.start: --initial-peers unreachable ─► RejoinList.load() ─► p2pd and the DHT joined through those

The file is read as hostile input (a stale or hand-edited file must not crash a start): bad
entries are skipped, a file of another swarm or older than MAX_AGE_S is ignored. Every address,
written or read, passes the checks `--initial-peers` gets (config/maddr.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from echo2swarm.config.maddr import MaddrError, check_peer_maddr, parse_maddr
from echo2swarm.overlay.addresses import classify
from echo2swarm.runtime.files import atomic_write
from echo2swarm.runtime.logging import get_logger

logger = get_logger(__name__)

FILE = "rejoin.json"
LIMIT = 16  # peers kept
MAX_MADDRS = 4  # addresses kept per peer
MAX_AGE_S = 7 * 24 * 3600.0  # a week-old list names addresses that have most likely moved
MAX_FILE_BYTES = 64 * 1024
_RANK = {"public": 0, "private": 1, "loopback": 2, "other": 3, "circuit": 4}  # what a restarted peer dials first


def dial_order(maddrs: list[str]) -> list[str]:
    """Direct addresses before relayed ones, public before private; at most MAX_MADDRS."""
    return sorted(dict.fromkeys(maddrs), key=lambda m: _RANK[classify(m)])[:MAX_MADDRS]


class RejoinList:
    def __init__(self, state_dir: Path, swarm: str, clock: Any = time.time):
        self.path = Path(state_dir) / FILE
        self.swarm = swarm
        self.clock = clock
        self._saved: dict[str, list[str]] | None = None

    def load(self) -> list[str]:
        """`/…/p2p/<peer id>` multiaddrs to join by, best first; [] when there is no usable list."""
        try:
            if self.path.stat().st_size > MAX_FILE_BYTES:
                raise ValueError(f"over {MAX_FILE_BYTES} bytes")
            doc = json.loads(self.path.read_text())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as e:
            logger.warning("ignoring %s: %s", self.path, e)
            return []
        if not isinstance(doc, dict) or doc.get("swarm") != self.swarm:
            logger.info("ignoring %s: it is not a list for swarm %r", self.path, self.swarm)
            return []
        saved_at = doc.get("saved_at")
        if not isinstance(saved_at, (int, float)) or self.clock() - saved_at > MAX_AGE_S:
            logger.info("ignoring %s: saved over %d days ago", self.path, MAX_AGE_S // 86400)
            return []
        out: list[str] = []
        peers = doc.get("peers")
        for entry in peers[:LIMIT] if isinstance(peers, list) else []:
            if isinstance(entry, dict) and isinstance(entry.get("maddrs"), list):
                out += [a for m in entry["maddrs"][:MAX_MADDRS] if (a := _peer_address(m, entry.get("peer_id")))]
        return out

    def update(self, peers: dict[str, list[str]]) -> bool:
        """Keep `peers` (peer id -> card addresses, best first) if they differ from what is saved; True if written.
        An empty dict leaves the last list alone: a daemon that lost its peers keeps the way back to them."""
        kept = {p: dial_order([m for m in maddrs if _peer_address(m, p)]) for p, maddrs in list(peers.items())[:LIMIT]}
        kept = {p: m for p, m in kept.items() if m}
        if not kept or kept == self._saved:
            return False
        doc = {"swarm": self.swarm, "saved_at": round(self.clock(), 3),
               "peers": [{"peer_id": p, "maddrs": m} for p, m in kept.items()]}
        atomic_write(self.path, json.dumps(doc, indent=1).encode())
        self._saved = kept
        return True


def _peer_address(maddr: Any, peer: Any) -> str | None:
    """`maddr/p2p/peer` if it is a peer address `--initial-peers` would take and `maddr` (a card's address)
    names no peer of its own; else None."""
    if not isinstance(maddr, str) or not isinstance(peer, str) or len(maddr) > 300:
        return None
    try:
        if parse_maddr(maddr)[-1][0] == "p2p":
            return None
        return check_peer_maddr(f"{maddr}/p2p/{peer}")
    except MaddrError:
        return None
