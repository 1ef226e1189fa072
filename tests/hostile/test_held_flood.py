"""Held requests (`?wait=` long-polls) from many source addresses must not starve the peers that work.

Seen on main before: long-polls of the learner's head from 12 loopback addresses, each address
within its own per-client shares, took the learner's whole `waiting` budget and its connections,
and every refusal came back at once to be re-sent at once: the learner's step rate fell to 0.38x
and 0.42x (the attacker in a cgroup of 0.25 CPU). Per-address caps cannot stop an attacker with
many addresses. What does: everyone not seen working shares one budget, the rest is a reserve that
only peers seen working may take (the rollout peer, whose groups the learner accepted, known by the
credential its requests carry), and a client refused again before its Retry-After is up gets its
answer only then.

The attacker is a separate process in a cgroup of its own with a CPU quota, so what is measured is
the server's budgets, not CPU taken by the attacker's own loop. From ADDRESSES loopback addresses
(127.0.0.x, each bound as the source address) it keeps CONNECTIONS connections each holding a
long-poll for a head nobody will publish, and re-sends (or reconnects) the moment one is answered,
whatever the answer and its Retry-After.

Run as a script (`python test_held_flood.py HOST PORT FIRST_ADDRESS ADDRESSES CONNECTIONS`) this
file is that attacker: it waits for a line on stdin (the test puts it in its cgroup first), then
floods, printing one JSON line of counters a second.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

HOLD_PATH = "/v1/head?after=999999999999&wait=15"  # a head nobody will publish: held the whole wait
ADDRESSES = 12  # source addresses, 127.0.0.FIRST .. FIRST+11: more than any per-address cap assumes
CONNECTIONS = 48  # per address: past its share (32); together (576) past twice max_connections (512)
ATTACKER_CPUS = 0.25  # the attacker's CPU quota (cpu.max), in CPUs
FIRST_ADDRESS = 20


# -- the attacker (run as a script) --------------------------------------------------------------

async def _hold_forever(host: str, port: int, source: str, counts: Counter[str]) -> None:
    request = f"GET {HOLD_PATH} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    while True:
        try:
            reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
        except OSError:
            counts["connect_failed"] += 1
            await asyncio.sleep(0.05)  # the attacker's own pace when the server will not accept
            continue
        counts["connected"] += 1
        try:
            while True:
                writer.write(request)
                await writer.drain()
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
                status = head.split(None, 2)[1]
                length = next((int(line.split(":", 1)[1]) for line in head.split("\r\n")
                               if line.startswith("content-length:")), 0)
                await reader.readexactly(length)
                counts[status] += 1
                if "connection: close" in head:
                    break
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, IndexError, ValueError):
            counts["dropped"] += 1
        finally:
            writer.close()


async def _attack(host: str, port: int, first: int, addresses: int, connections: int) -> None:
    counts: Counter[str] = Counter()
    sources = [f"127.0.0.{first + i}" for i in range(addresses)]
    tasks = [asyncio.create_task(_hold_forever(host, port, s, counts)) for s in sources for _ in range(connections)]
    while True:
        await asyncio.sleep(1.0)  # report interval
        print(json.dumps(dict(counts)), flush=True)
        if any(t.done() for t in tasks):
            raise SystemExit(f"a flood task ended: {next(t for t in tasks if t.done()).exception()!r}")


if __name__ == "__main__":
    sys.stdin.readline()  # go: the test has put us in our cgroup
    host, port, first, addresses, connections = sys.argv[1], *map(int, sys.argv[2:])
    asyncio.run(_attack(host, port, first, addresses, connections))
    raise SystemExit(0)


# -- the test ------------------------------------------------------------------------------------

import pytest  # noqa: E402
from helpers.rogue import training_swarm  # noqa: E402
from helpers.swarm import LocalSwarm, http_json, read_metrics, wait_until  # noqa: E402

from echo2swarm.config.models import ChunkServerConfig  # noqa: E402

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]
WINDOW_S = 12.0  # seconds of training measured before the attack, and again during it


class CpuCage:
    """A cgroup of our own (a generated name) whose processes get at most `cpus` CPUs; removed on exit.

    cgroup v2 (`cpu.max`) where /sys/fs/cgroup is v2 with the cpu controller, else the v1 cpu
    controller (`cpu.cfs_quota_us`); skips the test where neither is writable.
    """

    PERIOD_US = 100_000

    def __init__(self, cpus: float):
        self.quota = int(cpus * self.PERIOD_US)
        self.name = f"e2s-held-flood-{os.getpid()}-{secrets.token_hex(4)}"
        self.dir: Path | None = None

    def __enter__(self) -> "CpuCage":
        v2, v1 = Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/cpu")
        try:
            if (v2 / "cgroup.controllers").exists() and "cpu" in (v2 / "cgroup.subtree_control").read_text().split():
                self.dir = v2 / self.name
                self.dir.mkdir()
                (self.dir / "cpu.max").write_text(f"{self.quota} {self.PERIOD_US}")
            elif (v1 / "cpu.cfs_quota_us").exists():
                self.dir = v1 / self.name
                self.dir.mkdir()
                (self.dir / "cpu.cfs_period_us").write_text(str(self.PERIOD_US))
                (self.dir / "cpu.cfs_quota_us").write_text(str(self.quota))
            else:
                pytest.skip("no cpu cgroup controller here (v2 cpu.max or v1 cpu.cfs_quota_us)")
        except OSError as e:
            self.__exit__()
            pytest.skip(f"cannot make a cgroup with a CPU quota here: {e}")
        return self

    def add(self, pid: int) -> None:
        assert self.dir is not None
        (self.dir / "cgroup.procs").write_text(str(pid))

    def __exit__(self, *exc: object) -> None:
        if self.dir is None or not self.dir.exists():
            return
        deadline = time.monotonic() + 10
        while True:  # empty only once its processes are gone (the caller ended them)
            try:
                self.dir.rmdir()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)  # the kernel frees an exited process's cgroup membership shortly


class Attacker:
    """The attacking process, in `cage`; ended by its pid."""

    def __init__(self, host: str, port: int, cage: CpuCage):
        # Run as a script this file imports nothing but the standard library before it floods.
        self.proc = subprocess.Popen(
            [sys.executable, __file__, host, str(port), str(FIRST_ADDRESS), str(ADDRESSES), str(CONNECTIONS)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        try:
            cage.add(self.proc.pid)
            assert self.proc.stdin is not None
            self.proc.stdin.write("go\n")
            self.proc.stdin.flush()
        except BaseException:
            self.proc.kill()  # never left running outside its cage, nor inside it
            self.proc.wait(5)
            raise

    def stop(self) -> list[dict[str, int]]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        out = self.proc.stdout.read() if self.proc.stdout else ""
        return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


class KeptOpen:
    """An operator's keep-alive connection to a daemon's HTTP server, opened before the flood: it keeps
    its connection unit, so /v1/info stays readable while new connections are refused."""

    def __init__(self, host: str, port: int):
        self.conn = http.client.HTTPConnection(host, port, timeout=10)

    def info(self) -> dict[str, Any]:
        self.conn.request("GET", "/v1/info")
        resp = self.conn.getresponse()
        body = resp.read()
        assert resp.status == 200, (resp.status, body[:200])
        return json.loads(body)


def _steps(metrics: Path) -> int:
    return len(read_metrics(metrics))


def _window(metrics: Path, seconds: float, look: Callable[[], None]) -> float:
    """Steps per second over `seconds` of training; `look()` is called all along."""
    started, first = time.monotonic(), _steps(metrics)
    while (now := time.monotonic()) < started + seconds:
        look()
        time.sleep(0.25)  # sampling interval of the lag and the learner's budgets
    return (_steps(metrics) - first) / (now - started)


@pytest.mark.slow
def test_held_requests_from_many_addresses_leave_the_working_peers_their_reserve(
    local_swarm: LocalSwarm, tiny_model_dir: Path, policy_key: Path, tmp_path: Path
):
    learner, honest, _, metrics = training_swarm(local_swarm, tiny_model_dir, policy_key, tmp_path, steps_first=5)
    staleness = 1  # learner_toml's train.staleness: S
    config = ChunkServerConfig()  # the learner's chunk server runs with the defaults
    host, port = learner.info["chunk_url"].removeprefix("http://").rsplit(":", 1)
    honest_info = honest.info["chunk_url"] + "/v1/info"
    operator = KeptOpen(host, int(port))  # opened before the flood: it keeps its connection
    seen: Counter[str] = Counter()  # the largest of each figure sampled

    def look() -> None:
        records = read_metrics(metrics)
        published = records[-1]["published_version"] if records else 0
        seen["lag"] = max(seen["lag"], published - (http_json(honest_info, timeout=10).get("version") or 0))
        server = operator.info()["stats"]["server"]
        working = server.get("working_open_waiting", 0)
        seen["working_waiting"] = max(seen["working_waiting"], working)
        seen["others_waiting"] = max(seen["others_waiting"], server.get("open_waiting", 0) - working)

    before = _window(metrics, WINDOW_S, look)
    assert seen["lag"] <= staleness, f"the rollout peer was {seen['lag']} versions behind before the flood"
    seen.clear()
    with CpuCage(ATTACKER_CPUS) as cage:
        attacker = Attacker(host, int(port), cage)
        try:
            wait_until(lambda: operator.info()["stats"]["server"].get("open_waiting", 0) >= 16, 30,
                       what="the flood to hold requests at the learner")
            during = _window(metrics, WINDOW_S, look)
            server = operator.info()["stats"]["server"]
        finally:
            counts = attacker.stop()
    summary = (f"steps/s before {before:.2f}, during {during:.2f} ({during / before:.2f}x); sampled {dict(seen)}; "
               f"attacker {counts[-1] if counts else None}; learner's server {server}")
    print(summary)
    assert counts and sum(v for k, v in counts[-1].items() if k.isdigit()) > 100, summary  # the flood was answered
    # The attacker held all it may (everyone not seen working shares max_waiting - held_reserve), and no more.
    assert seen["others_waiting"] == config.max_waiting - config.held_reserve, summary
    # The rollout peer's long-polls were held from the reserve, never refused; the flood's refusals were paced.
    assert seen["working_waiting"] >= 1 and server.get("refused_waiting_reserve", 0) == 0, summary
    assert server["paced_refusals"] > 0 and server["refused_waiting"] > 0, summary
    assert during >= 0.5 * before, summary
    assert seen["lag"] <= staleness, f"the rollout peer fell {seen['lag']} versions behind (S = {staleness}): {summary}"
