"""How others reach this daemon, found out rather than configured: no NAT flags needed.

    every announce period: p2pd identify ─► our listen and /p2p-circuit addresses (a relay slot
                           appears ~15 s after start, once libp2p's AutoNAT found us private)
    every reachability_period_s (and when those change): DialbackRequest to a public peer
        (--initial-peers, --relays, then public cards) ─► it dials our observed IP at our ports
        and GETs our chunk server's /v1/info there
    ─► state  public    a direct address answered: advertise the addresses at the observed IP
              relayed   none answered, a relay slot is held: advertise the /p2p-circuit addresses
              private   none answered and no relay slot yet: advertise nothing (dial out only)
              unknown   no public peer ever answered: advertise what we have, minus loopback
                        (unless everything is loopback: a swarm on one machine); once one has
                        answered, an unanswered probe keeps the last verdict
       chunk URL in the card only if the chunk server answered (or could not be checked).

Hole punching (behind NAT): p2pd runs DCUtR, which upgrades a relayed connection between two NAT'd
peers to a direct one. go-libp2p starts it only once this peer knows a public address of its own,
i.e. four distinct peers reported the same observed address (identify's ActivationThresh), so the
observations must agree: over QUIC one UDP socket sends everything and the NAT keeps one mapping,
which is why daemons listen on QUIC beside TCP. The tracker (a relayed peer) then
    every announce period: p2pd's connections ─► NAT'd peers (by their cards) we hold a direct
                           connection to: the card's `holepunch` lists those transports (seen within
                           reachability_period_s), /v1/info lists the peers
    none yet, at most once a reachability period: open a relayed connection to HOLEPUNCH_TRIES NAT'd
                           peers (through their /p2p-circuit addresses) so that DCUtR runs before a
                           broadcast plan needs the answer

The DHT node's mode is not switched at run time (hivemind fixes it at creation; emptying its
node_info broke stores): a NAT'd peer stays a DHT server that others reach through its relay.

The responder (`DialbackService`, every daemon) dials only the caller's own observed IP, as libp2p's
AutoNAT does, once per caller per `MIN_INTERVAL_S`, `SLOTS` at once: the probe cannot be turned
against third parties or used to make a peer dial in a loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from echo2swarm.config.models import OverlayConfig
from echo2swarm.overlay.addresses import classify, dial_addrs, ip_of, tcp_port, transport
from echo2swarm.overlay.rpc import RpcError, RpcStub, serve
from echo2swarm.runtime.logging import get_logger
from echo2swarm.wire.reach import MAX_PROBE_PORTS, DialbackReply, DialbackRequest, Reachability
from echo2swarm.wire.surfaces import DIALBACK_RPC


class Overlay(Protocol):
    """What the probes use of an overlay (overlay/node.py's Overlay; node.py imports this module,
    so the type is structural here rather than imported)."""

    config: OverlayConfig
    peer_id: str
    p2p: Any

    async def listen_maddrs(self) -> list[str]: ...

    def public_peers(self) -> list[str]: ...

    def nat_peers(self) -> dict[str, str]: ...

    def known_maddrs(self, peer_id: str) -> list[str]: ...

    async def get_cards(self, *args: Any, **kwargs: Any) -> Any: ...


logger = get_logger(__name__)
MIN_INTERVAL_S = 5.0   # per caller
DIAL_TIMEOUT_S = 3.0
SLOTS = 4
MAX_CALLERS = 1024     # rate-limit memory
HOLEPUNCH_TRIES = 2    # NAT'd peers a relayed peer connects to per reachability period until one punch is seen


async def observed_ip(overlay: Overlay, peer_id: str) -> tuple[str | None, bool]:
    """The IP `peer_id` is connected to us from, and whether it came through a relay."""
    relayed = False
    try:
        peers = await overlay.p2p._client.list_peers()
    except Exception:  # p2pd gone or busy: nothing observed
        return None, False
    for info in peers:
        if info.peer_id.to_base58() != peer_id:
            continue
        for addr in map(str, info.addrs):
            if classify(addr) == "circuit":
                relayed = True
            elif ip_of(addr):
                return ip_of(addr), False
    return None, relayed


async def _tcp_answers(ip: str, port: int, timeout: float) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), timeout)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    return True


async def _http_answers_as(ip: str, port: int, peer_id: str, timeout: float) -> bool:
    host = f"[{ip}]" if ":" in ip else ip
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            async with session.get(f"http://{host}:{port}/v1/info") as resp:
                if resp.status != 200:
                    return False
                info = await resp.json(content_type=None)
                return isinstance(info, dict) and info.get("peer_id") == peer_id
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError):
        return False


class DialbackService:
    """Answers `rpc_dialback`: dial the caller back at its observed IP (see the module docstring)."""

    def __init__(self, overlay: Overlay, clock: Callable[[], float] = time.time):
        self.overlay = overlay
        self.clock = clock
        self._last: OrderedDict[str, float] = OrderedDict()
        self._slots = asyncio.Semaphore(SLOTS)
        self.stats = {"answered": 0, "refused": 0}

    async def rpc_dialback(self, request: DialbackRequest, peer: str) -> DialbackReply:
        now = time.monotonic()
        last = self._last.get(peer)
        if (last is not None and now - last < MIN_INTERVAL_S) or self._slots.locked():
            self.stats["refused"] += 1
            return DialbackReply(refused=f"retry after {MIN_INTERVAL_S:g} s", time_ms=int(self.clock() * 1000))
        self._last[peer] = now
        self._last.move_to_end(peer)
        while len(self._last) > MAX_CALLERS:
            self._last.popitem(last=False)
        async with self._slots:
            ip, relayed = await observed_ip(self.overlay, peer)
            reached: list[int] = []
            chunk_ok: bool | None = None
            if ip is not None:
                ports = list(dict.fromkeys(request.ports))[:MAX_PROBE_PORTS]
                answers = await asyncio.gather(*(_tcp_answers(ip, p, DIAL_TIMEOUT_S) for p in ports))
                reached = [p for p, ok in zip(ports, answers) if ok]
                if request.chunk_port is not None:
                    chunk_ok = await _http_answers_as(ip, request.chunk_port, peer, DIAL_TIMEOUT_S)
            self.stats["answered"] += 1
            return DialbackReply(observed=ip, relayed=relayed, reached=reached, chunk_ok=chunk_ok,
                                 time_ms=int(self.clock() * 1000))


async def serve_dialback(overlay: Overlay) -> DialbackService:
    service = DialbackService(overlay)
    await serve(overlay.p2p, overlay.config.swarm, DIALBACK_RPC, service)
    return service


def peer_id_of(maddr: str) -> str | None:
    parts = maddr.split("/p2p/")
    return parts[-1].split("/", 1)[0] if len(parts) > 1 and "/p2p-circuit" not in parts[-1] else None


@dataclass
class ProbeResult:
    """What one dial-back probe found; `skew_s` is the responder's clock minus ours (None: not measured)."""

    responder: str | None = None
    reply: DialbackReply | None = None
    skew_s: float | None = None
    errors: list[str] = field(default_factory=list)


