"""`echo2swarm doctor`: the checks a peer needs before it joins, each with what to do when it fails.

    identity file usable ─► ports free ─► p2pd starts ─► each --initial-peers address answers
    ─► a public peer dials us back (reachability, chunk server) and tells its clock (skew)
    ─► free disk ─► engine and device

The dial-back is the daemon's own probe (overlay/reachability.py); the doctor listens where the
daemon would (its --host-maddrs, a chunk server on --chunk-port answering /v1/info as this peer),
so "reachable" means what it will mean for the daemon.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from echo2swarm.config.loading import AnyDaemonConfig
from echo2swarm.config.models import LearnerConfig, RolloutConfig
from echo2swarm.wire.records import CARD_CLOCK_SKEW_S

Status = Literal["ok", "warn", "fail", "skip"]
SKEW_WARN_S = 5.0
GiB = 1 << 30


@dataclass
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""


def _bind_error(host: str, port: int) -> str | None:
    """Why `host:port` cannot be listened on (None: it can)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"port {port} is already in use on {host}"
            if e.errno == errno.EACCES:
                return f"no permission to listen on port {port} (ports below 1024 need root)"
            if e.errno == errno.EADDRNOTAVAIL:
                return f"{host} is not an address of this machine"
            return f"cannot listen on {host}:{port}: {e.strerror}"
    return None


def check_ports(config: AnyDaemonConfig) -> list[Check]:
    out = []
    for addr in config.overlay.host_maddrs:
        parts = addr.split("/")
        if len(parts) > 4 and parts[3] == "tcp" and parts[4].isdigit() and int(parts[4]) != 0:
            why = _bind_error(parts[2], int(parts[4]))
            out.append(Check("p2p port", "fail" if why else "ok", why or f"{addr} is free",
                             "stop what holds it (another daemon?) or pick another port in --host-maddrs" if why else ""))
    port = config.chunk_server.port
    if config.chunk_server.enabled and port:
        why = _bind_error(config.chunk_server.host, port)
        out.append(Check("chunk port", "fail" if why else "ok", why or f"{config.chunk_server.host}:{port} is free",
                         "stop what holds it or pick another --chunk-port (0: any free port)" if why else ""))
    return out


def check_p2pd_binary() -> Check:
    from echo2swarm.overlay.node import p2pd_binary

    path = p2pd_binary()
    if not path.is_file():
        return Check("p2pd binary", "fail", f"{path} is missing",
                     "reinstall hivemind (pip install --force-reinstall hivemind)")
    if not os.access(path, os.X_OK):
        return Check("p2pd binary", "fail", f"{path} is not executable", f"chmod +x {path}")
    return Check("p2pd binary", "ok", str(path))


def check_identity(config: AnyDaemonConfig) -> Check:
    """The --identity file, read as the daemon reads it (overlay/node.py): Ed25519 or RSA (hivemind's) both run."""
    from echo2swarm.wire.peer_keys import PeerKey, PeerKeyError

    path = config.overlay.identity
    if path is None:
        return Check("identity", "ok", "no --identity: a fresh Ed25519 peer id at each start")
    if not Path(path).exists():
        return Check("identity", "ok", f"{path} does not exist yet: an Ed25519 key is created there at the first start")
    try:
        key = PeerKey.load(Path(path))
    except PeerKeyError as e:
        return Check("identity", "fail", str(e)[:300],
                     f"point --identity at a libp2p private key (Ed25519, or RSA as hivemind's P2P.generate_identity "
                     f"writes), or move {path} away: the daemon then creates an Ed25519 key there (a new peer id)")
    return Check("identity", "ok", f"{path}: {key.kind} key, peer id {key.peer_id}")


