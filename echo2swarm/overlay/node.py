"""The daemon's DHT node: hivemind `P2P` + `DHTNode` running inside our own asyncio loop.

    Overlay.start(config) ── P2P.create (spawns p2pd) ── DHTNode.create (pings initial peers)
         │ store/get of small records (peer cards, signed heads), validated on every node
         └ stop(): DHT node, then p2pd, bounded by a timeout

We do not use the forked `hivemind.DHT` wrapper: it crashes on values over 64 KiB and orphans its
child on SIGKILL. p2pd is started with PR_SET_PDEATHSIG so it dies with us even on `kill -9`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P
from hivemind.utils.multiaddr import Multiaddr

from echo2swarm.config.models import OverlayConfig
from echo2swarm.overlay.dht_keys import head_key, peers_key
from echo2swarm.wire.records import MAX_RECORD_BYTES, HeadRecord, PeerCard, RecordError, parse_card, parse_head
from echo2swarm.overlay.validation import SwarmRecordValidator
from echo2swarm.runtime.logging import get_logger

logger = get_logger(__name__)


class BootstrapError(RuntimeError):
    """Could not join the swarm; the message names the flag to change."""


def _load_prctl() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except OSError:
        return None


_PRCTL = _load_prctl()  # resolved before any fork: the child must not dlopen
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


@contextlib.contextmanager
def _children_die_with_us() -> Iterator[None]:
    """While active, subprocesses hivemind spawns (p2pd) get SIGTERM when this process dies."""
    if _PRCTL is None:
        yield
        return
    original = asyncio.subprocess.create_subprocess_exec

    async def spawn(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("preexec_fn", _die_with_parent)
        return await original(*args, **kwargs)

    asyncio.subprocess.create_subprocess_exec = spawn
    try:
        yield
    finally:
        asyncio.subprocess.create_subprocess_exec = original


def dht_time() -> float:
    return time.time()


class Overlay:
    """A started DHT node of one swarm.

    >>> overlay = await Overlay.start(OverlayConfig(new_swarm=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    >>> await overlay.store_card(card)
    >>> cards, bad = await overlay.get_cards()
    >>> await overlay.stop()
    """

    def __init__(self, config: OverlayConfig, p2p: P2P, node: DHTNode, validator: SwarmRecordValidator):
        self.config = config
        self.p2p = p2p
        self.node = node
        self.validator = validator
        self.peer_id = p2p.peer_id.to_base58()

    @classmethod
    async def start(cls, config: OverlayConfig, *, client_mode: bool | None = None) -> "Overlay":
        client = config.client_mode if client_mode is None else client_mode
        if not config.initial_peers and not config.new_swarm:
            raise BootstrapError(
                "no --initial-peers given: pass the multiaddr a running daemon printed "
                "(/ip4/.../tcp/N/p2p/...), or --new-swarm to start a new swarm"
            )
        for addr in [*config.initial_peers, *config.host_maddrs, *config.announce_maddrs]:
            try:
                Multiaddr(addr)
            except Exception as e:  # hivemind's parser raises several types
                raise BootstrapError(f"malformed multiaddr {addr!r}: {e}") from None
        if config.identity is not None:
            config.identity.parent.mkdir(parents=True, exist_ok=True)

        p2p_kwargs: dict[str, Any] = dict(
            initial_peers=config.initial_peers or None,
            host_maddrs=[] if client else config.host_maddrs,
            announce_maddrs=config.announce_maddrs or None,
            identity_path=str(config.identity) if config.identity else None,
            dht_mode="client" if client else "server",
            use_relay=config.use_relay,
            use_auto_relay=config.use_auto_relay,
            startup_timeout=config.p2p_startup_timeout_s,
            no_listen=client,
        )
        validator = SwarmRecordValidator(config.swarm)
        p2p: P2P | None = None
        try:
            with _children_die_with_us():
                p2p = await asyncio.wait_for(
                    P2P.create(**p2p_kwargs), config.p2p_startup_timeout_s + config.bootstrap_timeout_s
                )
            node = await asyncio.wait_for(
                DHTNode.create(
                    p2p=p2p,
                    initial_peers=config.initial_peers or None,
                    client_mode=client,
                    record_validator=validator,
                    wait_timeout=config.dht_timeout_s,
                    bootstrap_timeout=min(config.bootstrap_timeout_s, config.dht_timeout_s),
                    ensure_bootstrap_success=True,
                    cache_locally=False,  # a peer that reads its own stale card back would never notice expiry
                    num_workers=4,
                ),
                config.bootstrap_timeout_s,
            )
        except Exception as e:  # any failure to start must free p2pd before reporting
            if p2p is not None:
                await _quiet_shutdown(p2p)
            if isinstance(e, BootstrapError):
                raise
            if config.initial_peers:
                raise BootstrapError(
                    f"could not reach any of --initial-peers within {config.bootstrap_timeout_s:.0f} s "
                    f"({', '.join(config.initial_peers)}): {type(e).__name__}: {e}. Check the addresses, "
                    "that those peers run, and --bootstrap-timeout"
                ) from None
            raise BootstrapError(f"could not start the libp2p node: {type(e).__name__}: {e}") from None
        return cls(config, p2p, node, validator)

    async def visible_maddrs(self) -> list[str]:
        try:
            return [str(m) for m in await self.p2p.get_visible_maddrs()]
        except ValueError:  # client mode: no listen addresses
            return []

    async def _store(self, key: str, subkey: str, value: dict[str, Any], ttl: float) -> bool:
        return bool(await self.node.store(key, value, dht_time() + ttl, subkey=subkey))

    async def store_card(self, card: PeerCard, ttl: float | None = None) -> bool:
        return await self._store(
            peers_key(self.config.swarm), card.peer_id, card.model_dump(mode="json"), ttl or self.config.record_ttl_s
        )

    async def store_head(self, head: HeadRecord) -> bool:
        """Stored until the head's own signed expiry, which every node enforces."""
        return bool(await self.node.store(
            head_key(self.config.swarm), head.model_dump(mode="json"), head.expires_ms / 1000, subkey=head.public_key
        ))

    async def _get_dict(self, key: str) -> list[tuple[str, Any, float]]:
        found = await self.node.get(key, latest=True)
        if found is None or not hasattr(found.value, "items"):
            return []
        now = dht_time()
        out = []
        for subkey, item in found.value.items():
            value, expiration = item.value, item.expiration_time
            if expiration > now:
                out.append((subkey, value, expiration))
        return out

    async def get_cards(self) -> tuple[list[PeerCard], int]:
        """Live peer cards of the swarm, and how many records were refused as malformed."""
        cards, bad = [], 0
        for subkey, value, _ in await self._get_dict(peers_key(self.config.swarm)):
            try:
                card = parse_card(value)
                if card.peer_id != subkey:
                    raise RecordError("card stored under another peer's subkey")
                cards.append(card)
            except RecordError as e:
                bad += 1
                logger.debug("ignoring peer record %s: %s", str(subkey)[:16], e)
        return cards, bad

    async def get_heads(self) -> tuple[list[HeadRecord], int]:
        heads, bad = [], 0
        for subkey, value, _ in await self._get_dict(head_key(self.config.swarm)):
            try:
                head = parse_head(value)
                if head.public_key != subkey:
                    raise RecordError("head stored under another signer's subkey")
                heads.append(head)
            except RecordError as e:
                bad += 1
                logger.debug("ignoring head record: %s", e)
        return heads, bad

    async def stop(self, timeout: float = 3.0) -> None:
        try:
            await asyncio.wait_for(self.node.shutdown(), timeout)
        except (asyncio.TimeoutError, Exception) as e:
            logger.warning("DHT node shutdown: %s", e)
        await _quiet_shutdown(self.p2p)


async def _quiet_shutdown(p2p: P2P, timeout: float = 3.0) -> None:
    try:
        await asyncio.wait_for(p2p.shutdown(), timeout)
    except (asyncio.TimeoutError, Exception) as e:
        logger.warning("p2pd did not stop cleanly (%s); killing it", e)
        child = getattr(p2p, "_child", None)
        if child is not None and child.returncode is None:
            child.kill()


__all__ = ["BootstrapError", "MAX_RECORD_BYTES", "Overlay"]
