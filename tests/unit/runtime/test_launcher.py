"""The fork server (runtime/launcher.py): a forked `echo2swarm` behaves as a spawned one would: its
arguments, environment, output, exit code and signals; its random state is its own; requests that
are not requests are refused and the server keeps serving."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy
import pytest

from echo2swarm.cli import fork_server
from echo2swarm.runtime.launcher import Launcher, launch
from echo2swarm.runtime.processes import child_pids, pid_alive, wait_until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    started = Launcher(tmp_path_factory.mktemp("launcher"), preload=("echo2swarm.cli.main",)).start()
    started.ready()
    try:
        yield started
    finally:
        started.close()


def test_a_forked_command_gets_its_arguments_environment_and_exit_code(launcher: Launcher, tmp_path: Path) -> None:
    log = tmp_path / "out.log"
    env = {"ECHO2SWARM_PRICE": "0.7", "PATH": "/usr/bin:/bin"}
    proc = launcher.launch_cli(["daemon", "--role", "rollout", "--new-swarm", "--print-config"], env, log)
    assert proc.wait(60) == 0, log.read_text()
    config = json.loads(log.read_text())
    assert config["role"] == "rollout" and config["price"] == 0.7  # read from the child's own environment

    bad = launcher.launch_cli(["daemon", "--role", "nonsense"], env, log)
    assert bad.wait(60) == 2  # click's usage error, as a spawned `echo2swarm` exits
    assert "nonsense" in log.read_text()


def test_signals_reach_the_child_and_its_death_is_reported_as_popen_reports_it(launcher: Launcher, tmp_path: Path) -> None:
    # A bootstrap with no network to join runs until told to stop.
    log = tmp_path / "boot.log"
    proc = launcher.launch_cli(["daemon", "--role", "bootstrap", "--new-swarm", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                                "--state-dir", str(tmp_path / "state")], {"PATH": "/usr/bin:/bin"}, log)
    children: list[int] = []
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.2)
        assert proc.poll() is None
        wait_until(lambda: (tmp_path / "state" / "daemon.json").exists(), 60, what="the bootstrap to be up")
        children = child_pids(proc.pid)  # its p2pd, which a SIGKILLed daemon cannot stop
        # As a new interpreter starts: SIGPIPE ignored (a peer that hangs up must not kill the daemon).
        assert _signal_mask(proc.pid, "SigIgn") & (1 << (signal.SIGPIPE - 1))
        proc.kill()
        assert proc.wait(30) == -signal.SIGKILL
        proc.kill()  # a reaped child is not signalled again
    finally:
        proc.kill()
        for pid in children:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def _signal_mask(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1], 16)
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def test_each_forked_child_draws_its_own_random_numbers() -> None:
    numpy.random.seed(1234)  # the state every child inherits
    draws = []
    for _ in range(2):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            fork_server.reseed()
            os.write(write, str(numpy.random.randint(2**62)).encode())
            os._exit(0)
        os.close(write)
        os.waitpid(pid, 0)
        draws.append(os.read(read, 64))
        os.close(read)
    assert draws[0] != draws[1]


def test_garbage_requests_are_refused_and_the_server_goes_on(launcher: Launcher, tmp_path: Path) -> None:
    nested = b"[" * 100_000  # deeper than the parser's recursion limit
    for garbage in (b"\x00\x00\x00\x05hello", b"\xff\xff\xff\xff", b"\x00\x00\x00\x02{}",
                    len(nested).to_bytes(4, "big") + nested):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(10)
            conn.connect(str(launcher.sock_path))
            conn.sendall(garbage)
            conn.shutdown(socket.SHUT_WR)
            reply = json.loads(conn.recv(65536))
        assert "error" in reply and "pid" not in reply
    with pytest.raises(RuntimeError, match="could not start"):
        launch(launcher.sock_path, "shell", ["-c", "true"], {}, [1, 2])  # only echo2swarm's own entry points
    with pytest.raises(RuntimeError, match="netns"):
        launch(launcher.sock_path, "cli", ["--help"], {}, [1, 2], netns="../../proc/1/ns/net")
    with pytest.raises(RuntimeError, match="module"):
        launch(launcher.sock_path, "module", ["x"], {}, [1, 2], module="os; import sys")
    proc = launcher.launch_cli(["--help"], {"PATH": "/usr/bin:/bin"}, tmp_path / "help.log")
    assert proc.wait(60) == 0
    wait_until(lambda: "daemon" in (tmp_path / "help.log").read_text(), 10, what="the help text")
