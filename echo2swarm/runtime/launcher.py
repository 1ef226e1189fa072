"""A fork server for local swarms: one process imports torch, transformers and hivemind once, then
forks each daemon, and each rollout peer's engine host, from that state instead of each new
interpreter paying the same seconds of imports again.

    Launcher(dir).start() ─► `python -m echo2swarm.cli.fork_server DIR` imports, listens on DIR/launcher.sock
    launch(sock, kind, argv, env, fds) ─► one JSON request and its file descriptors (SCM_RIGHTS)
        ─► fork: the child takes the fds as its stdout and stderr (and, for an engine host, its
           connection and lifeline), sets the caller's environment and working directory, reseeds
           its random state and runs `echo2swarm ARGV` (kind "cli") or the engine host ("engine-host")
        ◄── {"pid": N, "serial": SERIAL}
    a child exits ─► the server reaps it and writes DIR/N.SERIAL.exit ({"returncode", "cpu_s"}; pids are reused)

A forked daemon runs the same command line with the same environment as a spawned one; only what
the imports themselves read from the environment is fixed when the server starts (it sets
OMP_WAIT_POLICY before torch loads, as the daemon does). The children are the server's, not the
caller's: `LaunchedProcess` answers `poll`, `wait` and the signals as `subprocess.Popen` does, from
the status files. A daemon started with E2S_LAUNCHER (the socket's path) in its environment
forks its engine hosts the same way (rollout/engines/host.py). The test suite's local swarms use it:
hundreds of daemon and engine starts would otherwise each import the same libraries.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["ENV", "LaunchedProcess", "Launcher", "launch"]

ENV = "E2S_LAUNCHER"  # in a daemon's environment: fork its engine hosts from the launcher at this socket (not a config key)

# What the server imports before it forks: what every daemon role and engine host loads.
PRELOAD = (
    "torch",
    "hivemind",
    "transformers",
    "transformers.models.qwen3.modeling_qwen3",
    "echo2swarm.cli.main",
    "echo2swarm.cli.daemon",
    "echo2swarm.daemon.supervisor",
    "echo2swarm.daemon.learner_service",
    "echo2swarm.daemon.follower_service",
    "echo2swarm.rollout.engines.host_process",
    "echo2swarm.rollout.engines.hf",
)
KINDS = ("cli", "engine-host", "module")
MAX_REQUEST = 1 << 20
MAX_FDS = 8
MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes on Linux, 104 elsewhere


class LaunchedProcess:
    """A process the launcher forked, answered as `subprocess.Popen` answers for a child."""

    def __init__(self, pid: int, serial: int, status_dir: Path, args: list[str]):
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self.cpu_s = 0.0
        self._status = status_dir / f"{pid}.{serial}.exit"

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                status = json.loads(self._status.read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                return None
            self.returncode, self.cpu_s = int(status["returncode"]), float(status["cpu_s"])
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.005
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(pause)
            pause = min(0.05, pause * 2)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # a reaped child is not signalled: its pid may be another process's by now
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def launch(sock_path: str | Path, kind: str, argv: list[str], env: dict[str, str], fds: list[int],
           cwd: Path | None = None, module: str | None = None, netns: str | None = None) -> LaunchedProcess:
    """Fork `kind` from the launcher at `sock_path`: `echo2swarm ARGV` (cli), an engine host, or
    `python -m MODULE ARGV` (module). `fds`: its stdout and stderr, then (engine host) its connection
    and lifeline, which it receives as `argv`'s "{fd2}" and "{fd3}". `netns`: a network namespace
    (`ip netns` name) the child enters first, as under `ip netns exec`."""
    sock_path = Path(sock_path)
    request = json.dumps({"kind": kind, "argv": argv, "env": env, "cwd": str(cwd or Path.cwd()),
                          **({"module": module} if module else {}), **({"netns": netns} if netns else {})}).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(30.0)
        conn.connect(str(sock_path))
        socket.send_fds(conn, [len(request).to_bytes(4, "big")], fds)
        conn.sendall(request)
        reply = json.loads(_read_all(conn, MAX_REQUEST) or b"{}")
    if "pid" not in reply:
        raise RuntimeError(f"the launcher at {sock_path} could not start {kind} {' '.join(argv)}: {reply.get('error')}")
    return LaunchedProcess(int(reply["pid"]), int(reply["serial"]), sock_path.parent, [kind, *argv])


def _read_all(conn: socket.socket, limit: int) -> bytes:
    parts, size = [], 0
    while size <= limit and (part := conn.recv(65536)):
        parts.append(part)
        size += len(part)
    return b"".join(parts)


class Launcher:
    """Starts the server and ends it; `launch_cli` forks `echo2swarm ARGS` from it."""

    def __init__(self, root: Path | None = None, preload: tuple[str, ...] = PRELOAD):
        """`root`: where the socket and the exit statuses live (a fresh private temp dir, removed by
        `close`, when None: a socket's path must stay under ~100 bytes)."""
        self.own_root = root is None
        self.root = Path(tempfile.mkdtemp(prefix="e2s-launcher-")) if root is None else Path(root)
        self.sock_path = self.root / "launcher.sock"
        if len(os.fsencode(self.sock_path)) > MAX_SOCKET_PATH:
            raise ValueError(f"the launcher's socket path {self.sock_path} is longer than {MAX_SOCKET_PATH} bytes: "
                             "give it a shorter directory")
        self.preload = preload
        self.proc: subprocess.Popen[bytes] | None = None
        self._listening = False
        self._reaped: dict[str, float] = {}  # exit file -> its CPU seconds (written once, read once)

    def start(self) -> "Launcher":
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
        self.proc = subprocess.Popen([sys.executable, "-m", "echo2swarm.cli.fork_server", str(self.root), *self.preload],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        return self

    def ready(self) -> None:
        """Wait until the server has imported everything and listens (the first launch waits for it)."""
        assert self.proc is not None and self.proc.stdout is not None, "Launcher.start() first"
        if not self._listening:
            line = self.proc.stdout.readline()
            if line.strip() != b"ready":
                raise RuntimeError(f"the launcher did not start (code {self.proc.poll()}): {line!r}")
            self._listening = True

    def launch_cli(self, args: list[str], env: dict[str, str], log_path: Path, module: str | None = None,
                   netns: str | None = None) -> LaunchedProcess:
        """`echo2swarm ARGS` (or `python -m MODULE ARGS`), forked, its output appended to `log_path`,
        in network namespace `netns` if given; the engine hosts it starts are forked here too."""
        self.ready()
        env = {**env, ENV: str(self.sock_path)}
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            return launch(self.sock_path, "module" if module else "cli", args, env, [log, log], module=module,
                          netns=netns)
        finally:
            os.close(log)

    def reaped_cpu_s(self) -> float:
        """CPU seconds of every process forked here that has exited: daemons (their own children
        included) and the engine hosts their daemons forked here."""
        for path in self.root.glob("*.exit"):
            if path.name not in self._reaped:
                with contextlib.suppress(OSError, ValueError, KeyError):
                    self._reaped[path.name] = float(json.loads(path.read_text())["cpu_s"])
        return sum(self._reaped.values())

    def close(self, timeout: float = 10.0) -> None:
        """End the server (its daemons are the caller's to end, by pid, before)."""
        if self.proc is None:
            return
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()  # the server's signal to stop
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.proc.stdout.close()
        self.proc = None
        if self.own_root:
            shutil.rmtree(self.root, ignore_errors=True)
