"""Real daemons on 127.0.0.1 for swarm and e2e tests; every process ended by its own pid."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from echo2swarm.learner.metrics import read_metrics
from echo2swarm.runtime.processes import (
    LOCAL_ANNOUNCE_PERIOD_S,
    LOCAL_RECORD_TTL_S,
    DaemonProcess,
    child_pids,
    loopback_args,
    pid_alive,
    terminate_all,
    wait_until,
)
from echo2swarm.runtime.launcher import Launcher

RECORD_TTL_S = LOCAL_RECORD_TTL_S


def run_cli(*args: str, timeout: float = 60.0, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "echo2swarm.cli.main", *args],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL,
    )


class BootstrapPool:
    """Bootstraps started one test ahead: a test's first step, a bootstrap of a new swarm, costs seconds
    (torch, hivemind, p2pd) before anything else can join. The pool hands out one started during the
    test before, each of its own swarm name as `LocalSwarm.bootstrap` would start it, and starts the
    next; the one nobody took is ended by `close()`."""

    def __init__(self, root: Path, launcher: Launcher | None = None):
        self.root = root
        self.launcher = launcher
        self.spare: tuple[DaemonProcess, str] | None = None
        self.started = 0

    def _start(self) -> tuple[DaemonProcess, str]:
        self.started += 1
        swarm = f"b{os.getpid() % 10000}x{self.started}"
        d = DaemonProcess("bootstrap", [*loopback_args(swarm, "DEBUG"), "--role", "bootstrap", "--new-swarm"],
                          self.root / swarm, launcher=self.launcher)
        return d.start(), swarm

    def take(self) -> tuple[DaemonProcess, str]:
        """A started bootstrap (not necessarily ready yet) and its swarm's name."""
        taken = self.spare or self._start()
        self.spare = self._start()
        return taken

    def close(self) -> None:
        if self.spare is not None:
            d = self.spare[0]
            children = child_pids(d.pid) if d.running() else []
            d.terminate(grace=10)
            for pid in children:  # its p2pd, if it outlived a SIGKILLed daemon
                if pid_alive(pid):
                    os.kill(pid, signal.SIGKILL)
            self.spare = None


class LocalSwarm:
    """Start daemons of one swarm; `close()` ends them (SIGTERM, then SIGKILL) and any p2pd they left.

    Shared by several tests (tests/conftest.py `module_swarm`): a module-scoped fixture starts what its
    tests read once, and each test adds its own daemons through `joined(tmp_path)`, a view on the same
    swarm whose `close()` ends only the daemons started through it."""

    def __init__(self, root: Path, swarm: str = "test", pool: BootstrapPool | None = None):
        self.root = root
        self.swarm = swarm
        self.pool = pool
        self.launcher = pool.launcher if pool is not None else None  # daemons are forked from it (runtime/launcher.py)
        self.daemons: list[DaemonProcess] = []
        self._children: set[int] = set()
        self.bootstrap_addr: str | None = None
        self.shared: LocalSwarm | None = None  # the swarm this one is a view on (`joined`)

    def joined(self, root: Path) -> "LocalSwarm":
        """A view on this swarm for one test: same name and bootstrap, its own daemons under `root`."""
        view = LocalSwarm(root, self.swarm, self.pool)
        view.bootstrap_addr, view.shared, view.launcher = self.bootstrap_addr, self, self.launcher
        return view

    def start(self, name: str, *args: str, state_dir: Path | None = None, join: bool = True,
              env: dict[str, str] | None = None) -> DaemonProcess:
        extra = ["--initial-peers", self.bootstrap_addr] if join and self.bootstrap_addr else []
        d = DaemonProcess(name, [*loopback_args(self.swarm, "DEBUG"), *extra, *args], state_dir or self.root / name, env=env,
                          launcher=self.launcher)
        self.daemons.append(d.start())
        return d

    def ready(self, daemon: DaemonProcess, timeout: float = 60.0) -> dict[str, Any]:
        info = daemon.wait_ready(timeout)
        self._children.update(child_pids(daemon.pid))
        return info

    def bootstrap(self) -> DaemonProcess:
        """Start the swarm's bootstrap, or take the one the pool started for it: the swarm then has the
        pool's fresh name (a swarm with daemons already started keeps its name and starts its own)."""
        if self.pool is not None and not self.daemons:
            d, self.swarm = self.pool.take()
            self.daemons.append(d)
        else:
            d = self.start("bootstrap", "--role", "bootstrap", "--new-swarm", join=False)
        self.ready(d)
        self.bootstrap_addr = d.maddr
        return d

    def learner(self, model: Path, key: Path, *args: str, name: str = "learner", **kw: Any) -> DaemonProcess:
        return self.start(name, "--role", "learner", "--model", str(model), "--policy-key", str(key), *args, **kw)

    def rollout(self, name: str, *args: str, price: float = 0.3, trust: Path | None = None, **kw: Any) -> DaemonProcess:
        trust_args = ["--trust", f"{trust}"] if trust else []
        return self.start(name, "--role", "rollout", "--price", str(price), *trust_args, *args, **kw)

    def all_daemons(self) -> list[DaemonProcess]:
        """Every daemon started in this swarm, in start order; a view's shared daemons first."""
        return [*(self.shared.all_daemons() if self.shared else []), *self.daemons]

    def log_tails(self, lines: int) -> list[tuple[str, str]]:
        """(name, digest) for every daemon of `all_daemons()`: see `log_digest`."""
        return [(d.name, log_digest(d, lines)) for d in self.all_daemons()]

    def close(self) -> None:
        for d in self.daemons:
            if d.running():
                self._children.update(child_pids(d.pid))
        terminate_all(list(reversed(self.daemons)), grace=10)  # all at once: a swarm stops in one shutdown's time
        for pid in self._children:  # only pids our daemons spawned (p2pd)
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def log_digest(daemon: DaemonProcess, lines: int) -> str:
    """A daemon's last `lines` warnings and errors, then its last `lines` lines (at DEBUG a busy
    daemon's tail covers only seconds)."""
    try:
        text = daemon.log_path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return "(no log)"
    alarms = [line for line in text if " WARN " in line or " ERROR " in line][-lines:]
    return "\n".join([f"-- last {len(alarms)} warnings and errors", *alarms, f"-- last {min(lines, len(text))} lines",
                      *text[-lines:]])


