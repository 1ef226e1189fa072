"""The launcher's server (runtime/launcher.py has the client and the protocol): imports what the
daemons load, listens on DIR/launcher.sock, forks one child per request and reaps them, writing
DIR/PID.SERIAL.exit for each. ``python -m echo2swarm.cli.fork_server DIR MODULE...``, started by `Launcher`.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from echo2swarm.runtime.launcher import KINDS, MAX_FDS, MAX_REQUEST

__all__ = ["reseed", "serve"]


def reseed() -> None:
    """Fresh random state for a forked child where fork does not give one: Python's `random` reseeds
    itself in a forked child; numpy's global generator would make the same draws in every child."""
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def _enter_netns(name: str) -> None:
    """Join the network namespace `ip netns add NAME` made (setns(2): os.setns arrived in Python 3.12)."""
    import ctypes

    clone_newnet = 0x40000000
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, clone_newnet) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _run(request: dict[str, Any], argv: list[str]) -> int:
    """What `python -m echo2swarm.cli.main ARGV` (cli), `python -m echo2swarm.rollout.engines.host_process
    ARGV` (engine-host) or `python -m MODULE ARGV` (module) would run, in this process."""
    if request["kind"] == "cli":
        from echo2swarm.cli.main import cli

        sys.argv = ["echo2swarm", *argv]
        cli.main(args=argv, prog_name="echo2swarm", standalone_mode=True)
        return 0
    if request["kind"] == "engine-host":
        from echo2swarm.rollout.engines import host_process

        sys.argv = [host_process.__file__, *argv]
        return host_process.main(argv)
    for entry in reversed(request["env"].get("PYTHONPATH", "").split(os.pathsep)):
        if entry and entry not in sys.path:  # what a new interpreter's sys.path would hold
            sys.path.insert(0, entry)
    sys.argv = [request["module"], *argv]
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    return 0


def _child(request: dict[str, Any], fds: list[int], closing: list[int]) -> None:
    """In the forked child: become what a fresh process started with this request would be, then exit."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        if request.get("netns"):
            _enter_netns(request["netns"])
        # The dispositions a new interpreter starts with: SIGPIPE ignored (a write to a closed socket
        # raises instead of killing), SIGINT raising KeyboardInterrupt, the rest the system's.
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd in closing:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        reseed()
        argv = [arg.format(**{f"fd{i}": fd for i, fd in enumerate(fds)}) for arg in request["argv"]]
        try:
            code = _run(request, argv)
        except SystemExit as e:  # as the interpreter ends on it: a message goes to stderr and means 1
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - the child must never return into the server's loop
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _reap(root: Path, serials: dict[int, int]) -> None:
    """Reap every child that exited and write its ROOT/PID.SERIAL.exit (the serial tells a child from
    an earlier one that had the same pid: pids are reused)."""
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        name = f"{pid}.{serials.pop(pid, 0)}.exit"
        tmp = root / f".{name}"
        tmp.write_text(json.dumps({"returncode": code, "cpu_s": usage.ru_utime + usage.ru_stime}))
        tmp.rename(root / name)


def _receive(conn: socket.socket, within_s: float = 10.0) -> tuple[dict[str, Any], list[int]]:
    """One request and its fds, read within `within_s` in all: a caller that stalls holds the
    (single-threaded) server no longer than that."""
    deadline = time.monotonic() + within_s
    conn.settimeout(within_s)
    head, fds, _, _ = socket.recv_fds(conn, 4, MAX_FDS)
    try:
        size = int.from_bytes(head, "big")
        if len(head) != 4 or size > MAX_REQUEST:
            raise ValueError("a request is a 4-byte length and at most 1 MiB of JSON")
        body = bytearray()
        while len(body) < size:
            conn.settimeout(max(0.001, deadline - time.monotonic()))
            if not (part := conn.recv(size - len(body))):
                break
            body += part
        request = json.loads(body)
        if not (isinstance(request, dict) and request.get("kind") in KINDS and isinstance(request.get("argv"), list)
                and all(isinstance(a, str) for a in request["argv"]) and isinstance(request.get("env"), dict)
                and all(isinstance(k, str) and isinstance(v, str) for k, v in request["env"].items())
                and isinstance(request.get("cwd"), str) and len(fds) >= 2):
            raise ValueError(f"a request is {{kind: one of {KINDS}, argv, env, cwd}} with at least two fds")
        netns = request.get("netns")
        if netns is not None and not (isinstance(netns, str) and netns and "/" not in netns and netns not in (".", "..")):
            raise ValueError("netns is the name of a network namespace under /var/run/netns")
        if request["kind"] == "module" and not (isinstance(request.get("module"), str)
                                                 and all(part.isidentifier() for part in request["module"].split("."))):
            raise ValueError("a module request names a module: dotted identifiers")
        return request, fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def serve(root: Path, preload: list[str]) -> int:
    import importlib

    for name in preload:
        importlib.import_module(name)
    sock_path = root / "launcher.sock"
    sock_path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)  # only this user may ask for forks
    try:
        listener.bind(str(sock_path))
    finally:
        os.umask(old_umask)
    listener.listen(64)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the caller: the caller ends us
    selector = selectors.DefaultSelector()
    selector.register(sys.stdin.fileno(), selectors.EVENT_READ)
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    os.write(1, b"ready\n")
    serials: dict[int, int] = {}  # children not reaped yet: pid -> the serial of its fork
    serial = 0
    closing = [wake_read, wake_write, listener.fileno(), sys.stdin.fileno(), selector.fileno()]
    while True:
        for key, _ in selector.select():
            if key.fileobj == wake_read:
                while True:
                    try:
                        if not os.read(wake_read, 512):
                            break
                    except BlockingIOError:
                        break
            elif key.fileobj == sys.stdin.fileno():
                if not os.read(sys.stdin.fileno(), 512):  # the owner closed it: stop taking requests
                    listener.close()
                    sock_path.unlink(missing_ok=True)
                    _reap(root, serials)
                    return 0
            else:
                conn, _ = listener.accept()
                with conn:
                    try:
                        request, fds = _receive(conn)
                    except Exception as e:  # noqa: BLE001 - garbage, nested too deep, too slow: refused, serving on
                        with contextlib.suppress(OSError):
                            conn.sendall(json.dumps({"error": str(e)}).encode())
                        continue
                    try:
                        pid = os.fork()
                        if pid == 0:
                            _child(request, fds, [*closing, conn.fileno()])
                        serial += 1
                        serials[pid] = serial
                        conn.sendall(json.dumps({"pid": pid, "serial": serial}).encode())
                    except OSError as e:
                        with contextlib.suppress(OSError):
                            conn.sendall(json.dumps({"error": str(e)}).encode())
                    finally:
                        for fd in fds:
                            os.close(fd)
        _reap(root, serials)


if __name__ == "__main__":
    sys.exit(serve(Path(sys.argv[1]), sys.argv[2:]))
