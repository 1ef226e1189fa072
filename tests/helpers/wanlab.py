"""A small internet on one machine: public hosts, homes behind NAT routers, kernel-enforced link caps.

    with WanLab() as lab:
        boot = lab.public_host("boot", up_mbit=100, down_mbit=100)
        a, = lab.home("a", up_mbit=50, down_mbit=200)        # one host behind home a's NAT router
        proc = a.popen(["python", "-m", "http.server"])        # runs inside a's network namespace
        a.run(["ping", "-c1", boot.ip])                        # homes reach the internet ...
        # ... the internet does not reach homes, and homes do not reach each other (no port forwarding)

Layout (every name starts with the lab's random prefix, e.g. ``e2s7f3a``; nothing else is touched):

    {p}-net    the "internet": a bridge; every public host and home router hangs off it (11.0.0.0/24: a
               globally routable range, because libp2p treats the benchmarking and documentation
               ranges as unroutable and then neither AutoNAT, circuit relays nor our own address
               filter behave as on the internet; the namespaces have no route out, so nothing real
               is reached)
    {p}-<host> a public host: eth0 11.0.0.N on the bridge
    {p}-r<i>   home i's router: wan0 11.0.0.N on the bridge, lan0 192.168.i.1; MASQUERADE out of
               wan0, stateful firewall (from the internet only replies to connections a home opened)
    {p}-<host> a host in home i: eth0 192.168.i.M, default route via the router

Caps are token-bucket filters (`tc ... tbf`) on the egress of the interface that carries the
traffic: a public host's uplink on its eth0, its downlink on the bridge side of its link; a home's
uplink on the router's wan0, its downlink on the router's lan0 (shared by the home's hosts, as a
real home's line is).

Teardown (`close`, also on a failed test and at interpreter exit): the processes the lab started,
by process group, then exactly the namespaces it created (which takes their interfaces with them).
Needs root, `ip netns`, `tc` and `iptables`; `unavailable()` says why not.
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

PUBLIC_NET = "11.0.0"  # see the module docstring: must count as public to libp2p (go-multiaddr manet)
TBF_BURST = "32kb"
TBF_LATENCY = "50ms"


class LabError(RuntimeError):
    pass


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise LabError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def unavailable() -> str | None:
    """Why this machine cannot build a lab (None when it can)."""
    if os.geteuid() != 0:
        return "the WAN lab needs root (network namespaces, tc, iptables)"
    for tool in ("ip", "tc", "iptables"):
        if shutil.which(tool) is None:
            fix = " (apt-get install iptables; `make system-deps` does it)" if tool == "iptables" else ""
            return f"`{tool}` is not installed{fix}"
    name = f"e2sprobe{secrets.token_hex(3)}"
    probe = _sh("ip", "netns", "add", name, check=False)
    if probe.returncode != 0:
        return f"cannot create network namespaces: {probe.stderr.strip()}"
    _sh("ip", "netns", "del", name, check=False)
    return None


@dataclass
class Host:
    """One machine of the lab: a network namespace with one address."""

    lab: "WanLab"
    name: str
    netns: str
    ip: str
    public: bool
    home: str | None = None

    @property
    def wrap(self) -> list[str]:
        """Prefix that runs a command inside this host (`ip netns exec` execs it: same pid)."""
        return ["ip", "netns", "exec", self.netns]

    def run(self, argv: list[str], timeout: float = 30, check: bool = False) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([*self.wrap, *argv], capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
        if check and proc.returncode != 0:
            raise LabError(f"{self.name}: `{' '.join(argv)}` failed: {proc.stderr.strip()}")
        return proc

    def popen(self, argv: list[str], **kw: Any) -> subprocess.Popen[bytes]:
        """Start a process inside this host, in its own process group; the lab ends it at close."""
        proc = subprocess.Popen([*self.wrap, *argv], start_new_session=True, **kw)
        self.lab.track(proc.pid)
        return proc

    def tx_bytes(self) -> int:
        """Bytes this host has sent on its link (eth0)."""
        return int(self.run(["cat", "/sys/class/net/eth0/statistics/tx_bytes"], check=True).stdout)

    def rx_bytes(self) -> int:
        return int(self.run(["cat", "/sys/class/net/eth0/statistics/rx_bytes"], check=True).stdout)


@dataclass
class Router:
    name: str
    netns: str
    wan_ip: str
    subnet: int
    hosts: list[Host] = field(default_factory=list)


class WanLab:
    """See the module docstring. Use as a context manager, or call `close()` in a finally."""

    def __init__(self, prefix: str | None = None):
        reason = unavailable()
        if reason:
            raise LabError(reason)
        self.prefix = prefix or f"e2s{secrets.token_hex(2)}"
        if len(self.prefix) > 8:
            raise LabError("prefix: at most 8 characters (interface names are limited to 15)")
        self.namespaces: list[str] = []
        self.pids: list[int] = []
        self.hosts: dict[str, Host] = {}
        self.routers: dict[str, Router] = {}
        self._next_public = 10
        self._links = 0
        self._closed = False
        atexit.register(self.close)
        try:
            self.net = self._netns("net")
            _sh("ip", "-n", self.net, "link", "add", "br0", "type", "bridge")
            _sh("ip", "-n", self.net, "link", "set", "br0", "up")
        except Exception:
            self.close()
            raise

    # -- building ---------------------------------------------------------------------------------
    def _netns(self, suffix: str) -> str:
        name = f"{self.prefix}-{suffix}"
        _sh("ip", "netns", "add", name)
        self.namespaces.append(name)
        _sh("ip", "-n", name, "link", "set", "lo", "up")
        return name

    def _to_internet(self, netns: str, ifname: str, ip: str, up_mbit: float | None,
                     down_mbit: float | None) -> None:
        """A veth from `netns` (named `ifname`, address `ip`) to the internet bridge."""
        self._links += 1
        outer = f"{self.prefix}v{self._links}"
        _sh("ip", "-n", netns, "link", "add", ifname, "type", "veth", "peer", "name", outer, "netns", self.net)
        _sh("ip", "-n", self.net, "link", "set", outer, "master", "br0")
        _sh("ip", "-n", self.net, "link", "set", outer, "up")
        _sh("ip", "-n", netns, "addr", "add", f"{ip}/24", "dev", ifname)
        _sh("ip", "-n", netns, "link", "set", ifname, "up")
        if up_mbit:
            self._cap(netns, ifname, up_mbit)
        if down_mbit:
            self._cap(self.net, outer, down_mbit)

    @staticmethod
    def _cap(netns: str, ifname: str, mbit: float) -> None:
        _sh("ip", "netns", "exec", netns, "tc", "qdisc", "replace", "dev", ifname, "root", "tbf",
            "rate", f"{int(mbit * 1000)}kbit", "burst", TBF_BURST, "latency", TBF_LATENCY)

    def _check_name(self, name: str) -> None:
        if name in self.hosts or not name.isalnum() or len(name) > 6:
            raise LabError(f"host name {name!r}: use a new name of 1-6 letters and digits")

    def public_host(self, name: str, up_mbit: float | None = None, down_mbit: float | None = None) -> Host:
        """A host with a public address on the internet bridge."""
        self._check_name(name)
        netns = self._netns(name)
        ip = f"{PUBLIC_NET}.{self._next_public}"
        self._next_public += 1
        self._to_internet(netns, "eth0", ip, up_mbit, down_mbit)
        host = Host(self, name, netns, ip, public=True)
        self.hosts[name] = host
        return host

    def home(self, name: str, up_mbit: float | None = None, down_mbit: float | None = None,
             hosts: int = 1) -> list[Host]:
        """A home: a NAT router (MASQUERADE, stateful firewall, no port forwarding) and `hosts` hosts
        behind it named `name`, `name`2, ...; the home's line is capped at the router."""
        self._check_name(name)
        subnet = len(self.routers) + 1
        router_ns = self._netns(f"r{subnet}")
        wan_ip = f"{PUBLIC_NET}.{self._next_public}"
        self._next_public += 1
        self._to_internet(router_ns, "wan0", wan_ip, up_mbit, None)
        _sh("ip", "-n", router_ns, "link", "add", "lan0", "type", "bridge")
        _sh("ip", "-n", router_ns, "addr", "add", f"192.168.{subnet}.1/24", "dev", "lan0")
        _sh("ip", "-n", router_ns, "link", "set", "lan0", "up")
        if down_mbit:
            self._cap(router_ns, "lan0", down_mbit)
        ipt = ["ip", "netns", "exec", router_ns, "iptables"]
        _sh("ip", "netns", "exec", router_ns, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        _sh(*ipt, "-t", "nat", "-A", "POSTROUTING", "-o", "wan0", "-j", "MASQUERADE")
        _sh(*ipt, "-P", "FORWARD", "DROP")
        _sh(*ipt, "-A", "FORWARD", "-i", "lan0", "-o", "wan0", "-j", "ACCEPT")
        _sh(*ipt, "-A", "FORWARD", "-i", "wan0", "-o", "lan0", "-m", "conntrack", "--ctstate",
            "ESTABLISHED,RELATED", "-j", "ACCEPT")
        _sh(*ipt, "-A", "INPUT", "-i", "wan0", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
        _sh(*ipt, "-A", "INPUT", "-i", "wan0", "-j", "DROP")
        router = Router(name, router_ns, wan_ip, subnet)
        self.routers[name] = router
        for j in range(hosts):
            host_name = name if j == 0 else f"{name}{j + 1}"
            self._check_name(host_name)
            netns = self._netns(host_name)
            self._links += 1
            outer = f"{self.prefix}l{self._links}"
            ip = f"192.168.{subnet}.{j + 2}"
            _sh("ip", "-n", netns, "link", "add", "eth0", "type", "veth", "peer", "name", outer, "netns", router_ns)
            _sh("ip", "-n", router_ns, "link", "set", outer, "master", "lan0")
            _sh("ip", "-n", router_ns, "link", "set", outer, "up")
            _sh("ip", "-n", netns, "addr", "add", f"{ip}/24", "dev", "eth0")
            _sh("ip", "-n", netns, "link", "set", "eth0", "up")
            _sh("ip", "-n", netns, "route", "add", "default", "via", f"192.168.{subnet}.1")
            host = Host(self, host_name, netns, ip, public=False, home=name)
            router.hosts.append(host)
            self.hosts[host_name] = host
        return router.hosts

    def uplink_bytes(self, home_or_host: str) -> int:
        """Bytes sent to the internet by a home (its router's wan0) or a public host (its eth0)."""
        if home_or_host in self.routers:
            netns = self.routers[home_or_host].netns
            out = _sh("ip", "netns", "exec", netns, "cat", "/sys/class/net/wan0/statistics/tx_bytes")
            return int(out.stdout)
        return self.hosts[home_or_host].tx_bytes()

    # -- teardown ---------------------------------------------------------------------------------
    def track(self, pid: int) -> None:
        self.pids.append(pid)

    def close(self) -> None:
        """End the lab's processes (SIGTERM to each group, SIGKILL after 10 s), delete its namespaces."""
        if self._closed:
            return
        self._closed = True
        for pid in self.pids:
            _signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in self.pids):
            time.sleep(0.1)
        for pid in self.pids:
            _signal_group(pid, signal.SIGKILL)
            _reap(pid)
        for name in reversed(self.namespaces):
            _sh("ip", "netns", "del", name, check=False)
        atexit.unregister(self.close)

    def leftovers(self) -> list[str]:
        """Namespaces of this lab still present (empty after a clean close)."""
        present = _sh("ip", "netns", "list", check=False).stdout.split()
        return [n for n in self.namespaces if n in present]

    def __enter__(self) -> "WanLab":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the lab's processes lead their own group (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass


def _alive(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
