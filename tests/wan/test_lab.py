"""The lab itself: NAT semantics (homes reach out, nobody reaches in), kernel-enforced caps, clean teardown."""

from __future__ import annotations

import sys

import pytest

from tests.helpers.wanlab import WanLab

# Receive on a TCP port until the sender closes; print bytes and seconds from first to last byte.
SINK = r"""
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); n = 0; first = None
while (b := c.recv(1 << 16)):
    first = first or time.monotonic(); n += len(b)
print(n, time.monotonic() - first, flush=True)
"""
# Serve N bytes to the first client; the client measures from its first to its last byte.
SERVE = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); c.sendall(b"x" * int(sys.argv[2])); c.close()
"""
FETCH = r"""
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30); n = 0; first = None
while (b := c.recv(1 << 16)):
    first = first or time.monotonic(); n += len(b)
print(n, time.monotonic() - first, flush=True)
"""
SEND = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4]))
c.sendall(b"x" * int(sys.argv[3])); c.close(); print("sent")
"""


def _reaches(src, dst, port: int = 9000, timeout: float = 2.0) -> bool:
    sink = dst.popen([sys.executable, "-c", SINK, str(port)], stdout=-1, text=True)
    assert sink.stdout.readline().strip() == "ready"
    sent = src.run([sys.executable, "-c", SEND, dst.ip, str(port), "10", str(timeout)], timeout=timeout + 10)
    ok = sent.returncode == 0
    sink.kill()
    sink.wait(5)
    return ok


def _rate_mbit(src, dst, nbytes: int, port: int = 9001) -> float:
    sink = dst.popen([sys.executable, "-c", SINK, str(port)], stdout=-1, text=True)
    assert sink.stdout.readline().strip() == "ready"
    sent = src.run([sys.executable, "-c", SEND, dst.ip, str(port), str(nbytes), "30"], timeout=60)
    assert sent.returncode == 0, sent.stderr
    got, seconds = sink.stdout.readline().split()
    sink.wait(10)
    assert int(got) == nbytes
    return nbytes * 8 / float(seconds) / 1e6


def _download_mbit(server, client, nbytes: int, port: int = 9002) -> float:
    """A client (possibly behind NAT) fetches nbytes from a server: the server's uplink, the client's downlink."""
    serve = server.popen([sys.executable, "-c", SERVE, str(port), str(nbytes)], stdout=-1, text=True)
    assert serve.stdout.readline().strip() == "ready"
    got = client.run([sys.executable, "-c", FETCH, server.ip, str(port)], timeout=60, check=True)
    n, seconds = got.stdout.split()
    serve.wait(10)
    assert int(n) == nbytes
    return nbytes * 8 / float(seconds) / 1e6


@pytest.mark.timeout(120)
def test_homes_reach_out_but_nobody_reaches_in(lab: WanLab) -> None:
    pub = lab.public_host("pub")
    a, = lab.home("a")
    b, = lab.home("b")
    assert _reaches(a, pub), "a home must reach a public host"
    assert _reaches(pub, pub), "a public host reaches itself"
    assert not _reaches(pub, a), "the internet must not open connections into a home (no port forwarding)"
    assert not _reaches(b, a), "homes must not reach each other directly"


@pytest.mark.timeout(180)
def test_caps_are_enforced_by_the_kernel(lab: WanLab) -> None:
    pub = lab.public_host("pub", up_mbit=20, down_mbit=200)
    home, = lab.home("h", up_mbit=10, down_mbit=40)
    up = _rate_mbit(home, pub, 4_000_000)
    down = _download_mbit(pub, home, 4_000_000)
    fast = lab.public_host("fast", up_mbit=200)
    home_down = _download_mbit(fast, home, 8_000_000, port=9003)
    print(f"home uplink {up:.1f} Mbit/s (cap 10); public host's uplink to the home {down:.1f} (cap 20); "
          f"home downlink from a fast host {home_down:.1f} (cap 40)")
    assert 7 <= up <= 11.5
    assert 15 <= down <= 23
    assert 30 <= home_down <= 45
    assert lab.uplink_bytes("h") >= 4_000_000


@pytest.mark.timeout(60)
def test_close_ends_processes_and_deletes_exactly_its_namespaces() -> None:
    from tests.helpers.wanlab import unavailable

    if unavailable():
        pytest.skip(unavailable())
    lab = WanLab()
    host = lab.public_host("p")
    proc = host.popen([sys.executable, "-c", "import time; time.sleep(600)"])
    names = list(lab.namespaces)
    lab.close()
    assert proc.wait(15) is not None
    assert not lab.leftovers(), names
