"""Daemons as child processes, for the demo, local swarms and tests.

Each child is ended by its own pid (SIGTERM, then SIGKILL after a grace period), never by name,
so running this next to other echo2swarm users on one machine is safe.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from echo2swarm.runtime.launcher import LaunchedProcess, Launcher

T = TypeVar("T")


LOCAL_ANNOUNCE_PERIOD_S = 1.0
LOCAL_RECORD_TTL_S = 4.0


def loopback_args(swarm: str, log_level: str = "INFO") -> list[str]:
    """Daemon flags for a swarm confined to 127.0.0.1 (demo, tests, benchmarks).

    Short announce period and TTL so a laptop swarm reacts within seconds; public swarms keep the defaults.
    """
    return [
        "--swarm", swarm, "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--chunk-host", "127.0.0.1",
        "--announce-period", str(LOCAL_ANNOUNCE_PERIOD_S), "--record-ttl", str(LOCAL_RECORD_TTL_S),
        "--log-level", log_level,
    ]


class ProcessFailed(RuntimeError):
    pass


def wait_until(predicate: Callable[[], T], timeout: float, interval: float = 0.1, what: str = "condition") -> T:
    """Poll `predicate` until it returns something truthy; raise TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid`, read from /proc (Linux)."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name may hold spaces and parentheses; fields after the last ')' are fixed.
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            children.append(int(entry))
    return children


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[-1].split()[0]
        return state != "Z"
    except OSError:
        return False


class DaemonProcess:
    """`echo2swarm daemon ARGS` as a child process with its own state dir and log file.

    >>> d = DaemonProcess("rollout-1", ["--role", "rollout", "--initial-peers", addr], run_dir / "rollout-1")
    >>> info = d.start().wait_ready(timeout=60)     # contents of daemon.json: peer_id, maddrs, chunk_url
    >>> d.terminate()
    """

    def __init__(self, name: str, args: list[str], state_dir: Path, env: dict[str, str] | None = None,
                 wrap: list[str] | None = None, launcher: Launcher | None = None, netns: str | None = None):
        """`wrap`: a prefix that execs the command elsewhere, so the pid stays the daemon's. `launcher`:
        fork the daemon from this fork server (runtime/launcher.py) instead of starting a new
        interpreter; not with `wrap`. `netns`: run it in this network namespace (`ip netns exec NS`)."""
        if wrap and launcher is not None:
            raise ValueError("a wrapped daemon cannot be forked from a launcher")
        if netns and launcher is None:
            wrap = ["ip", "netns", "exec", netns, *(wrap or [])]
        self.name = name
        self.launcher = launcher
        self.netns = netns
        self.wrap = list(wrap or [])
        self.state_dir = Path(state_dir)
        self.args = ["--state-dir", str(self.state_dir), *args]
        self.log_path = self.state_dir / "daemon.log"
        self.env = env
        self.proc: subprocess.Popen[bytes] | LaunchedProcess | None = None
        self.info: dict[str, Any] = {}

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def prepare(self) -> dict[str, str]:
        """Its state dir made and last run's daemon.json gone; the environment it starts with."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        (self.state_dir / "daemon.json").unlink(missing_ok=True)
        return {**os.environ, "PYTHONUNBUFFERED": "1", **(self.env or {})}

    def start(self) -> "DaemonProcess":
        env = self.prepare()
        if self.launcher is not None:
            self.proc = self.launcher.launch_cli(["daemon", *self.args], env, self.log_path, netns=self.netns)
            return self
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*self.wrap, sys.executable, "-m", "echo2swarm.cli.main", "daemon", *self.args],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            )
        return self

    def _ready(self) -> dict[str, Any] | None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise ProcessFailed(f"{self.name} exited with code {self.proc.returncode}:\n{self.log_tail()}")
        try:
            info = json.loads((self.state_dir / "daemon.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return info if self._owns(info) else None

    def _owns(self, info: dict[str, Any]) -> bool:
        """Whether a daemon.json is this process's (not one a previous run left behind)."""
        assert self.proc is not None
        return info.get("pid") == self.proc.pid

    def wait_ready(self, timeout: float = 60.0) -> dict[str, Any]:
        self.info = wait_until(self._ready, timeout, what=f"{self.name} to start")
        return self.info

    @property
    def maddr(self) -> str:
        return self.info["maddrs"][0]

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self, grace: float = 10.0) -> float:
        """SIGTERM, wait up to `grace` seconds, then SIGKILL. Returns seconds until it exited."""
        if self.proc is None or self.proc.poll() is not None:
            return 0.0
        started = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        return time.monotonic() - started

    def signal_term(self) -> None:
        """SIGTERM without waiting (`terminate_all` ends many at once)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


def terminate_all(daemons: Sequence[DaemonProcess], grace: float = 10.0) -> None:
    """SIGTERM every daemon at once, wait up to `grace` seconds for all of them together, then SIGKILL the
    rest: a swarm of N daemons stops in about one daemon's shutdown time, not N of them."""
    for d in daemons:
        d.signal_term()
    deadline = time.monotonic() + grace
    for d in daemons:
        d.terminate(grace=max(0.0, deadline - time.monotonic()))