class SwarmWatcher:
    """An in-process DHT client that reads the swarm's census quickly (the CLI pays import time per call)."""

    def __init__(self, addr: str, swarm: str):
        from echo2swarm.config.models import OverlayConfig

        self.config = OverlayConfig(swarm=swarm, initial_peers=[addr], host_maddrs=[])
        self.loop = asyncio.new_event_loop()
        self.overlay: Any = None

    def __enter__(self) -> "SwarmWatcher":
        from echo2swarm.overlay.node import Overlay

        self.overlay = self.loop.run_until_complete(Overlay.start(self.config, client_mode=True))
        return self

    def census(self) -> dict[str, Any]:
        from echo2swarm.overlay.census import census

        return self.loop.run_until_complete(census(self.overlay))

    def peers(self) -> dict[str, dict[str, Any]]:
        return {p["peer_id"]: p for p in self.census()["peers"]}

    def __exit__(self, *exc: object) -> None:
        self.loop.run_until_complete(self.overlay.stop())
        # hivemind leaves store/ping tasks behind; end them so closing the loop is quiet.
        pending = asyncio.all_tasks(self.loop)
        for task in pending:
            task.cancel()
        if pending:  # gather() of nothing would make its future on another loop
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.close()


def peers_json(addr: str, swarm: str, timeout: float = 60.0) -> list[dict[str, Any]]:
    result = run_cli("peers", "--initial-peers", addr, "--swarm", swarm, "--json", timeout=timeout)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def http_json(url: str, timeout: float = 10.0) -> dict[str, Any]:
    """The JSON body of a GET. A 429 or 503 (the server's budgets full: policy/server.py) is asked again after
    its Retry-After, as any polite client would, until `timeout` has passed; then it is raised."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=max(0.5, deadline - time.monotonic())) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            retry_after = _retry_after(e)
            if retry_after is None or time.monotonic() + retry_after > deadline:
                raise
            time.sleep(retry_after)  # the wait the server asked for (bounded by `deadline`), not a guess


def daemon_state(daemon: DaemonProcess, timeout: float = 10.0) -> str:
    """Where every thread and asyncio task of a running daemon waits (runtime/dump.py, on SIGUSR1),
    read back from its log: what a test that timed out on a daemon that went quiet reports."""
    assert daemon.proc is not None and daemon.proc.poll() is None, f"{daemon.name} is not running"
    marker = "state on SIGUSR1:"
    seen = daemon.log_path.read_text(errors="replace").count(marker)
    daemon.proc.send_signal(signal.SIGUSR1)
    try:
        wait_until(lambda: daemon.log_path.read_text(errors="replace").count(marker) > seen, timeout, interval=0.2,
                   what=f"{daemon.name} to log its state")
    except TimeoutError:
        return f"{daemon.name} logged no state within {timeout:.0f} s of SIGUSR1: its event loop is blocked"
    text = daemon.log_path.read_text(errors="replace")
    return text[text.rindex(marker):]


def stalled_report(info_url: str, learner: DaemonProcess, peers: list[DaemonProcess]) -> str:
    """What a failure report needs when a swarm stopped stepping: the learner's intake and plan, the
    rollout peers' worker counters, and where every task of them all waits (runtime/dump.py)."""
    stats = http_json(info_url)["stats"]
    parts = [f"learner: steps {stats['steps_done']}, capacity {stats['capacity']}, peers {stats['peers']}, "
             f"leases {stats.get('leases')}"]
    for peer in peers:
        worker = http_json(peer.info["chunk_url"] + "/v1/info").get("stats", {}).get("worker")
        parts.append(f"{peer.name}: worker {worker}")
    parts += [daemon_state(d) for d in (learner, *peers)]
    return "\n".join(parts)


