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

Cards: each announcement stores our card twice, in its card shard (overlay/dht_keys.py: how many
shards the learner's head says) and under a key of its own, so a reader can fetch it by name
however many cards a shard holds. Reading is bounded whatever the DHT holds (anyone can make keys
and sign cards with them): `get_cards` (overlay/cards.py) returns at most `max_cards` a shard, the
peers the caller names, the peers seen doing work here and those on the rosters of the named peers
first (overlay/roster.py), by their own keys.
What the node keeps for others is bounded per key (overlay/storage.py).

We do not use the forked `hivemind.DHT` wrapper: it crashes on values over 64 KiB and orphans its
child on SIGKILL. p2pd is started with PR_SET_PDEATHSIG so it dies with us even on `kill -9`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.serializer import MSGPackSerializer

from echo2swarm.config.models import OverlayConfig
from echo2swarm.overlay import rpc
from echo2swarm.overlay.addresses import classify, dial_addrs, ip_of
from echo2swarm.overlay.cards import CardReader
from echo2swarm.overlay.dht_keys import all_shard_keys, card_key, head_key, roster_key, shard_key, shard_of
from echo2swarm.overlay.rejoin import RejoinList
from echo2swarm.overlay.roster import ASKED, WorkLog, signed_roster
from echo2swarm.overlay.storage import BoundedStorage
from echo2swarm.overlay.traffic import DhtTraffic
from echo2swarm.overlay.validation import SwarmRecordValidator
from echo2swarm.runtime.logging import get_logger
from echo2swarm.wire.peer_keys import PeerKey, PeerKeyError
from echo2swarm.wire.records import MAX_RECORD_BYTES, HeadRecord, PeerCard, RecordError, RosterRecord, parse_head

logger = get_logger(__name__)


def p2pd_binary() -> Path:
    """The p2pd executable hivemind ships and `P2P.create` spawns (`echo2swarm doctor` checks it)."""
    from importlib.resources import files

    return Path(str(files("hivemind.hivemind_cli") / "p2pd"))


class BootstrapError(RuntimeError):
    """Could not join the swarm; the message names the flag to change."""


class UnreachableError(BootstrapError):
    """p2pd started, but none of the peers it was told to join by answered."""


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

    def __init__(self, config: OverlayConfig, p2p: P2P, node: DHTNode, validator: SwarmRecordValidator, key: PeerKey,
                 traffic: DhtTraffic | None = None):
        self.config = config
        self.traffic = traffic or DhtTraffic()  # the DHT's requests and bytes, sent and served (overlay/traffic.py)
        self.p2p = p2p
        self.node = node
        self.validator = validator
        self.key = key  # p2pd's libp2p key: signs our card
        self.peer_id = p2p.peer_id.to_base58()
        self.chunk_url: str | None = None
        self.maddrs: list[str] = []
        # Peers seen doing work here (evidence only), and apart, peers that only asked for work (an RPC we answered)
        self.work = WorkLog(4 * config.max_cards, 3 * config.record_ttl_s)
        self.cards = CardReader(config, node, validator, self.work, self.peer_id)
        self._last_whole: tuple[float, list[PeerCard], int] | None = None  # (monotonic end, cards, refused)
        rpc.observe_callers(p2p, lambda peer: self.work.saw(peer, ASKED))

    @classmethod
    async def start(
        cls, config: OverlayConfig, *, client_mode: bool | None = None, key_dir: Path | None = None,
        rejoin: RejoinList | None = None,
    ) -> "Overlay":
        """`key_dir`: where the per-start identity file lives while p2pd reads it (the state dir).
        `rejoin`: the peers to join by when none of `initial_peers` answers, read only then (overlay/rejoin.py)."""
        try:
            return await cls._start(config, client_mode, key_dir)
        except UnreachableError as e:
            addrs = [m for m in dict.fromkeys(rejoin.load() if rejoin else []) if m not in config.initial_peers]
            if not addrs:
                raise
            logger.warning("%s; rejoining through %d address(es) of peers this daemon saw working (rejoin.json)",
                           e, len(addrs))
            try:
                return await cls._start(config.model_copy(update={"initial_peers": addrs}), client_mode, key_dir)
            except UnreachableError:
                raise e from None  # the flag to change is --initial-peers: say so, not the remembered list

    @classmethod
    async def _start(cls, config: OverlayConfig, client_mode: bool | None, key_dir: Path | None) -> "Overlay":
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
        traffic = DhtTraffic()
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
            traffic.instrument(p2p)  # before the DHT registers its handlers
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
            # What we keep for others, bounded per dictionary (overlay/storage.py); hivemind has no parameter for it.
            shared = {DHTID.generate(source=k) for k in [*all_shard_keys(config.swarm), head_key(config.swarm)]}
            node.protocol.storage = BoundedStorage.replacing(node.protocol.storage, shared)
            node.protocol.cache = BoundedStorage.replacing(node.protocol.cache, shared)
        except Exception as e:  # any failure to start must free p2pd before reporting
            if p2p is not None:
                await _quiet_shutdown(p2p)
            if isinstance(e, BootstrapError):
                raise
            # p2pd exited at start: only its "failed to connect to bootstrap peers" is about --initial-peers
            if p2p is None and not isinstance(e, asyncio.TimeoutError) and "bootstrap peers" not in str(e):
                raise BootstrapError(f"p2pd did not start: {type(e).__name__}: {e}") from None
            if config.initial_peers:
                waited = f" within {config.bootstrap_timeout_s:.0f} s" if isinstance(e, asyncio.TimeoutError) else ""
                raise UnreachableError(
                    f"could not reach any of --initial-peers{waited} ({', '.join(config.initial_peers)}): "
                    f"{type(e).__name__}: {e}. Check the addresses, that those peers run, and --bootstrap-timeout"
                ) from None
            raise BootstrapError(f"could not start the libp2p node: {type(e).__name__}: {e}") from None
        return cls(config, p2p, node, validator, key, traffic)

    def advertise(self, chunk_url: str | None, maddrs: list[str]) -> None:
        """Where others reach us (chunk URL, multiaddrs); the learner's signed heads carry it."""
        self.chunk_url, self.maddrs = chunk_url, list(maddrs)[:8]

    def saw_work(self, peer_id: str, kind: str) -> None:
        """`peer_id` did work this node can vouch for (`kind`: "delivered" groups, "served" verified chunks):
        its card is read first, by its own key, and our roster (if we publish one) lists it."""
        self.work.saw(peer_id, kind)

    def worked(self) -> set[str]:
        """Peers seen doing work here lately (never for asking: anyone can ask)."""
        return set(self.work.worked())

    @property
    def cards_dropped(self) -> int:
        """Valid cards left out by the max_cards bound, over all reads."""
        return self.cards.cards_dropped

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

    def rejoin_candidates(self) -> dict[str, list[str]]:
        """Peers to rejoin the swarm by, should the initial peers go (overlay/rejoin.py): those seen doing work
        here, then the trusted publishers whose rosters we read and the peers on them; with their cards'
        addresses (peers whose card we have not read have none and are left out)."""
        rosters = self.cards.rosters
        named = dict.fromkeys([*self.work.worked(), *rosters, *(e.peer_id for r in rosters.values() for e in r.peers)])
        return {p: list(self.cards.maddrs[p]) for p in named if p != self.peer_id and self.cards.maddrs.get(p)}

    def known_maddrs(self, peer_id: str) -> list[str]:
        """The multiaddrs of `peer_id`'s newest card we read (a relay address may have appeared since)."""
        return list(self.cards.maddrs.get(peer_id, ()))

    def public_peers(self) -> list[str]:
        """Peers whose newest card we read says they are publicly reachable (dial-back probe targets)."""
        return [p for p, state in self.cards.reach.items() if state == "public"]

    def nat_peers(self) -> dict[str, str]:
        """Peers whose newest card we read says they are behind NAT: peer id -> relayed | private."""
        return {p: state for p, state in self.cards.reach.items() if state in ("relayed", "private")}

    async def visible_maddrs(self) -> list[str]:
        """Our listen addresses: p2pd's, less the NAT mappings peers observed for us (behind NAT, once four
        peers saw the same one, p2pd lists the router's address as its own; nothing here listens there)."""
        try:
            addrs = [str(m) for m in await self.p2p.get_visible_maddrs()]
        except ValueError:  # client mode: no listen addresses
            return []
        announced = set(self.config.announce_maddrs)
        return [m for m in addrs if m in announced or classify(m) == "circuit" or _is_local(ip_of(m))]

    async def store_card(self, card: PeerCard, ttl: float | None = None) -> bool:
        """Sign `card` (ours) with our libp2p key, alive `ttl` seconds, and store it under a key of its own and
        in its card shard (at each depth in use: overlay/dht_keys.py); True if any DHT node took it."""
        ttl = ttl or self.config.record_ttl_s
        value = card.signed(self.key, self.config.swarm, ttl).model_dump(mode="json")
        expires, swarm = dht_time() + ttl, self.config.swarm
        own = bool(await self.node.store(card_key(swarm, card.peer_id), value, expires, subkey=card.peer_id))
        shards = await asyncio.gather(*(self._store_nearby(shard_key(swarm, bits, shard_of(card.peer_id, bits)),
                                                           card.peer_id, value, expires)
                                        for bits in self.cards.depth.depths()))
        return any(shards) or own

    def shards_from(self, heads: Collection[HeadRecord]) -> None:
        """Take the card shard depth of the newest correctly signed head: for tools that pin no learner key
        (`peers`, `plan`); a follower takes it from the head it trusts."""
        signed = [h for h in heads if h.swarm == self.config.swarm and h.signature_ok()]
        if signed:
            self.set_card_shards(max(signed, key=lambda h: h.version).card_shard_bits)

    def set_card_shards(self, bits: int) -> None:
        """The swarm's card shard depth, from the newest trusted head (or the learner's own choice)."""
        if self.cards.depth.set(bits):
            logger.info("card shards: depth %d (%d shards)", bits, 1 << bits)

    async def _store_nearby(self, key: str, subkey: str, value: dict[str, Any], expires: float) -> bool:
        """Store at the nodes nearest `key` that our routing table knows (and here, if we are one), without
        the lookup `DHTNode.store` makes first: a lookup reads the key's value, up to megabytes for a
        card shard under a flood, at every announcement of every peer."""
        node = self.node
        key_id = DHTID.generate(source=key)
        data = MSGPackSerializer.dumps(value)
        known = dict(node.protocol.routing_table.get_nearest_neighbors(key_id, node.num_replicas, exclude=node.node_id))
        targets = sorted([*known, node.node_id], key=key_id.xor_distance)[: node.num_replicas]
        here = node.node_id in targets and node.protocol.storage.store(key_id, data, expires, subkey=subkey)
        replies = await asyncio.gather(*(node.protocol.call_store(known[n], [key_id], [data], expires, subkeys=[subkey])
                                         for n in targets if n != node.node_id))
        return bool(here) or any(reply and reply[0] for reply in replies)

    async def store_roster(self, exclude: Collection[str] = (), ttl: float | None = None) -> RosterRecord:
        """Sign the peers seen doing work here (less `exclude`) as our roster, alive `ttl` seconds, and store it."""
        ttl = ttl or self.config.record_ttl_s
        roster = signed_roster(self.key, self.config.swarm, self.work.entries(exclude), ttl)
        if not await self.node.store(roster_key(self.config.swarm, self.peer_id), roster.model_dump(mode="json"),
                                     dht_time() + ttl, subkey=self.peer_id):
            logger.debug("no DHT node took our roster of %d peers", len(roster.peers))
        return roster

    async def store_head(self, head: HeadRecord) -> bool:
        """Stored until the head's own signed expiry, which every node enforces."""
        return bool(await self.node.store(
            head_key(self.config.swarm), head.model_dump(mode="json"), head.expires_ms / 1000, subkey=head.public_key
        ))

    async def get_cards(
        self, prefer: Collection[str] = (), limit: int | None = None, whole: bool = True, max_age_s: float = 0.0,
    ) -> tuple[list[PeerCard], int]:
        """Live, signed peer cards of the swarm, and how many were refused. `whole`: from every card shard
        (the learner, `peers`), else from a sample of them (our own shard and one other: a follower looking
        for holders); at most `limit` a shard (default max_cards) besides the peers read by name.
        `max_age_s`: a whole read of the default kind (no `prefer`, no `limit`) that ended this recently
        is answered again, not read anew (the learner's re-plans and departed-lease checks share the
        broadcast tracker's reads: in a swarm of thousands each is a read of every shard).

        Peers in `prefer` (and on their rosters), then peers seen doing work here, come first, read by
        their own keys when no shard returned them (overlay/cards.py).
        """
        plain = whole and not prefer and limit is None
        if plain and max_age_s > 0 and self._last_whole is not None \
                and time.monotonic() - self._last_whole[0] <= max_age_s:
            return list(self._last_whole[1]), self._last_whole[2]
        cards, bad = await self.cards.read(prefer, self.config.max_cards if limit is None else limit, whole)
        if plain:
            self._last_whole = (time.monotonic(), cards, bad)
        return cards, bad

    async def get_card_page(self, page: int, prefer: Collection[str] = ()) -> tuple[list[PeerCard], int]:
        """The cards of one page of card shards (0-based; `cards.pages()` of them), with the peers in `prefer`
        and the other peers named first on every page."""
        return await self.cards.read(prefer, self.config.max_cards, page=page)

    async def get_named_cards(self, peers: Collection[str]) -> tuple[list[PeerCard], int]:
        """The live, signed cards of exactly these peers, by their own keys (no read of every card)."""
        return await self.cards.read_named(peers)

    async def get_heads(self) -> tuple[list[HeadRecord], int]:
        heads, bad = [], 0
        for subkey, value, _ in await self.cards.get_dict(head_key(self.config.swarm)):
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