def check_disk(config: AnyDaemonConfig) -> Check:
    state = Path(config.state_dir).expanduser()
    probe = state
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    need = 2 * GiB
    detail = f"{free / GiB:.1f} GiB free at {probe}"
    if isinstance(config, LearnerConfig):
        model = Path(config.publish.model)
        size = sum(p.stat().st_size for p in model.rglob("*") if p.is_file()) if model.is_dir() else 0
        # the versions kept (each dense in the learner's own store, the delta chain since the last keyframe too),
        # checkpoints (weights + optimizer ~3x), the final model
        kept = max(config.versions_kept, config.publish.keyframe_every)
        need = max(need, size * (kept + 3 * config.train.keep_checkpoints + 1))
        detail += f"; the model is {size / GiB:.2f} GiB, a run keeps about {need / GiB:.1f} GiB"
    if free < need:
        return Check("disk", "fail", detail, f"free space or point --state-dir at a larger disk (need ~{need / GiB:.1f} GiB)")
    return Check("disk", "ok", detail)


def check_engine(config: AnyDaemonConfig) -> Check:
    if not isinstance(config, RolloutConfig):
        if isinstance(config, LearnerConfig):
            try:
                from echo2swarm.runtime.devices import resolve_device

                device = resolve_device(config.train.device, setting="train.device (--device)")
                return Check("device", "ok", f"the learner trains on {device}")
            except ValueError as e:
                return Check("device", "fail", str(e), "pass --device cpu, or install a CUDA build of torch")
        return Check("engine", "skip", f"a {config.role} runs no engine")
    from echo2swarm.rollout.engines import check_engine_installed

    kind = config.engine.type
    try:
        check_engine_installed(kind)
    except ValueError as e:
        return Check("engine", "fail", str(e), "install it, or pass --engine transformers")
    if kind == "vllm":
        return Check("engine", "ok", "vllm (it picks its own GPU)")
    try:
        from echo2swarm.runtime.devices import resolve_device

        device = resolve_device(config.engine.device, setting="engine.device (--device)")
    except ValueError as e:
        return Check("engine", "fail", str(e), "pass --device cpu, or install a CUDA build of torch")
    return Check("engine", "ok", f"{kind} on {device}" + (" (slow: CPU)" if device.type == "cpu" else ""))


async def _serve_info(host: str, port: int, peer_id: str) -> tuple[Any, int]:
    """A stand-in chunk server: /v1/info answering as this peer, where the daemon's would listen."""
    from aiohttp import web

    async def info(_: web.Request) -> web.Response:
        return web.json_response({"peer_id": peer_id, "role": "doctor"})

    app = web.Application()
    app.router.add_get("/v1/info", info)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, bound