def _retry_after(error: Any) -> float | None:
    """Seconds a busy answer (429, 503) asks to wait before asking again; None for any other error."""
    if error.code not in (429, 503):
        return None
    try:
        return min(5.0, max(0.1, float(error.headers.get("Retry-After", "1"))))
    except ValueError:
        return 1.0


def http_status(url: str, method: str = "GET", data: bytes | None = None, headers: dict[str, str] | None = None,
                timeout: float = 10.0) -> tuple[int, str]:
    """(status, body) of one request, an error status included: what a test that expects a refusal reads."""
    import http.client
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, method=method, data=data, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        try:
            body = e.read().decode(errors="replace")
        except (OSError, http.client.HTTPException):  # a server that refuses may close before its body
            body = ""
        return e.code, body


__all__ = ["LocalSwarm", "SwarmWatcher", "daemon_state", "http_json", "http_status", "learner_toml", "peers_json", "read_metrics", "run_cli", "wait_until"]


# [overlay] of a learner that starts its own swarm on 127.0.0.1 (scripts/launch_learner.sh runs it from a TOML).
LOOPBACK_OVERLAY = {"new_swarm": True, "host_maddrs": ["/ip4/127.0.0.1/tcp/0"], "announce_period_s": LOCAL_ANNOUNCE_PERIOD_S,
                    "record_ttl_s": RECORD_TTL_S}


def _toml_value(value: Any) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    return json.dumps(value)  # strings, numbers, booleans and lists of them are written alike in TOML


def learner_toml(path: Path, model: Path, key: Path, *, publish: dict[str, Any] | None = None,
                 sections: dict[str, dict[str, Any]] | None = None, top: dict[str, Any] | None = None,
                 **train: Any) -> Path:
    """A learner config for tests: small steps, fast leases. `train` overrides [train] keys, `publish`
    adds [publish] keys, `sections` adds (or, for [leases], overrides keys of) other tables, e.g.
    ``sections={"activation": {"enabled": False}}``, and `top` adds top-level keys such as state_dir."""
    settings = {"task": "arith", "steps": 30, "staleness": 1, "prompts_per_step": 8, "group_size": 4,
                "max_new_tokens": 4, "checkpoint_every": 10, "threads": 1, **train}
    tables: dict[str, dict[str, Any]] = {
        "publish": {"model": str(model), "policy_key": str(key), **(publish or {})},
        "train": settings,
        "leases": {"max_prompts": 4, "timeout_s": 5.0},
    }
    for name, values in (sections or {}).items():
        tables[name] = {**tables.get(name, {}), **values}
    lines = [f"{k} = {_toml_value(v)}" for k, v in {"role": "learner", **(top or {})}.items()]
    for name, values in tables.items():
        lines += [f"[{name}]", *(f"{k} = {_toml_value(v)}" for k, v in values.items())]
    path.write_text("\n".join(lines) + "\n")
    return path
