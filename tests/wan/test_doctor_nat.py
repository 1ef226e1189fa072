"""`echo2swarm doctor` on a host behind NAT (and on a public host), in the WAN lab."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from echo2swarm.runtime.launcher import Launcher
from tests.helpers.wanlab import WanLab
from tests.helpers.wanswarm import WanSwarm


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_doctor_says_behind_nat_and_that_nothing_needs_doing(lab: WanLab, launcher: Launcher | None, tmp_path: Path) -> None:
    swarm = WanSwarm(lab, tmp_path / "swarm", "wan", launcher)
    try:
        swarm.bootstrap(lab.public_host("boot"))
        home, = lab.home("a")
        public = lab.public_host("pub")
        args = ["doctor", "--swarm", "wan", "--initial-peers", swarm.initial_peers[0], "--timeout", "5"]
        text = swarm.cli(home, *args, "--state-dir", str(tmp_path / "home"))
        print(text.stdout)
        out = swarm.cli(home, *args, "--state-dir", str(tmp_path / "home"), "--json")
        checks = {c["name"]: c for c in json.loads(out.stdout)}
        assert out.returncode == 0, out.stdout + out.stderr  # behind NAT is a warning: the daemon copes
        reach = checks["reachability"]
        assert reach["status"] == "warn" and "behind NAT" in reach["detail"], reach
        assert "nothing to do" in reach["fix"] and "relay" in reach["fix"]
        assert lab.routers["a"].wan_ip in reach["detail"], "the doctor names the address the swarm sees"
        assert checks["chunk server"]["status"] == "warn" and "libp2p" in checks["chunk server"]["fix"]
        assert checks["hole punching"]["status"] == "ok" and "quic-v1" in checks["hole punching"]["detail"]
        assert checks["initial peer"]["status"] == "ok" and checks["clock"]["status"] == "ok"

        out = swarm.cli(public, *args, "--state-dir", str(tmp_path / "pub"), "--json")
        checks = {c["name"]: c for c in json.loads(out.stdout)}
        assert checks["reachability"]["status"] == "ok" and public.ip in checks["reachability"]["detail"]
        assert checks["chunk server"]["status"] == "ok"
    finally:
        swarm.close()
