"""The daemon's DHT node: hivemind `P2P` + `DHTNode` running inside our own asyncio loop.

    Overlay.start(config) ── identity key ── P2P.create (spawns p2pd) ── DHTNode.create (pings initial peers)
         │ store/get of small records (peer cards, signed heads), validated on every node
         └ stop(): DHT node, then p2pd, bounded by a timeout

Identity: p2pd's libp2p key also signs our peer card, so the overlay must hold it. With
`--identity PATH` that file is used (created as an Ed25519 key if missing; an RSA file, as hivemind's
`P2P.generate_identity` writes, works too). Without it a fresh
Ed25519 key is generated per start, handed to p2pd through a 0600 temporary file in the state
dir that is deleted as soon as p2pd has read it: a fresh peer id per start, as before, and no
key left on disk.

Reading cards is bounded whatever the DHT holds (anyone can make keys and sign cards with them):
`get_cards` returns at most `max_cards`, preferring peers the caller names, then peers seen doing
work here (an RPC call this node answered, authenticated by libp2p), then peers returned by the
previous reads, then the newest `updated_ms`.

We do not use the forked `hivemind.DHT` wrapper: it crashes on values over 64 KiB and orphans its
child on SIGKILL. p2pd is started with PR_SET_PDEATHSIG so it dies with us even on `kill -9`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import heapq
import os
import signal
import socket
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.serializer import MSGPackSerializer

from echo2swarm.config.models import OverlayConfig
from echo2swarm.overlay.dht_keys import head_key, peers_key
from echo2swarm.overlay import rpc
from echo2swarm.overlay.addresses import classify, dial_addrs, ip_of
from echo2swarm.overlay.validation import SwarmRecordValidator
from echo2swarm.runtime.logging import get_logger
from echo2swarm.wire.peer_keys import PeerKey, PeerKeyError
from echo2swarm.wire.records import MAX_RECORD_BYTES, HeadRecord, PeerCard, RecordError, parse_head

logger = get_logger(__name__)


def p2pd_binary() -> Path:
    """The p2pd executable hivemind ships and `P2P.create` spawns (`echo2swarm doctor` checks it)."""
    from importlib.resources import files

    return Path(str(files("hivemind.hivemind_cli") / "p2pd"))


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


def p2pd_flags(config: OverlayConfig, auto_relay: bool) -> list[str]:
    """p2pd flags hivemind's `P2P.create` has no parameter for.

    Relay slots: with automatic relay discovery (p2pd's default) go-libp2p's autorelay waits for 4
    candidate relays or 3 minutes before it reserves a slot, so a peer behind NAT in a small swarm
    had no /p2p-circuit address for minutes; with static relays (`-relayDiscovery=0` and
    `-trustedRelays`) it reserves as soon as AutoNAT finds it private (~15 s after start).
    Relay service: the limits from the config (p2pd starts it once AutoNAT finds this peer public).
    """
    flags = [f"-relayService={int(config.use_relay and config.relay_service)}"]
    if config.use_relay and config.relay_service:
        flags += [
            f"-relayMaxCircuits={config.relay_max_circuits}",
            f"-relayMaxReservations={config.relay_max_reservations}",
            f"-relayDataLimit={config.relay_data_limit}",
            f"-relayTimeLimit={int(config.relay_time_limit_s)}s",
        ]
    if auto_relay:
        flags.append("-relayDiscovery=0")
    return flags


async def _nobody_dials_back(p2p: P2P, config: OverlayConfig, peer_id: str) -> bool:
    """True when an initial peer answered the dial-back probe and reached none of our ports (behind NAT).

    Decided before the DHT node exists, since hivemind fixes its client mode at creation; no answer
    (an older peer, a timeout) keeps the server mode asked for.
    """
    from types import SimpleNamespace

    from echo2swarm.overlay.addresses import classify, tcp_port
    from echo2swarm.overlay.reachability import peer_id_of, probe

    try:
        _, addrs = await asyncio.wait_for(p2p._client.identify(), config.dht_timeout_s)
        ports = [p for p in dict.fromkeys(tcp_port(str(m)) for m in addrs if classify(str(m)) != "circuit") if p]
        targets = [t for t in dict.fromkeys(peer_id_of(m) for m in [*config.initial_peers, *config.relays]) if t]
        shim = SimpleNamespace(p2p=p2p, peer_id=peer_id, config=config)
        result = await asyncio.wait_for(probe(shim, targets[:2], ports, None), 2 * config.dht_timeout_s + 10)  # type: ignore[arg-type]
    except Exception as e:  # the probe is advice: never a reason not to start
        logger.debug("dial-back probe before the DHT node: %s", e)
        return False
    if result.reply is not None and not result.reply.reached:
        logger.info("nobody could dial us back (seen as %s): the DHT node runs in client mode", result.reply.observed)
        return True
    return False


def _p2p_class(flags: list[str]) -> type[P2P]:
    """hivemind's P2P, its p2pd started with `flags` added."""

    def make_args(*args: Any, **kwargs: Any) -> list[str]:
        return P2P._make_process_args(*args, **kwargs) + flags

    return type("SwarmP2P", (P2P,), {"_make_process_args": staticmethod(make_args)})


def _peer_of(maddr: str) -> str:
    return maddr.rsplit("/p2p/", 1)[-1]


def _is_local(ip: str | None) -> bool:
    """Whether `ip` is one of this host's own addresses (binding to it succeeds); None (dns, ...) counts as ours."""
    if ip is None:
        return True
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((ip, 0))
        return True
    except OSError:
        return False


def dht_time() -> float:
    return time.time()


def _identity(config: OverlayConfig, key_dir: Path | None) -> tuple[PeerKey, Path, bool]:
    """Our libp2p key, the file p2pd reads it from, and whether that file is a temporary to delete."""
    if config.identity is not None:
        path = Path(config.identity)
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            key = PeerKey.generate()
            key.save(path)
            logger.info("created identity %s (peer id %s)", path, key.peer_id)
            return key, path, False
        try:
            return PeerKey.load(path), path, False
        except PeerKeyError as e:
            raise BootstrapError(f"--identity {path}: {e}") from None
    key = PeerKey.generate()
    directory = key_dir if key_dir is not None else Path(tempfile.gettempdir())
    directory.mkdir(parents=True, exist_ok=True)
    if key_dir is not None:  # left by a start that was killed while p2pd read it: our state dir, our files
        for stale in key_dir.glob(".identity-*.key"):
            stale.unlink(missing_ok=True)
    fd, name = tempfile.mkstemp(prefix=".identity-", suffix=".key", dir=directory)
    os.close(fd)
    os.unlink(name)  # PeerKey.save creates it exclusively, mode 0600
    key.save(Path(name))
    return key, Path(name), True


class Overlay:
    """A started DHT node of one swarm.

    >>> overlay = await Overlay.start(OverlayConfig(new_swarm=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    >>> await overlay.store_card(card)
    >>> cards, bad = await overlay.get_cards()
    >>> await overlay.stop()
    """

    def __init__(self, config: OverlayConfig, p2p: P2P, node: DHTNode, validator: SwarmRecordValidator, key: PeerKey):
        self.config = config
        self.p2p = p2p
        self.node = node
        self.validator = validator
        self.key = key  # p2pd's libp2p key: signs our card
        self.peer_id = p2p.peer_id.to_base58()
        self.chunk_url: str | None = None
        self.maddrs: list[str] = []
        # peer id -> monotonic time last seen: doing work (an RPC we answered) / returned by get_cards
        self._worked: OrderedDict[str, float] = OrderedDict()
        self._recent: OrderedDict[str, float] = OrderedDict()
        self.cards_dropped = 0  # valid cards left out by the max_cards bound, over all reads
        self._maddrs: OrderedDict[str, tuple[str, ...]] = OrderedDict()  # peer id -> its newest card's maddrs
        self._reach: OrderedDict[str, str | None] = OrderedDict()  # peer id -> its newest card's reachability
        self._flood_logged = float("-inf")
        rpc.observe_callers(p2p, self.saw_work)

    @classmethod
    async def start(
        cls, config: OverlayConfig, *, client_mode: bool | None = None, key_dir: Path | None = None
    ) -> "Overlay":
        """`key_dir`: where the per-start identity file lives while p2pd reads it (the state dir)."""
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
        key, identity_path, temporary = _identity(config, key_dir)

        # One address per relay: go-libp2p's autorelay waits for as many candidates as static relays are
        # listed, and counts peers, so a relay listed twice (its TCP and QUIC addresses) held every slot
        # back for its 3-minute boot delay. Connections use all the addresses p2pd knows anyway.
        relays = list({_peer_of(a): a for a in reversed(config.relays or config.initial_peers)}.values())[::-1]
        auto_relay = config.use_relay and config.use_auto_relay and bool(relays) and not client
        p2p_kwargs: dict[str, Any] = dict(
            initial_peers=config.initial_peers or None,
            host_maddrs=[] if client else config.host_maddrs,
            announce_maddrs=config.announce_maddrs or None,
            identity_path=str(identity_path),
            # hivemind's "is this identity taken" probe (run only for RSA files: it parses no other key) starts
            # a second p2pd through this class, so with our static-relay flags but without the relays: p2pd
            # panicked ("autoRelay requires ... -trustedRelays"). Skipped for every key type alike.
            check_if_identity_free=False,
            dht_mode="client" if client else "server",
            use_relay=config.use_relay,
            use_auto_relay=auto_relay,
            trusted_relays=relays if auto_relay else None,
            auto_nat=True,  # also turns on hole punching (DCUtR) in hivemind's p2pd
            startup_timeout=config.p2p_startup_timeout_s,
            no_listen=client,
        )
        p2p_class = _p2p_class(p2pd_flags(config, auto_relay))
        validator = SwarmRecordValidator(config.swarm)
        p2p: P2P | None = None
        try:
            try:
                with _children_die_with_us():
                    p2p = await asyncio.wait_for(
                        p2p_class.create(**p2p_kwargs), config.p2p_startup_timeout_s + config.bootstrap_timeout_s
                    )
            finally:
                if temporary:
                    identity_path.unlink(missing_ok=True)
            if p2p.peer_id.to_base58() != key.peer_id:
                raise BootstrapError(f"p2pd runs as {p2p.peer_id} but the identity key is {key.peer_id}")
            if not client and config.initial_peers and await _nobody_dials_back(p2p, config, key.peer_id):
                client = True  # others could not reach our DHT node: do not ask them to route to it
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
            # p2pd exited at start: only its "failed to connect to bootstrap peers" is about --initial-peers
            if p2p is None and not isinstance(e, asyncio.TimeoutError) and "bootstrap peers" not in str(e):
                raise BootstrapError(f"p2pd did not start: {type(e).__name__}: {e}") from None
            if config.initial_peers:
                raise BootstrapError(
                    f"could not reach any of --initial-peers within {config.bootstrap_timeout_s:.0f} s "
                    f"({', '.join(config.initial_peers)}): {type(e).__name__}: {e}. Check the addresses, "
                    "that those peers run, and --bootstrap-timeout"
                ) from None
            raise BootstrapError(f"could not start the libp2p node: {type(e).__name__}: {e}") from None
        return cls(config, p2p, node, validator, key)

    def advertise(self, chunk_url: str | None, maddrs: list[str]) -> None:
        """Where others reach us (chunk URL, multiaddrs); the learner's signed heads carry it."""
        self.chunk_url, self.maddrs = chunk_url, list(maddrs)[:8]

    def saw_work(self, peer_id: str) -> None:
        """`peer_id` did work with us (answered RPC): its card is kept first when cards must be dropped."""
        self._touch(self._worked, peer_id)

    def worked(self) -> set[str]:
        """Peers seen doing work here lately (RPCs this node answered; libp2p authenticated them)."""
        return set(self._worked)

    def _touch(self, seen: OrderedDict[str, float], peer_id: str) -> None:
        seen[peer_id] = time.monotonic()
        seen.move_to_end(peer_id)
        horizon = time.monotonic() - 3 * self.config.record_ttl_s
        while seen and (len(seen) > 4 * self.config.max_cards or next(iter(seen.values())) < horizon):
            seen.popitem(last=False)

    async def listen_maddrs(self) -> list[str]:
        """p2pd's current addresses, asked afresh (a relay slot adds a /p2p-circuit one after start)."""
        try:
            _, addrs = await asyncio.wait_for(self.p2p._client.identify(), self.config.dht_timeout_s)
            return [str(m) for m in addrs]
        except Exception as e:  # p2pd busy or gone: keep what we had
            logger.debug("identify: %s", e)
            return await self.visible_maddrs()

    async def connect(self, peer_id: str, maddrs: list[str], timeout: float) -> None:
        """Open a libp2p connection to `peer_id` at `maddrs`; raises when it fails or takes over `timeout` s."""
        await asyncio.wait_for(self.p2p._client.connect(PeerID.from_base58(peer_id), dial_addrs(maddrs)), timeout)

    def known_maddrs(self, peer_id: str) -> list[str]:
        """The multiaddrs of `peer_id`'s newest card we read (a relay address may have appeared since)."""
        return list(self._maddrs.get(peer_id, ()))

    def public_peers(self) -> list[str]:
        """Peers whose newest card we read says they are publicly reachable (dial-back probe targets)."""
        return [p for p, state in self._reach.items() if state == "public"]

    def nat_peers(self) -> dict[str, str]:
        """Peers whose newest card we read says they are behind NAT: peer id -> relayed | private."""
        return {p: state for p, state in self._reach.items() if state in ("relayed", "private")}

    async def visible_maddrs(self) -> list[str]:
        """Our listen addresses: p2pd's, less the NAT mappings peers observed for us (behind NAT, once four
        peers saw the same one, p2pd lists the router's address as its own; nothing here listens there)."""
        try:
            addrs = [str(m) for m in await self.p2p.get_visible_maddrs()]
        except ValueError:  # client mode: no listen addresses
            return []
        announced = set(self.config.announce_maddrs)
        return [m for m in addrs if m in announced or classify(m) == "circuit" or _is_local(ip_of(m))]

    async def _store(self, key: str, subkey: str, value: dict[str, Any], ttl: float) -> bool:
        return bool(await self.node.store(key, value, dht_time() + ttl, subkey=subkey))

    async def store_card(self, card: PeerCard, ttl: float | None = None) -> bool:
        """Sign `card` (ours) with our libp2p key, alive `ttl` seconds, and store it."""
        ttl = ttl or self.config.record_ttl_s
        signed = card.signed(self.key, self.config.swarm, ttl)
        return await self._store(peers_key(self.config.swarm), card.peer_id, signed.model_dump(mode="json"), ttl)

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

    async def get_cards(
        self, prefer: Collection[str] = (), limit: int | None = None
    ) -> tuple[list[PeerCard], int]:
        """Live, signed peer cards of the swarm (at most `limit`, default max_cards), and how many were refused.

        Ranked before anything is parsed, so the cost is bounded whatever the DHT returns: peers
        in `prefer`, then peers seen doing work, then peers returned before, then newest
        `updated_ms` (a date ahead of our clock counts as now).
        """
        limit = self.config.max_cards if limit is None else limit
        entries = await self._get_dict(peers_key(self.config.swarm))
        now_ms = int(time.time() * 1000)
        prefer = set(prefer)

        def rank(entry: tuple[Any, Any, float]) -> tuple[bool, bool, int]:
            subkey, value, _ = entry
            if not isinstance(subkey, str):
                return (False, False, -2)
            updated = value.get("updated_ms") if isinstance(value, dict) else None
            updated = min(updated, now_ms) if type(updated) is int else -1
            return (subkey in prefer or subkey in self._worked, subkey in self._recent, updated)

        # Up to 2x the limit are parsed, so a few bad records at the top cannot crowd out good ones.
        ranked = heapq.nlargest(2 * limit, entries, key=rank) if len(entries) > limit else sorted(entries, key=rank, reverse=True)
        cards: list[PeerCard] = []
        bad = 0
        for subkey, value, expiration in ranked:
            if len(cards) >= limit:
                break
            try:
                if not isinstance(subkey, str):
                    raise RecordError("card under a non-string subkey")
                card = self.validator.card(subkey, value, MSGPackSerializer.dumps(value))
                card.check_times(expiration)
                cards.append(card)
            except RecordError as e:
                bad += 1
                logger.debug("ignoring peer record %s: %s", str(subkey)[:16], e)
        if len(entries) > limit:
            dropped = len(entries) - bad - len(cards)
            self.cards_dropped += dropped
            if time.monotonic() - self._flood_logged >= 60.0:  # once a minute: a flood must not flood the log
                self._flood_logged = time.monotonic()
                logger.warning("%d peer cards in the DHT; kept %d (overlay.max_cards), left out %d",
                               len(entries), len(cards), dropped)
        for card in cards:
            self._touch(self._recent, card.peer_id)
            self._maddrs[card.peer_id] = tuple(card.maddrs)
            self._maddrs.move_to_end(card.peer_id)
            self._reach[card.peer_id] = card.reachability
            self._reach.move_to_end(card.peer_id)
        for memory in (self._maddrs, self._reach):
            while len(memory) > 4 * self.config.max_cards:
                memory.popitem(last=False)
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
