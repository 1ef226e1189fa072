"""Real daemons inside the WAN lab: each started through the CLI in its host's network namespace (forked
from the suite's launcher into it, or under `ip netns exec`).

    with WanLab() as lab:
        swarm = WanSwarm(lab, tmp_path / "swarm", "wan")
        boot = swarm.bootstrap(lab.public_host("boot"))
        swarm.rollout(lab.home("a")[0], "--trust", str(pub))     # no NAT flags: the daemon finds out
        swarm.info(daemon)                                        # its /v1/info, fetched from inside the lab

Announce period and TTL are short, as on 127.0.0.1, so the swarm reacts within seconds. Daemons are
ended by pid (SIGTERM, then SIGKILL); the lab then deletes the namespaces, their p2pd children die
with them (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from echo2swarm.runtime.launcher import Launcher
from echo2swarm.runtime.processes import DaemonProcess, terminate_all
from tests.helpers.wanlab import Host, WanLab


# TCP and QUIC, as a daemon listens by default: QUIC is what lets two homes hole-punch (overlay/reachability.py).
LAB_HOST_MADDRS = "/ip4/0.0.0.0/tcp/0,/ip4/0.0.0.0/udp/0/quic-v1"


def lab_args(swarm: str, log_level: str = "DEBUG") -> list[str]:
    return ["--swarm", swarm, "--host-maddrs", LAB_HOST_MADDRS, "--chunk-host", "0.0.0.0",
            "--announce-period", "1", "--record-ttl", "4", "--log-level", log_level]


class WanSwarm:
    def __init__(self, lab: WanLab, root: Path, swarm: str, launcher: Launcher | None = None):
        """`launcher`: fork the daemons from it, each into its host's namespace (else `ip netns exec`)."""
        self.lab, self.root, self.swarm, self.launcher = lab, root, swarm, launcher
        self.daemons: list[DaemonProcess] = []
        self.hosts: dict[str, Host] = {}
        self.initial_peers: list[str] = []

    def start(self, host: Host, name: str, *args: str, join: bool = True) -> DaemonProcess:
        extra = ["--initial-peers", ",".join(self.initial_peers)] if join and self.initial_peers else []
        d = DaemonProcess(name, [*lab_args(self.swarm), *extra, *args], self.root / name, launcher=self.launcher,
                          netns=host.netns)
        self.daemons.append(d.start())
        self.hosts[name] = host
        return d

    def public_addr(self, d: DaemonProcess) -> str:
        """The daemon's (first) address on the lab's internet, with its peer id."""
        return self.public_addrs(d)[0]

    def public_addrs(self, d: DaemonProcess) -> list[str]:
        """All the daemon's addresses on the lab's internet (TCP and QUIC), with its peer id.

        Pass them all as initial peers: libp2p then dials QUIC first, so every public peer a home
        joins through observes the same UDP mapping, and four such observers start hole punching."""
        host = self.hosts[d.name]
        addrs = [m for m in d.info["maddrs"] if f"/ip4/{host.ip}/" in m]
        return [m if "/p2p/" in m else f"{m}/p2p/{d.info['peer_id']}" for m in addrs]

    def bootstrap(self, host: Host) -> DaemonProcess:
        d = self.start(host, "bootstrap", "--role", "bootstrap", "--new-swarm", join=False)
        d.wait_ready(60)
        self.initial_peers = self.public_addrs(d)
        return d

    def info(self, d: DaemonProcess, timeout: float = 10) -> dict[str, Any]:
        """GET /v1/info of `d` from inside its own host (homes are unreachable from outside)."""
        url = d.info["http_url"] + "/v1/info"
        code = f"import json,urllib.request;print(urllib.request.urlopen({url!r},timeout={timeout}).read().decode())"
        out = self.hosts[d.name].run([sys.executable, "-c", code], timeout=timeout + 10)
        if out.returncode != 0:
            raise RuntimeError(f"{d.name} /v1/info: {out.stderr.strip()[-300:]}")
        return json.loads(out.stdout)

    def cli(self, host: Host, *args: str, timeout: float = 90) -> Any:
        return host.run(["env", "COLUMNS=150", sys.executable, "-m", "echo2swarm.cli.main", *args], timeout=timeout)

    def close(self) -> None:
        terminate_all(list(reversed(self.daemons)), grace=10)