async def probe(overlay: Overlay, targets: list[str], ports: list[int], chunk_port: int | None,
                timeout: float = 3 * DIAL_TIMEOUT_S + 4, clock: Callable[[], float] = time.time) -> ProbeResult:
    """Ask the first of `targets` (peer ids) that answers to dial us back."""
    result = ProbeResult()
    request = DialbackRequest(ports=ports[:MAX_PROBE_PORTS], chunk_port=chunk_port)
    for target in targets:
        if target == overlay.peer_id:
            continue
        try:
            stub = RpcStub(overlay.p2p, overlay.config.swarm, DIALBACK_RPC, target)
            reply = await stub.dialback(request, timeout=timeout)
        except RpcError as e:
            result.errors.append(f"{target[-8:]}: {e}")
            continue
        assert isinstance(reply, DialbackReply)
        if reply.refused:
            result.errors.append(f"{target[-8:]}: refused ({reply.refused})")
            continue
        received = clock()
        # The responder's clock at about the middle of the round trip (the dials happen before it answers,
        # so this bounds, not measures, the skew: good to a few seconds, which is what clocks need here).
        result.responder, result.reply = target, reply
        result.skew_s = reply.time_ms / 1000 - received
        return result
    return result


class ReachabilityTracker:
    """This daemon's reachability and the addresses its card may carry (module docstring)."""

    def __init__(self, overlay: Overlay, config: OverlayConfig, clock: Callable[[], float] = time.time):
        self.overlay = overlay
        self.config = config
        self.clock = clock
        self.state: Reachability = "unknown"
        self.listen: list[str] = []         # p2pd's addresses (identify), circuit ones included
        self.maddrs: list[str] = []         # what the card carries
        self.chunk_ok: bool | None = None
        self.skew_s: float | None = None
        self.responder: str | None = None
        self.observed: str | None = None
        self.last_error: str | None = None
        self._last_probe = float("-inf")
        self._probed_listen: list[str] | None = None
        self._reply_state = "unknown"  # public | unreached | unknown: what the last probe found
        self._reached: set[int] = set()
        self.holepunch: list[str] = []      # the card's field: transports of recent hole-punched connections
        self.direct: dict[str, str] = {}    # NAT'd peer id -> transport of our direct connection to it now
        self._punched: dict[str, float] = {}  # transport -> monotonic time a punched connection was last seen
        self._last_punch_try = float("-inf")

    def targets(self) -> list[str]:
        ids = [peer_id_of(m) for m in [*self.config.initial_peers, *self.config.relays]]
        ids += self.overlay.public_peers()
        return [p for p in dict.fromkeys(ids) if p and p != self.overlay.peer_id]

    async def update(self, chunk_url: str | None, force: bool = False) -> bool:
        """Re-read our addresses, probe when due or changed; True if the card's view changed."""
        before = (self.state, self.maddrs, self.chunk_ok)
        self.listen = await self.overlay.listen_maddrs()
        period = self.config.reachability_period_s
        if self.state == "unknown":  # nobody answered yet (a bootstrap before anyone joined): ask again sooner
            period = min(period, 5 * self.config.announce_period_s)
        due = time.monotonic() - self._last_probe >= period
        if force or due or self.listen != self._probed_listen:
            await self._probe(chunk_url)
        self._decide()
        before += (list(self.holepunch),)
        await self._watch_direct()
        changed = (self.state, self.maddrs, self.chunk_ok, self.holepunch) != before
        if changed:
            logger.info("reachability %s; advertising %s%s%s", self.state, self.maddrs or "no addresses",
                        "" if self.chunk_ok is not False else "; chunk server unreachable, serving over libp2p",
                        f"; hole punching works over {', '.join(self.holepunch)}" if self.holepunch else "")
        return changed

    async def _watch_direct(self) -> None:
        """Note direct connections to NAT'd peers (hole punched); while none, give DCUtR a relayed one to upgrade."""
        if self.state not in ("relayed", "private"):
            self.direct, self.holepunch = {}, []
            return
        nat = self.overlay.nat_peers()
        try:
            peers = await asyncio.wait_for(self.overlay.p2p._client.list_peers(), self.config.dht_timeout_s)
        except Exception as e:  # p2pd busy or gone: keep what we had
            logger.debug("list_peers: %s", e)
            return
        direct: dict[str, str] = {}
        connected: set[str] = set()
        for info in peers:
            peer = info.peer_id.to_base58()
            connected.add(peer)
            if peer in nat:
                for addr in map(str, info.addrs):
                    kind = transport(addr)
                    if kind is not None:
                        direct[peer] = kind
        now = time.monotonic()
        for kind in direct.values():
            self._punched[kind] = now
        horizon = now - self.config.reachability_period_s
        self.direct = direct
        self.holepunch = sorted(kind for kind, seen in self._punched.items() if seen >= horizon)
        if self.holepunch or self.state != "relayed" or now - self._last_punch_try < self.config.reachability_period_s:
            return
        self._last_punch_try = now
        if not nat:  # a role that reads no cards (bootstrap): learn the NAT'd peers here
            with contextlib.suppress(Exception):
                await self.overlay.get_cards(whole=False)
            nat = self.overlay.nat_peers()
        targets = [p for p, state in nat.items() if state == "relayed" and p != self.overlay.peer_id
                   and p not in connected][:HOLEPUNCH_TRIES]
        await asyncio.gather(*(self._connect(p) for p in targets))

    async def _connect(self, peer: str) -> None:
        from hivemind.p2p import PeerID

        circuits = [m for m in self.overlay.known_maddrs(peer) if classify(m) == "circuit"]
        try:
            await asyncio.wait_for(self.overlay.p2p._client.connect(PeerID.from_base58(peer), dial_addrs(circuits)),
                                   self.config.dht_timeout_s)
            logger.debug("relayed connection to %s: DCUtR may upgrade it", peer[-8:])
        except Exception as e:  # a stale card, a full relay: the next period tries others
            logger.debug("could not connect to %s through its relay: %s", peer[-8:], e)

    def assume(self, listen: list[str]) -> None:
        """No probe finished: advertise `listen` as an unknown peer would."""
        self.listen = self.listen or list(listen)
        self._decide()

    async def _probe(self, chunk_url: str | None) -> None:
        self._last_probe = time.monotonic()
        self._probed_listen = list(self.listen)
        ports = [p for p in dict.fromkeys(tcp_port(m) for m in self.listen if classify(m) != "circuit") if p]
        chunk_port = None
        if chunk_url:
            tail = chunk_url.rsplit(":", 1)[-1]
            chunk_port = int(tail) if tail.isdigit() else None
        targets = self.targets()
        if not targets:  # a bootstrap has no initial peers: learn the public peers from the cards
            with contextlib.suppress(Exception):
                await self.overlay.get_cards(whole=False)
            targets = self.targets()
        result = await probe(self.overlay, targets, ports, chunk_port, clock=self.clock)
        self.responder = result.responder
        if result.reply is None:  # nobody answered: keep the last answer (a peer that left says nothing about us)
            self.last_error = "; ".join(result.errors)[:300] or "no public peer to ask"
            return
        reply = result.reply
        self.last_error = None
        self.skew_s = result.skew_s
        self.observed = reply.observed
        self._reached = set(reply.reached)
        self.chunk_ok = reply.chunk_ok
        self._reply_state = "public" if reply.reached else "unreached"

    def _decide(self) -> None:
        circuits = [m for m in self.listen if classify(m) == "circuit"]
        announced = list(self.config.announce_maddrs)
        reply_state = self._reply_state
        if reply_state == "public":
            # QUIC addresses at the same IP go along unprobed (the dial-back checks TCP only); dialers try both.
            direct = [m for m in self.listen if ip_of(m) == self.observed
                      and (tcp_port(m) in self._reached or transport(m) == "quic")]
            self.state = "public"
            self.maddrs = announced or direct
        elif reply_state == "unreached":
            self.state = "relayed" if circuits else "private"
            self.maddrs = announced + circuits
        else:
            self.state = "unknown"
            direct = [m for m in self.listen if classify(m) not in ("circuit", "loopback")]
            if not direct:  # a swarm on one machine
                direct = [m for m in self.listen if classify(m) == "loopback"]
            self.maddrs = announced or direct + circuits
        self.maddrs = list(dict.fromkeys(self.maddrs))[:8]

    def card_chunk_url(self, chunk_url: str | None) -> str | None:
        """The chunk URL to advertise: none that the swarm failed to reach (peers then use libp2p)."""
        return None if self.chunk_ok is False else chunk_url