async def check_network(config: AnyDaemonConfig, timeout: float, clock_offset_s: float = 0.0) -> list[Check]:
    """p2pd, the initial peers, reachability, chunk server, clock skew (needs the network)."""
    from echo2swarm.overlay.node import BootstrapError, Overlay
    from echo2swarm.overlay.reachability import peer_id_of, probe

    out: list[Check] = []
    overlay_config = config.overlay.model_copy(update={"initial_peers": [], "new_swarm": True})
    try:  # p2pd alone first: a failure here is about this machine, not the swarm
        overlay = await Overlay.start(overlay_config)
    except BootstrapError as e:
        text = str(e)
        fix = "check --host-maddrs (a free port, an address of this machine)"
        if "address already in use" in text.lower():
            fix = "a port in --host-maddrs is taken: pick another or stop what holds it"
        elif "permission" in text.lower():
            fix = "ports below 1024 need root: pick a port above 1024"
        out.append(Check("p2pd", "fail", text[:300], fix))
        return out
    runner = None
    try:
        out.append(Check("p2pd", "ok", f"started as {overlay.peer_id}"))
        answered = []
        for addr in config.overlay.initial_peers:
            peer = peer_id_of(addr)
            try:
                assert peer is not None
                await overlay.connect(peer, [addr], timeout)
                answered.append(peer)
                out.append(Check("initial peer", "ok", f"{addr} answers"))
            except Exception as e:
                out.append(Check("initial peer", "fail", f"{addr}: {type(e).__name__}: {str(e)[:160] or 'no answer'}",
                                 "check the address (copy it from the peer's start banner), that the peer runs, "
                                 "and that no firewall between you blocks that TCP port"))
        if not config.overlay.initial_peers:
            out.append(Check("initial peer", "skip", "no --initial-peers given (a new swarm)"))
        if not answered:
            out.append(Check("reachability", "skip", "no initial peer answered: nobody to dial us back"))
            return out
        chunk_port = None
        if config.role != "bootstrap" and config.chunk_server.enabled:
            runner, chunk_port = await _serve_info(config.chunk_server.host, config.chunk_server.port, overlay.peer_id)
        listen = await overlay.listen_maddrs()
        from echo2swarm.overlay.addresses import classify, tcp_port

        ports = [p for p in dict.fromkeys(tcp_port(m) for m in listen if classify(m) != "circuit") if p]
        result = await probe(overlay, answered, ports, chunk_port, clock=lambda: time.time() + clock_offset_s)
        if result.reply is None:
            out.append(Check("reachability", "warn", "no initial peer answered the dial-back probe: "
                             + "; ".join(result.errors)[:200], "peers running an older echo2swarm cannot probe"))
            return out
        reply = result.reply
        if reply.reached:
            out.append(Check("reachability", "ok", f"public: peers reach {reply.observed} on TCP {reply.reached}"))
        else:
            relays = config.overlay.relays or config.overlay.initial_peers
            out.append(Check(
                "reachability", "warn" if config.overlay.use_auto_relay and relays else "fail",
                f"behind NAT or a firewall: seen as {reply.observed}, and no dial to TCP {ports} got through",
                "nothing to do: the daemon takes a relay slot on a public peer and is reached through it "
                "(slower). For direct connections forward a TCP port to this machine and pass "
                "--host-maddrs /ip4/0.0.0.0/tcp/PORT --announce-maddrs /ip4/PUBLIC_IP/tcp/PORT"
                if config.overlay.use_auto_relay else "turn --use-auto-relay back on, or forward a port",
            ))
            # Two NAT'd peers connect directly only by hole punching, which go-libp2p does over QUIC here
            # (docs/operations.md "Behind NAT"): without a QUIC listen address, transfers stay on relays.
            quic = [m for m in config.overlay.host_maddrs if m.endswith("/quic-v1")]
            out.append(Check("hole punching", "ok" if quic else "warn",
                             f"QUIC listen address {quic[0]}: peers behind NAT can connect directly once four "
                             "public peers have seen this machine" if quic else
                             "no QUIC listen address: peers behind NAT reach this machine through relays only",
                             "" if quic else "add /ip4/0.0.0.0/udp/0/quic-v1 to --host-maddrs (and let UDP out)"))
        if chunk_port is not None:
            if reply.chunk_ok:
                out.append(Check("chunk server", "ok", f"peers reach it at http://{reply.observed}:{chunk_port}"))
            else:
                out.append(Check("chunk server", "warn", f"peers cannot reach TCP {chunk_port} at {reply.observed}",
                                 "nothing to do: the daemon leaves its chunk URL out of its card and serves over "
                                 "libp2p; to serve over HTTP forward the port and pass --chunk-url"))
        skew = result.skew_s or 0.0
        status: Status = "fail" if abs(skew) > CARD_CLOCK_SKEW_S else "warn" if abs(skew) > SKEW_WARN_S else "ok"
        out.append(Check("clock", status, f"{skew:+.1f} s against {result.responder[-8:] if result.responder else '?'}",
                         "" if status == "ok" else "sync the clock (timedatectl set-ntp true / chrony): cards dated "
                         f"more than {CARD_CLOCK_SKEW_S:.0f} s ahead are refused and signed heads expire early"))
        return out
    finally:
        if runner is not None:
            with contextlib.suppress(Exception):
                await runner.cleanup()
        await overlay.stop()


async def run_checks(config: AnyDaemonConfig, timeout: float = 10.0, clock_offset_s: float = 0.0) -> list[Check]:
    checks = [check_p2pd_binary(), check_identity(config), *check_ports(config)]
    if all(c.status != "fail" for c in checks):
        checks += await check_network(config, timeout, clock_offset_s)
    checks.append(check_disk(config))
    checks.append(check_engine(config))
    return checks


def as_json(checks: list[Check]) -> list[dict[str, Any]]:
    return [asdict(c) for c in checks]
