"""`echo2swarm doctor` against a real bootstrap on 127.0.0.1: what it finds and how it explains it."""

from __future__ import annotations

import json
import socket

import pytest

from helpers.swarm import LocalSwarm, run_cli

pytestmark = pytest.mark.swarm


def _doctor(*args: str) -> tuple[int, dict[str, list[dict[str, str]]]]:
    result = run_cli("doctor", "--json", "--timeout", "5", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", *args, timeout=120)
    assert result.stdout.strip().startswith("["), result.stderr[-2000:]
    checks: dict[str, list[dict[str, str]]] = {}
    for check in json.loads(result.stdout):
        checks.setdefault(check["name"], []).append(check)
    return result.returncode, checks


@pytest.mark.timeout(300)
def test_doctor_diagnoses_reachability_skew_dead_peers_and_taken_ports(local_swarm: LocalSwarm, tmp_path) -> None:
    local_swarm.bootstrap()
    addr = local_swarm.bootstrap_addr
    assert addr is not None
    common = ["--swarm", local_swarm.swarm, "--state-dir", str(tmp_path / "state")]

    code, checks = _doctor("--initial-peers", addr, *common)
    assert code == 0, checks
    assert [c["status"] for c in checks["p2pd"]] == ["ok"]
    assert [c["status"] for c in checks["initial peer"]] == ["ok"]
    assert checks["reachability"][0]["status"] == "ok" and "public" in checks["reachability"][0]["detail"]
    assert checks["chunk server"][0]["status"] == "ok"
    assert checks["clock"][0]["status"] == "ok"

    # A clock two minutes ahead (simulated): past the 30 s at which cards are refused.
    code, checks = _doctor("--initial-peers", addr, "--clock-offset", "120", *common)
    assert code == 1
    clock = checks["clock"][0]
    assert clock["status"] == "fail" and clock["detail"].startswith("-12"), clock
    assert "sync the clock" in clock["fix"]

    # An initial peer that does not answer: its port is closed.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    dead = "/ip4/127.0.0.1/tcp/%d/p2p/%s" % (closed, addr.rsplit("/p2p/", 1)[1])
    code, checks = _doctor("--initial-peers", dead, *common)
    assert code == 1
    peer = checks["initial peer"][0]
    assert peer["status"] == "fail" and dead in peer["detail"] and "that the peer runs" in peer["fix"]
    assert checks["reachability"][0]["status"] == "skip"

    # The p2p port is taken by another process.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        code, checks = _doctor("--initial-peers", addr, *common[:2], "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}")
    assert code == 1
    ports = checks["p2p port"]
    assert any(c["status"] == "fail" and f"port {port} is already in use" in c["detail"] for c in ports), ports
    assert "p2pd" not in checks, "the network checks wait until the ports are free"
